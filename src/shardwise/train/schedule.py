"""Learning-rate schedules as pure functions of the step (the loop sets the value on the engine).

Owning the schedule outside the engines keeps it identical across DeepSpeed, FSDP2 and DDP and
makes it resumable from the step counter alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shardwise.config.schema import ScheduleSection


def lr_at(step: int, *, peak: float, total: int, kind: str, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """The lr used for optimizer step `step` (0-based) of `total`.

    Warmup is linear from peak/warmup (never 0: a zero-lr first step wastes a batch).
    `warmup_decay` is DeepSpeed's WarmupDecayLR: linear warmup then linear decay to 0 at `total`
    (DeepSpeed's warmup is log-shaped by default; we use its `warmup_type: linear` form).
    """
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    floor = peak * min_ratio
    span = max(1, total - warmup)
    frac = min(1.0, (step - warmup) / span)
    if kind == "constant":
        return peak
    if kind == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    if kind == "linear":
        return peak - (peak - floor) * frac
    if kind == "warmup_decay":
        return peak * max(0.0, (total - step) / span)
    raise ValueError(f"unknown schedule kind {kind!r}")


def build_schedule(cfg: ScheduleSection, peak: float, total: int) -> Callable[[int], float]:
    return lambda step: lr_at(
        step, peak=peak, total=total, kind=cfg.kind, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio
    )
