"""One rank of the pipeline-parallel runs: trains every requested run in turn (as parity_worker).

Run items: `model:strategy:grad_accum[:flag...]`. Flags: parity_worker's (`sft`, `eps<X>`, `tp<N>`,
`std`, `ckpt`, `lora`, ...) plus `pp<N>` (strategy.pp), `gpipe` / `interleaved<V>` (the schedule;
1F1B otherwise), `save<K>` (a checkpoint every K steps), `eval` (the validation split evaluated every
4 steps), `from=<item>@<K>` (resume from the step-K checkpoint of an earlier item, written with ':'
as '-'). The global batch is GLOBAL_BATCH sequences per step on every layout: micro_batch =
GLOBAL_BATCH / (data ranks × grad_accum), data ranks = world / (tp × pp).
Models: `pp-llama` (Llama, MHA) and `pp-qwen2` (Qwen2, GQA 4:2, q/k/v biases, untied), 4 decoder
layers each, built from a config.json this worker writes (random weights, seeded).
Rank 0 writes `<item>-w<world>.pt`: the loss curve, grad norms, evals, the layout and the
consolidated final weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from parity_worker import parity_config
from worker_common import start_worker

from shardwise.run import run_spec
from shardwise.train.engines import engine_class
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.loop import train

GLOBAL_BATCH = 8

CONFIGS = {
    "pp-llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "intermediate_size": 176, "vocab_size": 2048,
                 "max_position_embeddings": 2048, "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    "pp-qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 2048,
                 "max_position_embeddings": 2048, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
}


def model_dir(root: Path, model: str) -> Path:
    """The model's config.json under `root` (written atomically by whichever rank comes first)."""
    d = root / "models" / model
    if not (d / "config.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"config.json.{torch.distributed.get_rank()}"
        tmp.write_text(json.dumps(CONFIGS[model]))
        tmp.replace(d / "config.json")
    return d


def _int_flag(flags: list[str], prefix: str, default: int) -> int:
    return next((int(f[len(prefix):]) for f in flags if f.startswith(prefix) and f[len(prefix):].isdigit()), default)


def output_dir(root: Path, item: str) -> Path:
    return root / "runs" / item.replace(":", "-")


def pipeline_config(item: str, world: int, root: Path):
    from shardwise.config.schema import TrainConfig

    model, strategy, ga, *flags = item.split(":")
    pp, tp, virtual = _int_flag(flags, "pp", 1), _int_flag(flags, "tp", 1), _int_flag(flags, "interleaved", 1)
    micro, rest = divmod(GLOBAL_BATCH, world // (tp * pp) * int(ga))
    assert rest == 0 and micro > 0, f"{item}: the global batch of {GLOBAL_BATCH} must split evenly on {world} ranks"
    base = parity_config(strategy, 1, 1, "tiny-llama", tuple(f for f in flags if not f.startswith(("pp", "tp"))))
    raw = base.model_dump(exclude={"source"})
    raw["model"] |= {"name": None, "path": str(model_dir(root, model)), "random_init": True}
    if raw["data"]["kind"] == "sft":  # the bundled tokenizer, as the catalog models' runs take it
        import shardwise

        raw["data"]["tokenizer"] = str(Path(shardwise.__file__).parent / "assets" / "tokenizer")
        if "eval" in flags:
            raw["data"]["sft"]["validation_fraction"] = 0.1
    else:
        raw["data"]["synthetic"]["samples"] = GLOBAL_BATCH * raw["run"]["steps"]
    raw["run"] |= {"micro_batch": micro, "grad_accum": int(ga)}
    if "eval" in flags:
        raw["run"]["eval_every_steps"] = 4
    raw["strategy"] |= {"tp": tp, "pp": pp, "pp_schedule": "gpipe" if "gpipe" in flags else
                        "interleaved-1f1b" if virtual > 1 else "1f1b", "pp_virtual_stages": virtual}
    raw["checkpointing"] |= {"output_dir": str(output_dir(root, item)), "save_every_steps": _int_flag(flags, "save", 0)
                             or None}
    return TrainConfig.model_validate(raw)


def resume_from(root: Path, flags: list[str]) -> Path | None:
    """`from=<item>@<K>`: that item's step-K checkpoint."""
    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name

    spec = next((f[5:] for f in flags if f.startswith("from=")), None)
    if spec is None:
        return None
    name, step = spec.rsplit("@", 1)
    return checkpoints_dir(root / "runs" / name) / step_dir_name(int(step))


def main() -> None:
    runs, env, out = start_worker("model:strategy:ga[:flag...]")
    for item in runs:
        cfg = pipeline_config(item, env.world_size, out)
        run = run_spec(cfg, env.world_size, "cpu")
        res = train(run, env, export_weights=True, resume=resume_from(out, item.split(":")[3:]))
        if env.is_main:
            record = {"losses": res.losses, "grad_norms": [r.grad_norm for r in res.records],
                      "evals": [e.eval_loss for e in res.evals], "layout": run.layout.model_dump(),
                      "engine": engine_class(run).name}
            torch.save(record | {"weights": res.final_weights}, out / f"{item.replace(':', '-')}-w{env.world_size}.pt")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
