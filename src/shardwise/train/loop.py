"""The one training loop. It never asks which engine it drives.

Per optimizer step:
1. take this rank's `grad_accum` micro-batches; all-reduce their target-token count, so
   every rank knows the step's GLOBAL count before any forward pass;
2. for each micro-batch: `sync_grads(last)` + `forward_backward(batch, world / global_count)`;
3. `step()` (clip + update, returns the global grad norm), `zero_grad()`;
4. the logged loss is the all-reduced loss sum over the global count: the exact mean over
   the step's targets, equal to what one process computes on the whole global batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.specs import Strategy
from shardwise.train.config import TrainConfig
from shardwise.train.engines import build_engine
from shardwise.train.engines.base import DistEnv, count_target_tokens
from shardwise.train.model import build_model
from shardwise.train.schedule import build_schedule


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    target_tokens: int
    tokens: int  # input tokens of the global batch (throughput counts these)
    step_time_s: float
    cpu_time_s: float = 0.0  # this rank's process CPU time: robust to other load on the machine


@dataclass
class TrainResult:
    records: list[StepRecord] = field(default_factory=list)
    final_weights: dict[str, torch.Tensor] | None = None  # rank 0, when asked
    num_params: int = 0

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def _all_reduce_sum(values: list[float], dtype=torch.float64) -> list[float]:
    t = torch.tensor(values, dtype=dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def strategy_of(cfg: TrainConfig) -> Strategy:
    kw: dict[str, Any] = {}
    if cfg.strategy.shard_group:
        kw["shard_group"] = cfg.strategy.shard_group
    return Strategy.from_name(cfg.strategy.name, **kw)


def train(
    cfg: TrainConfig,
    env: DistEnv,
    steps: Iterator[list[dict[str, torch.Tensor]]] | None = None,
    metrics: Any = None,
    export_weights: bool = False,
) -> TrainResult:
    """Run `cfg.run.steps` optimizer steps on an initialised process group.

    `steps` overrides the configured data (tests feed exact batches); `metrics` receives
    every StepRecord (rank 0 writes it). With `export_weights`, rank 0 gets the final
    consolidated weights (a collective: every rank must ask).
    """
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model, cfg.run.seed)
    if cfg.checkpointing.activation == "full":
        # Non-reentrant: works under FSDP2 and ZeRO-3 hooks and with frozen inputs.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    num_params = sum(p.numel() for p in model.parameters())
    engine = build_engine(model, cfg, strategy_of(cfg), env)
    if steps is None:
        from shardwise.train.data import build_source

        steps = build_source(cfg, env, model.config.vocab_size)
    lr_at = build_schedule(cfg.schedule, cfg.optimizer.lr, cfg.run.steps)
    result = TrainResult(num_params=num_params)
    if metrics is not None:
        metrics.start(cfg, env, num_params)
    # The previous step's loss sum rides on this step's token-count all-reduce: one collective
    # per step on top of the engine's own (the count must be global before the first forward).
    pending: tuple[StepRecord, float] | None = None

    def finish(rec_loss: tuple[StepRecord, float] | None, total_loss: float) -> None:
        if rec_loss is None:
            return
        rec = rec_loss[0]
        rec.loss = total_loss / rec.target_tokens
        result.records.append(rec)
        if metrics is not None:
            metrics.log_step(rec)

    try:
        for step in range(cfg.run.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            micro = next(steps)
            local_targets = sum(count_target_tokens(b) for b in micro)
            local_tokens = sum(b["input_ids"].numel() for b in micro)
            prev_loss = pending[1] if pending else 0.0
            targets, tokens, prev_total = _all_reduce_sum([local_targets, local_tokens, prev_loss])
            finish(pending, prev_total)
            global_targets, global_tokens = int(targets), int(tokens)
            if global_targets == 0:
                raise RuntimeError(f"step {step}: the global batch has no target tokens")
            loss_scale = env.world_size / global_targets
            engine.set_lr(lr_at(step))
            sums = []  # kept on device: one host sync per step, not per micro-batch
            for i, batch in enumerate(micro):
                with engine.sync_grads(i == len(micro) - 1):
                    sums.append(engine.forward_backward(batch, loss_scale))
            grad_norm = engine.step()
            engine.zero_grad()
            rec = StepRecord(
                step=step + 1,
                loss=float("nan"),  # set once the loss sums of all ranks are in (next reduce)
                grad_norm=grad_norm,
                lr=lr_at(step),
                target_tokens=global_targets,
                tokens=global_tokens,
                step_time_s=time.perf_counter() - t0,
                cpu_time_s=time.process_time() - c0,
            )
            pending = (rec, float(torch.stack(sums).double().sum()))
        if pending is not None:
            (last_total,) = _all_reduce_sum([pending[1]])
            finish(pending, last_total)
        if export_weights:
            result.final_weights = engine.consolidated_state_dict()
    finally:
        engine.close()
        if metrics is not None:
            metrics.close()
    return result
