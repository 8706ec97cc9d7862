"""The one training loop. It never asks which engine it drives.

Per optimizer step:
1. the step's GLOBAL target-token count (all micro-batches, all ranks) is known before any
   forward pass: it was all-reduced, asynchronously, during the previous step;
2. for each micro-batch: `sync_grads(last)` + `forward_backward(batch, world / global_count)`;
3. fetch the next step's micro-batches and start one host-side all-reduce of [their counts,
   this step's loss sum]; then `step()` (clip + update, returns the global grad norm) and
   `zero_grad()` overlap it;
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

from shardwise.data.labels import count_target_tokens
from shardwise.run import RunSpec
from shardwise.train.engines import build_engine
from shardwise.train.engines.base import DistEnv
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
    cpu_time_s: float = 0.0  # CPU time of this rank's training thread: robust to other load and to waits


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


class _MetaReduce:
    """Sums of a few host-side numbers over ranks, asynchronously, on a dedicated gloo group.

    Target counts and loss sums live on the CPU: a gloo group sums them without a device sync
    (on CUDA an NCCL reduce of a host value would need a copy and a stream sync) and without
    queueing behind the engine's gradient collectives. Started before `engine.step()`, the
    reduce overlaps the optimizer step.
    """

    def __init__(self) -> None:
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if multi else None

    def start(self, values: list[float]) -> tuple[torch.Tensor, Any]:
        t = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(t, group=self.group, async_op=True) if self.group is not None else None
        return t, work

    @staticmethod
    def wait(pending: tuple[torch.Tensor, Any]) -> list[float]:
        t, work = pending
        if work is not None:
            work.wait()
        return t.tolist()

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)


def train(
    run: RunSpec,
    env: DistEnv,
    steps: Iterator[list[dict[str, torch.Tensor]]] | None = None,
    metrics: Any = None,
    export_weights: bool = False,
) -> TrainResult:
    """Run `run.config.run.steps` optimizer steps on an initialised process group.

    `steps` overrides the configured data (tests feed exact batches); `metrics` receives
    every StepRecord (rank 0 writes it). With `export_weights`, rank 0 gets the final
    consolidated weights (a collective: every rank must ask).
    """
    cfg = run.config
    seed_everything(cfg.run.seed)
    model = build_model(run)
    num_params = sum(p.numel() for p in model.parameters())
    engine = build_engine(model, run, env)
    if steps is None:
        from shardwise.train.data import build_source

        steps = build_source(run, env, model.config.vocab_size)
    lr_at = build_schedule(cfg.schedule, cfg.optimizer.lr, cfg.run.steps)
    result = TrainResult(num_params=num_params)
    if metrics is not None:
        metrics.start(cfg, env, num_params)
    # One host-side reduce per step carries the NEXT step's target/token counts (they must be
    # global before its first forward) and THIS step's loss sum (for the logged loss).
    meta = _MetaReduce()
    prev: StepRecord | None = None

    def finish(rec: StepRecord | None, total_loss: float) -> None:
        if rec is None:
            return
        rec.loss = total_loss / rec.target_tokens
        result.records.append(rec)
        if metrics is not None:
            metrics.log_step(rec)

    def counts(micro: list[dict[str, torch.Tensor]]) -> list[float]:
        return [sum(count_target_tokens(b) for b in micro), sum(b["input_ids"].numel() for b in micro)]

    try:
        micro = next(steps)
        reduce = meta.start([*counts(micro), 0.0])
        for step in range(cfg.run.steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            targets, tokens, prev_total = meta.wait(reduce)
            finish(prev, prev_total)
            global_targets, global_tokens = int(targets), int(tokens)
            if global_targets == 0:
                raise RuntimeError(f"step {step + 1}: the global batch has no target tokens")
            loss_scale = env.world_size / global_targets
            engine.set_lr(lr_at(step))
            sums = []  # kept on device: one host sync per step, not per micro-batch
            for i, batch in enumerate(micro):
                with engine.sync_grads(i == len(micro) - 1):
                    sums.append(engine.forward_backward(batch, loss_scale))
            loss_sum = float(torch.stack(sums).double().sum())
            last = step + 1 == cfg.run.steps
            micro = [] if last else next(steps)
            reduce = meta.start([*(counts(micro) if micro else [0, 0]), loss_sum])
            grad_norm = engine.step()
            engine.zero_grad()
            prev = StepRecord(
                step=step + 1,
                loss=float("nan"),  # set when the loss sums of all ranks are in (next wait)
                grad_norm=grad_norm,
                lr=lr_at(step),
                target_tokens=global_targets,
                tokens=global_tokens,
                step_time_s=time.perf_counter() - t0,
                cpu_time_s=time.thread_time() - c0,
            )
        finish(prev, meta.wait(reduce)[2])
        if export_weights:
            result.final_weights = engine.consolidated_state_dict()
    finally:
        meta.close()
        engine.close()
        if metrics is not None:
            metrics.close()
    return result
