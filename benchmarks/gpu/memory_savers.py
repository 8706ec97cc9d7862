"""The memory savers on one GPU: each saver's measured peak and tokens/s against the plan's.

    python benchmarks/gpu/memory_savers.py --out memory_savers.json     # one GPU, about 3 minutes
    python benchmarks/gpu/memory_savers.py --cpu --out /tmp/s.json      # tiny-llama on CPU (a dry run)

qwen2.5-0.5b, one rank (DDP unwrapped, so the step in backward runs), seq 2048, micro-batch 4,
bf16-mixed, activation checkpointing full, through the trainer's own path (TrainConfig → run
bridge → preflight memory check → `train`), once as the baseline and once per saver:
the optimizer step in backward, activation offloading, torchao's 8-bit and 4-bit AdamW,
bitsandbytes' paged 8-bit AdamW (CUDA only), pure bf16, and torchtune's 8B recipe on this model
(pure bf16 + step in backward + paged 8-bit). Per run: the settings, tokens/s (median after the
first step), torch's peak allocated memory, the losses, and the plan's allocated peak, tokens/s
and the term each saver moves. The CPU dry run checks the flow, not the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import kit

# name -> the training YAML's changes from the baseline
SAVERS: dict[str, dict] = {
    "baseline": {},
    "in_backward": {"optimizer": {"in_backward": True, "max_grad_norm": 0.0}},
    "offload": {"checkpointing": {"offload": True}},
    "adamw8bit": {"optimizer": {"name": "adamw8bit"}},
    "adamw4bit": {"optimizer": {"name": "adamw4bit"}},
    "paged_adamw8bit": {"optimizer": {"name": "paged_adamw8bit"}},
    "bf16_pure": {"precision": "bf16-pure"},
    "torchtune_recipe": {"precision": "bf16-pure",
                         "optimizer": {"name": "paged_adamw8bit", "in_backward": True, "max_grad_norm": 0.0}},
}
CUDA_ONLY = ("paged_adamw8bit", "torchtune_recipe")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config(name: str, cpu: bool, workdir: Path, steps: int):
    from shardwise.config.schema import TrainConfig

    raw = {
        "name": f"savers-{name}",
        "model": {"name": "tiny-llama" if cpu else "qwen2.5-0.5b"},
        "data": {"kind": "synthetic", "synthetic": {"samples": 64, "seq_len": 128 if cpu else 2048}},
        "strategy": {"name": "ddp"},
        "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "precision": "bf16-mixed",
        "checkpointing": {"activation": "full", "output_dir": str(workdir / name), "save_every_minutes": None,
                          "save_on_interrupt": False},
        "run": {"steps": 3 if cpu else steps, "micro_batch": 4, "seed": 3, "device": "cpu" if cpu else "cuda",
                "nproc": 1, "compile": False},
        "logging": {"progress": False, "tensorboard": False},
        "hardware": {"gpu": "h200", "check_memory": not cpu},
    }
    return TrainConfig.model_validate(_merge(raw, SAVERS[name]))


def train_run(name: str, env, cpu: bool, workdir: Path, steps: int) -> dict:
    import torch

    from shardwise.plan.evaluate import evaluate
    from shardwise.run import run_spec
    from shardwise.train.loop import train
    from shardwise.train.preflight import check_memory

    run = run_spec(config(name, cpu, workdir, steps), 1, "cpu" if cpu else "cuda")
    if not cpu:
        check_memory(run)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    res = train(run, env)
    steady = [r.tokens / r.step_time_s for r in res.records[1:]] or [res.records[0].tokens / res.records[0].step_time_s]
    plan = evaluate(run.model, run.hardware, run.train, run.engine_strategy)
    g = plan.memory.gpu
    out = {"saver": name, "precision": run.train.precision, "optimizer": run.train.optimizer,
           "optimizer_in_backward": run.train.optimizer_in_backward, "activation_offload": run.train.activation_offload,
           "tokens_per_s": statistics.median(steady), "losses": res.losses,
           "planned_allocated_bytes": g.allocated, "planned_tokens_per_s": plan.time.tokens_per_s_per_gpu,
           "planned": {k: getattr(g, k) for k in ("params", "grads", "optimizer_states", "activations")},
           "planned_host_activations": plan.memory.host.activations}
    if not cpu:
        out["max_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny-llama on CPU, 3 steps (checks the flow, not numbers)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated savers (default: all)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    env, doc = kit.start(args.cpu)
    names = [n for n in (args.only.split(",") if args.only else SAVERS) if not (args.cpu and n in CUDA_ONLY)]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                row = train_run(name, env, args.cpu, Path(tmp), args.steps)
            except Exception as e:  # recorded; the other savers still run
                row = {"saver": name, "error": f"{type(e).__name__}: {e}"[:2000]}
            kit.record(doc, row, args.out)
    kit.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
