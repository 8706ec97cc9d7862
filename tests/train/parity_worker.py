"""One rank of the parity runs: trains every requested (strategy, grad_accum) in turn.

Run by tests/train/test_parity.py through `shardwise.train.launch.spawn.spawn`; rank 0 writes one
`<strategy>-ga<N>.pt` per run with the loss curve and the consolidated final weights.
All runs share one process launch (interpreter and import cost paid once).
"""

from __future__ import annotations

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.loop import train

GLOBAL_BATCH = 4  # sequences per optimizer step, fixed across world sizes and accumulation
STEPS = 8


def parity_config(
    strategy: str, world: int, grad_accum: int, model: str = "tiny-llama", flags: tuple[str, ...] = ()
) -> TrainConfig:
    """Flags: `repeat` = every step sees the same global batch (learnable: the loss must fall);
    `ckpt` = activation checkpointing; `bf16` = bf16-mixed; `sg1` = shard group of 1 (HSDP);
    `stock` = FSDP2 reduce-scatters every micro-batch (torch's default) instead of once;
    `carved` = FSDP2 shards the embedding and the head as units of their own, every layer
    resharded after forward (`wrap_embeddings`, `reshard_after_forward: layers`: accelerate's layout);
    `fully_shard` = FSDP2 keeps fully_shard on a one-rank shard group (`single_rank: fsdp`;
    the default runs it as DDP where the plan allows); `lora` = LoRA rank 4 on every decoder linear (base frozen); `lorasave` = LoRA plus lm_head
    trained in full (PEFT modules_to_save); `std` = the standard cross-entropy instead of the
    chunked default; `ce<N>` = chunks of N tokens; `sft` = the bundled SFT data packed into rows
    of 128 tokens, SDPA (the packed rows' default attention: one SDPA call per document on CPU);
    `dense` = with `sft`, the dense [B, 1, S, S] mask instead; `tp<N>` = tensor parallel degree N
    (`strategy.tp`; the data-parallel degree is world / N); `eps<X>` = AdamW's eps X (e.g.
    `eps1e-5`: bounds the gain of AdamW's update on a gradient element near zero,
    tests/train/test_packed_parity.py's docstring)."""
    repeat = "repeat" in flags
    chunk = [int(f[2:]) for f in flags if f.startswith("ce") and f[2:].isdigit()]
    tp = next((int(f[2:]) for f in flags if f.startswith("tp") and f[2:].isdigit()), 1)
    eps = [float(f[3:]) for f in flags if f.startswith("eps")]
    micro, rest = divmod(GLOBAL_BATCH, world // tp * grad_accum)
    assert rest == 0, "global batch must split evenly"
    samples = GLOBAL_BATCH if repeat else GLOBAL_BATCH * STEPS
    data = {"kind": "synthetic", "synthetic": {"samples": samples, "seq_len": 32, "seed": 7}}
    if "sft" in flags:
        data = {"kind": "sft", "sft": {"max_length": 128, "packed_attention": "dense" if "dense" in flags else "auto"}}
    return TrainConfig.model_validate(
        {
            "model": {"name": model, "attention": "sdpa" if "sft" in flags else "eager"},
            "data": data,
            "strategy": {"name": strategy, "shard_group": 1 if "sg1" in flags else None, "tp": tp,
                         "fsdp": ({"reduce_every_micro_batch": True} if "stock" in flags else {})
                         | ({"single_rank": "fsdp"} if "fully_shard" in flags else {})
                         | ({"wrap_embeddings": True, "reshard_after_forward": "layers"} if "carved" in flags else {})},
            # lr high enough that 8 steps move the weights visibly; clipping active (norms > 1).
            "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "max_grad_norm": 1.0} | ({"eps": eps[0]} if eps else {}),
            "schedule": {"kind": "cosine", "warmup_steps": 2},
            "precision": "bf16-mixed" if {"bf16", "qlora"} & set(flags) else "fp32",
            "checkpointing": {"activation": "full" if "ckpt" in flags else "none"},
            "run": {
                "steps": STEPS,
                "micro_batch": micro,
                "grad_accum": grad_accum,
                "seed": 3,
                "device": "cpu",
            },
            "logging": {"progress": False, "tensorboard": False},
            "loss": {"implementation": "standard" if "std" in flags else "chunked"} | (
                {"chunk_tokens": chunk[0]} if chunk else {}),
            "lora": ({"rank": 4, "alpha": 8, "target_modules": "all-linear",
                      "modules_to_save": ["lm_head"] if "lorasave" in flags else [],
                      "quantization": "nf4" if "qlora" in flags else "none"}
                     if {"lora", "lorasave", "qlora"} & set(flags) else None),
        }
    )


def main() -> None:
    runs, env, out = start_worker("model:strategy:ga[:repeat]")
    for run in runs:
        model, strategy, ga, *flags = run.split(":")
        cfg = parity_config(strategy, env.world_size, int(ga), model, tuple(flags))
        res = train(run_spec(cfg, env.world_size, "cpu"), env, export_weights=True)
        if env.is_main:
            record = {"losses": res.losses, "grad_norms": [r.grad_norm for r in res.records],
                      "engine": run_spec(cfg, env.world_size, "cpu").engine_strategy.engine}
            torch.save(
                record | {"weights": res.final_weights}, out / f"{run.replace(':', '-')}-w{env.world_size}.pt"
            )
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)  # no interpreter shutdown: see its docstring (a gloo abort at exit)
