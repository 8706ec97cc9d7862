"""One rank: for each strategy, a finite step, then a step whose gradients are NaN (a NaN loss
scale), then Inf, then a finite step again (`:fused`: with fused AdamW, which skips on the
device). Rank 0 writes `<strategy>-<precision>[-fused].json`: the gradient norm each step
returned and whether the consolidated weights changed and stayed finite.

Run by tests/train/test_nonfinite.py on 2 gloo ranks (a skipped update is a collective
decision: every rank must skip the same step)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.data import build_source
from shardwise.train.engines import build_engine
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.loop import seed_everything
from shardwise.train.model.build import build_model


def config(strategy: str, precision: str, fused: bool = False, pp: int = 1) -> TrainConfig:
    """`pp` 2: two pipeline stages on the 2 ranks (one data rank, reading both ranks' rows)."""
    return TrainConfig.model_validate({
        "model": {"name": "tiny-llama", "attention": "eager"},
        "data": {"kind": "synthetic", "synthetic": {"samples": 64, "seq_len": 16, "seed": 7}},
        "strategy": {"name": strategy} | ({"pp": pp, "pp_schedule": "gpipe"} if pp > 1 else {}),
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "max_grad_norm": 1.0, "fused": fused},
        "precision": precision,
        "run": {"steps": 4, "micro_batch": 2 * pp, "grad_accum": 1, "seed": 3, "device": "cpu"},
        "logging": {"progress": False, "tensorboard": False},
    })


def weights(engine) -> dict[str, torch.Tensor] | None:
    return engine.consolidated_state_dict()


def one(strategy: str, precision: str, env, out: Path, fused: bool = False, pp: int = 1) -> None:
    cfg = config(strategy, precision, fused, pp)
    run = run_spec(cfg, env.world_size, "cpu")
    seed_everything(cfg.run.seed)
    model = build_model(run)
    engine = build_engine(model, run, env)
    denv = env.data_parallel(1, pp)
    source = build_source(run, denv, model.config.vocab_size, consumed=0)
    record = []
    for scale in (1.0, float("nan"), float("inf"), 1.0):
        before = weights(engine)
        engine.set_lr(cfg.optimizer.lr)  # the loop's schedule sets it every step
        # the loop's contract, loss scale ∝ data ranks: the same gradient with and without stages
        engine.forward_backward_step(next(source), scale * denv.world_size / env.world_size)
        norm = engine.step()
        engine.zero_grad()
        after = weights(engine)
        if env.is_main:
            changed = any(not torch.equal(before[k], after[k]) for k in before)
            finite = all(bool(torch.isfinite(v).all()) for v in after.values())
            record.append({"scale": str(scale), "grad_norm": str(float(norm)), "changed": changed, "finite": finite})
    engine.close()
    if env.is_main:
        name = f"{strategy}-{precision}{'-fused' if fused else ''}{f'-pp{pp}' if pp > 1 else ''}"
        (out / f"{name}.json").write_text(json.dumps(record))


class _Stand:
    """An engine's checkpoint_state whose tensors are NaN on one rank only."""

    def __init__(self, nan: bool):
        self.nan = nan

    def checkpoint_state(self):
        return {"model.w": torch.full((4,), float("nan") if self.nan else 1.0)}, {"optimizer_step": 1}


def save_agreement(env, out: Path) -> None:
    """Rank 1's state holds a NaN: every rank refuses the save, none is left in a collective."""
    from shardwise.errors import NonFiniteError
    from shardwise.train.checkpoint.sharded import TrainerState, save_checkpoint

    run_dir = out / "save-agreement"
    try:
        save_checkpoint(_Stand(env.rank == 1), TrainerState(step=1, samples_consumed=1, global_batch=1), run_dir,
                        config={}, strategy="ddp", keep_last=2)
        outcome = "saved"
    except NonFiniteError as e:
        outcome = f"NonFiniteError: {e}"
    (out / f"save-agreement-rank{env.rank}.txt").write_text(outcome)


def main() -> None:
    runs, env, out = start_worker("strategy:precision[:fused]")
    for item in runs:
        if item == "save":
            save_agreement(env, out)
            continue
        strategy, precision, *flags = item.split(":")
        one(strategy, precision, env, out, fused="fused" in flags, pp=2 if "pp2" in flags else 1)


if __name__ == "__main__":
    run_rank_script(main)
