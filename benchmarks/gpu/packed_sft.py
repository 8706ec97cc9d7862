"""Packed SFT of qwen2.5-0.5b on real chat data, on one GPU: the mask-free path vs the dense mask.

    python benchmarks/gpu/packed_sft.py --out packed_sft.json        # one GPU, about 3 minutes
    python benchmarks/gpu/packed_sft.py --cpu --out /tmp/p.json      # tiny-qwen on CPU (a dry run)

The bundled chat sample (src/shardwise/assets/data) packed into rows of 2048 tokens, bf16-mixed,
through the trainer's own path (TrainConfig → run bridge → preflight memory check → `train`), for
data.sft.packed_attention auto (flash-attn's varlen kernel where installed, else FlexAttention's
document BlockMask: what a GPU run gets by default), varlen and dense. Per run: what ran
(`TrainSpec.packed_attention`, whether FlexAttention fell back), tokens/s (median after the
first step), peak allocated memory, the losses, and the plan's tokens/s and memory for it.

First a parity check in fp32 on one packed micro-batch: the mask-free path's mean loss and
gradients against the dense mask's (the CPU tests cannot run FlexAttention's backward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import kit

CHOICES = ("auto", "varlen", "dense")


def config(packed: str, cpu: bool, workdir: Path, precision: str = "bf16-mixed", steps: int = 12,
           compile_: bool | None = None):
    from shardwise.config.schema import TrainConfig

    return TrainConfig.model_validate({
        "name": f"packed-{packed}",
        "model": {"name": "tiny-qwen" if cpu else "qwen2.5-0.5b", "attention": "sdpa"},
        "data": {"kind": "sft", "sft": {"max_length": 256 if cpu else 2048, "packed_attention": packed}},
        "strategy": {"name": "fsdp"},
        "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "precision": "fp32" if cpu else precision,
        "checkpointing": {"output_dir": str(workdir / packed), "save_every_minutes": None, "save_on_interrupt": False},
        "run": {"steps": 3 if cpu else steps, "micro_batch": 1, "seed": 3, "device": "cpu" if cpu else "cuda",
                "nproc": 1, "compile": compile_},
        "logging": {"progress": False, "tensorboard": False},
        "hardware": {"gpu": "h200", "check_memory": not cpu},
    })


def parity(cpu: bool, workdir: Path) -> dict:
    """fp32, one micro-batch of the first packed rows: mean loss and every gradient, the
    default packed path against the dense mask (the same initial weights)."""
    import torch

    from shardwise.data.labels import count_target_tokens
    from shardwise.run import run_spec
    from shardwise.train.engines.base import forward_loss_sum
    from shardwise.train.model.build import build_model
    from shardwise.train.sft_data import build_sft_split

    device = torch.device("cpu" if cpu else "cuda")
    out, weights = {}, None
    for packed in ("auto", "dense"):
        run = run_spec(config(packed, cpu, workdir, precision="fp32", compile_=False), 1, device.type)
        model = build_model(run)
        weights = weights or {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(weights)
        model.to(device)
        ds, collate = build_sft_split(run, "train")
        batch = collate([ds[i] for i in range(min(2, len(ds)))])
        loss = forward_loss_sum(model, model, batch, device, run.train) / count_target_tokens(batch)
        loss.backward()
        out[packed] = (run.train.packed_attention, float(loss.detach()),
                       {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()})
        del model
    (kind, loss, grads), (_, ref, ref_grads) = out["auto"], out["dense"]
    return {"packed_attention": kind, "loss": loss, "dense_loss": ref, "loss_rel": abs(loss - ref) / abs(ref),
            "grad_max_abs_diff": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
            "grad_max_abs": max(float(g.abs().max()) for g in ref_grads.values())}


def train_run(packed: str, env, cpu: bool, workdir: Path, steps: int) -> dict:
    import torch

    from shardwise.plan.evaluate import evaluate
    from shardwise.run import run_spec
    from shardwise.train.loop import train
    from shardwise.train.model import packed_attention as pa
    from shardwise.train.preflight import check_memory

    run = run_spec(config(packed, cpu, workdir, steps=steps), 1, "cpu" if cpu else "cuda")
    if not cpu:
        check_memory(run)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pa._STATE.update(fallback=False, warned=False)
    res = train(run, env)
    steady = [r.tokens / r.step_time_s for r in res.records[1:]] or [res.records[0].tokens / res.records[0].step_time_s]
    plan = evaluate(run.model, run.hardware, run.train, run.engine_strategy)
    out = {"choice": packed, "packed_attention": run.train.packed_attention, "flex_fell_back": pa._STATE["fallback"],
           "compiled_layers": run.train.fused_kernels, "tokens_per_s": statistics.median(steady),
           "losses": res.losses, "planned_tokens_per_s": plan.time.tokens_per_s_per_gpu,
           "planned_memory_bytes": plan.memory.gpu.total, "planned_activation_bytes": plan.memory.gpu.activations}
    if not cpu:
        out["max_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny-qwen on CPU, 3 steps (checks the flow, not speed)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    env, doc = kit.start(args.cpu)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            doc["parity_fp32"] = parity(args.cpu, Path(tmp))
        except Exception as e:  # recorded, and the timed runs still go
            doc["parity_fp32"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps({"parity_fp32": doc["parity_fp32"]}), flush=True)
        for packed in CHOICES:
            try:
                row = train_run(packed, env, args.cpu, Path(tmp), args.steps)
            except Exception as e:
                row = {"choice": packed, "error": f"{type(e).__name__}: {e}"[:2000]}
            kit.record(doc, row, args.out)
    kit.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
