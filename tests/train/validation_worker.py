"""One rank of the validation runs (tests/train/test_validation.py): trains each requested
`<strategy>[:flag...]` on the bundled SFT sample with a validation split and evaluations, and
rank 0 writes `<name>-w<world>.pt` with the eval records, step losses and final weights.

Flags: `best` = checkpointing.save_best: eval_loss with keep_last 1 and an lr that makes the
eval loss rise after its first evaluation (so the best checkpoint is an old one); `part` =
run.eval_batches 3 (a prefix of the split); `tp2` = strategy.tp 2 (a TP group reads one batch).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.loop import train

GLOBAL_BATCH = 4  # rows per optimizer step, the same on every world size
STEPS = 4
EVAL_EVERY = 2
VAL_FRACTION = 0.25
MAX_LENGTH = 64


def validation_config(strategy: str, world: int, out: Path, flags: tuple[str, ...] = ()) -> TrainConfig:
    best = "best" in flags
    tp = 2 if "tp2" in flags else 1
    return TrainConfig.model_validate({
        "model": {"name": "tiny-llama", "attention": "eager"},
        "data": {"kind": "sft", "sft": {"validation_fraction": VAL_FRACTION, "max_length": MAX_LENGTH}},
        "strategy": {"name": strategy, "tp": tp},
        "optimizer": {"lr": 0.5 if best else 3e-3, "weight_decay": 0.0, "max_grad_norm": 0.0 if best else 1.0},
        "schedule": {"kind": "constant"},
        "precision": "fp32",
        "run": {"steps": STEPS + (2 if best else 0), "micro_batch": GLOBAL_BATCH // (world // tp), "grad_accum": 1,
                "seed": 3, "device": "cpu", "eval_every_steps": 1 if best else EVAL_EVERY,
                "eval_batches": 3 if "part" in flags else None},
        "checkpointing": {"output_dir": str(out), "save_every_minutes": None,
                          **({"save_best": "eval_loss", "keep_last": 1} if best else {})},
        "logging": {"progress": False, "tensorboard": True},
    })


def main() -> None:
    from shardwise.train.observe.metrics import Metrics

    runs, env, out = start_worker("strategy[:flag...]")
    for item in runs:
        strategy, *flags = item.split(":")
        name = f"{item.replace(':', '-')}-w{env.world_size}"
        cfg = validation_config(strategy, env.world_size, out / name, tuple(flags))
        metrics = Metrics(cfg)
        res = train(run_spec(cfg, env.world_size, "cpu"), env, metrics=metrics, export_weights=True)
        metrics.close()
        if env.is_main:
            torch.save({"evals": [asdict(e) for e in res.evals], "losses": res.losses,
                        "best_step": res.best_step, "weights": res.final_weights}, out / f"{name}.pt")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
