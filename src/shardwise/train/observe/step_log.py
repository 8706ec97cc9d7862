"""The step records, completed once per logging interval, and the non-finite guard.

A step leaves its loss sum and its gradient norm on the device: reading either on the host
(`float()`, `.item()`) waits for the device to finish the step, and a training thread that waits
cannot queue the next step's work meanwhile. `StepLog` keeps them pending with the step's host
record (lr, counts, times) and `flush` completes every pending record at once: one
device-to-host copy of all pending scalars, one host-side all-reduce of the loss sums, then the
records in step order, logged and checked by the guard. The numbers, the records and the
guard's decisions are the ones a step-by-step loop makes; only *when* they reach the host
changes (torchtitan reads its loss on logging steps only, for the same reason).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.errors import NonFiniteError


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    target_tokens: int
    tokens: int  # input tokens of the global batch (throughput counts these)
    # The training thread's time for the step. Between logging steps it does not wait for the
    # device, so on a GPU a step's time can show in a later step's (the one that waits at the
    # flush); the sum over an interval is the interval's time.
    step_time_s: float
    cpu_time_s: float = 0.0  # CPU time of this rank's training thread: robust to other load and to waits


def to_host(values: list[torch.Tensor | float]) -> list[float]:
    """`values` as Python floats, with one device-to-host copy per device for all the tensors
    (0-dim, any float dtype; widened to float64, exact for fp32 and bf16). Floats pass through."""
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    out = [float(v) if not isinstance(v, torch.Tensor) else math.nan for v in values]
    for idx in by_device.values():
        host = torch.stack([values[i].detach().reshape(()).double() for i in idx]).tolist()  # type: ignore[union-attr]
        for i, x in zip(idx, host, strict=True):
            out[i] = x
    return out


class Guard:
    """Non-finite losses and gradient norms: every rank sees the same (all-reduced) values and
    so takes the same decision. The engines skip the update of a step whose gradient norm is not
    finite (`Engine.step`), so such a step leaves weights and optimizer state as they were; it
    counts against `run.nonfinite_patience` (consecutive skipped steps), and a run whose last
    step was skipped ends with NonFiniteError too, whatever the patience: it never exports or
    reports "completed" on a step it could not take. fp16's scaler skips overflowing steps
    itself: an infinite grad norm there is a skipped step of loss scaling, not a diverged run."""

    def __init__(self, patience: int, fp16: bool, say: Any = print):
        self.patience, self.fp16, self.bad, self.say = patience, fp16, 0, say

    def check(self, rec: StepRecord) -> bool:
        """True when the step is finite (safe to checkpoint); raises past the patience."""
        finite = math.isfinite(rec.loss) and (self.fp16 or math.isfinite(rec.grad_norm))
        self.bad = 0 if finite else self.bad + 1
        if self.bad > self.patience:
            raise NonFiniteError(
                f"step {rec.step}: loss {rec.loss}, grad norm {rec.grad_norm}: non-finite for {self.bad} "
                f"consecutive step(s) (run.nonfinite_patience={self.patience}); lower optimizer.lr or check "
                "the data. Nothing was exported."
            )
        if not finite:
            self.say(f"shardwise: step {rec.step}: loss {rec.loss}, grad norm {rec.grad_norm}: update skipped "
                     f"({self.bad} of run.nonfinite_patience={self.patience} consecutive)")
        return finite

    def at_end(self, rec: StepRecord | None) -> None:
        if self.bad and rec is not None:
            raise NonFiniteError(
                f"step {rec.step} (the last): loss {rec.loss}, grad norm {rec.grad_norm}: the run ended on "
                f"{self.bad} skipped non-finite step(s) (within run.nonfinite_patience={self.patience}); "
                "nothing was exported and no checkpoint was written after the last finite step."
            )


class StepLog:
    """Pending step records (their loss sum and gradient norm still on the device) until `flush`.

    `reduce_sums` sums a list of host floats over ranks (the loop's host-side group); `log`
    receives each completed record, in step order, and `show` the newest record of each flush
    (the progress bar or line: shardwise.console). Every rank must flush at the same steps: the
    flush is a collective.

    The logging interval is `every` steps or `every_seconds` (`logging.every_seconds`), whichever
    comes first: `due(step)` is the step rule, `time_due()` this rank's clock (the loop sums it
    over ranks with its other votes, so every rank flushes at the same boundary)."""

    def __init__(self, every: int, guard: Guard, reduce_sums: Callable[[list[float]], list[float]],
                 log: Callable[[StepRecord], None], *, every_seconds: float | None = None,
                 show: Callable[[StepRecord], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.every, self.guard, self.reduce_sums, self.log = every, guard, reduce_sums, log
        self.every_seconds, self.show, self.clock = every_seconds, show, clock
        self.pending: list[tuple[StepRecord, torch.Tensor, torch.Tensor | float]] = []
        self.last: StepRecord | None = None  # the newest completed record
        self.finite = True  # the guard's verdict on `last`
        self.flushed_at = clock()  # the last flush (or the start)

    def add(self, rec: StepRecord, loss_sum: torch.Tensor, grad_norm: torch.Tensor | float) -> None:
        """`rec` with its loss and grad_norm to come: this rank's loss sum (all-reduced at the
        flush) and the global gradient norm (the same on every rank already)."""
        self.pending.append((rec, loss_sum, grad_norm))

    def due(self, step: int) -> bool:
        """The boundary after `step` is a logging step (`logging.every`)."""
        return step % self.every == 0

    def time_due(self) -> bool:
        """`logging.every_seconds` have passed since the last flush (on this rank's clock). The loop
        asks during a step, before that step's record is added: the flush at the boundary after
        it completes that step too."""
        return self.every_seconds is not None and self.clock() - self.flushed_at >= self.every_seconds

    def flush(self) -> bool:
        """Complete, log and check every pending record; True when the newest step is finite
        (safe to evaluate or checkpoint after). Every record is logged before the guard runs, so
        metrics hold the steps that ran; the guard then raises NonFiniteError at the first step
        past `run.nonfinite_patience`, counting exactly as a step-by-step check would."""
        if not self.pending:
            return self.finite
        recs = [r for r, _, _ in self.pending]
        host = to_host([s for _, s, _ in self.pending] + [n for _, _, n in self.pending])
        self.pending = []
        k = len(recs)
        totals = self.reduce_sums(host[:k])
        for rec, total, norm in zip(recs, totals, host[k:], strict=True):
            rec.loss, rec.grad_norm = total / rec.target_tokens, norm
            self.log(rec)
        self.last, self.flushed_at = recs[-1], self.clock()
        if self.show is not None:
            self.show(recs[-1])
        for rec in recs:
            self.finite = self.guard.check(rec)
        return self.finite
