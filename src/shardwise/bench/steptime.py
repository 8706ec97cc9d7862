"""`shardwise bench`'s step-time split: forward / backward / optimizer / exposed communication,
measured, and the planner's TimeBreakdown split the same way.

Exposed communication is the time the training thread cannot do anything but wait for a
collective. How it is measured depends on where the collectives run:

- CPU (gloo) — `WaitRecorder`: gloo runs collectives on its own threads, and the training
  thread blocks in `Work.wait()` (every synchronous `torch.distributed` call waits there, in
  Python; FSDP2 and DeepSpeed wait there for their async ones) and in DDP's buffer broadcast
  (`torch.distributed._broadcast_coalesced`, synchronous C++). DDP's reducer waits for its
  bucket all-reduces in C++ at the end of backward, which no Python hook sees: for DDP the
  backward's tail after the last parameter's gradient was accumulated (`grad_ready`) is that
  wait. The intervals are intersected with each phase's window (`exposed_in`).
- CUDA (NCCL) — `cuda_exposed`: `Work.wait()` only orders streams there, so one step is
  profiled (torch.profiler, CPU + CUDA activities) and, on the GPU timeline, the time NCCL
  kernels run while no compute kernel does is exposed; phase windows come from
  `record_function` annotations in the same clock.

Pure functions (`union`, `exposed_in`, `predicted_split`, `time_terms`) carry the arithmetic
and are tested with constructed intervals; the recorders are thin.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

PHASES = ("forward", "backward", "optimizer")
METHOD_CPU = ("host wall time the training thread spends blocked in collectives: torch.distributed "
              "Work.wait() (synchronous calls wait inside it) and DDP's buffer broadcast; for DDP also the "
              "backward's tail after the last gradient hook (its C++ reducer waits for the bucket all-reduces "
              "there); intersected with each phase's window, median over the timed steps")
METHOD_CUDA = ("torch.profiler (CPU + CUDA activities) of one timed step: time NCCL kernels run on the GPU "
               "while no compute kernel runs, within each phase's record_function window")
ANNOTATION = "shardwise.bench."  # record_function names of the phase windows (CUDA profile)

Interval = tuple[float, float]


# ----------------------------------------------------------------------------- interval arithmetic
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, merged, non-empty intervals."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def _length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def exposed_in(comm: Iterable[Interval], window: Interval, compute: Iterable[Interval] = ()) -> float:
    """Time within `window` covered by `comm` and by no `compute` interval."""
    c = union(_clip(comm, window))
    busy = union(_clip(compute, window))
    overlap = 0.0
    for a, b in c:
        for x, y in busy:
            overlap += max(0.0, min(b, y) - max(a, x))
    return _length(c) - overlap


# ----------------------------------------------------------------------------- CPU: waits
class WaitRecorder:
    """Intervals (perf_counter seconds) the training thread spends blocked in collectives.
    `install()` wraps `Work.wait` and `torch.distributed._broadcast_coalesced` until
    `uninstall()`; only the thread that installed it is recorded (gloo's threads, the
    watchdog's, are not the step)."""

    def __init__(self) -> None:
        self.intervals: list[Interval] = []
        self._thread = threading.get_ident()
        self._undo: list[tuple[Any, str, Any]] = []

    def add(self, a: float, b: float) -> None:
        self.intervals.append((a, b))

    def _timed(self, fn):
        rec = self

        def wrapper(*args, **kwargs):
            if threading.get_ident() != rec._thread:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                rec.intervals.append((t0, time.perf_counter()))

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def install(self) -> WaitRecorder:
        import torch.distributed as dist

        targets: list[tuple[Any, str]] = (
            [(dist.distributed_c10d.Work, "wait")] if hasattr(dist.distributed_c10d, "Work") else [])
        if hasattr(dist, "_broadcast_coalesced"):
            targets.append((dist, "_broadcast_coalesced"))
        for owner, name in targets:
            orig = getattr(owner, name)
            try:
                setattr(owner, name, self._timed(orig))
            except (AttributeError, TypeError):  # a type that refuses attributes: not measured
                continue
            self._undo.append((owner, name, orig))
        return self

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    def take(self, window: Interval, extra: Iterable[Interval] = ()) -> float:
        """Exposed seconds within `window`; intervals that ended before its end are dropped."""
        out = exposed_in([*self.intervals, *extra], window)
        self.intervals = [iv for iv in self.intervals if iv[1] > window[1]]
        return out


# ----------------------------------------------------------------------------- CUDA: profiler
def _ns(e: Any, what: str) -> float:
    """A kineto event's start/duration in seconds across torch versions (`start_ns` / `start_us`)."""
    if hasattr(e, f"{what}_ns"):
        return getattr(e, f"{what}_ns")() / 1e9
    return getattr(e, f"{what}_us")() / 1e6


def cuda_exposed(prof: Any) -> dict[str, float]:
    """Exposed NCCL time per phase of a profiled step (torch.profiler.profile, after stop)."""
    import torch

    events = prof.profiler.kineto_results.events()
    comm: list[Interval] = []
    compute: list[Interval] = []
    windows: dict[str, list[Interval]] = {}
    for e in events:
        name = e.name()
        start = _ns(e, "start")
        end = start + _ns(e, "duration")
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            (comm if "nccl" in name.lower() else compute).append((start, end))
        elif name.startswith(ANNOTATION):
            windows.setdefault(name.removeprefix(ANNOTATION), []).append((start, end))
    return {ph: sum((exposed_in(comm, w, compute) for w in windows.get(ph, [])), 0.0) for ph in PHASES}


# ----------------------------------------------------------------------------- predicted vs measured
def predicted_split(t: dict[str, float], forward_share: float) -> dict[str, float]:
    """The planner's step (TimeBreakdown.as_dict()) in the bench's phases: the work outside the
    optimizer kernels (GPU compute + host gaps/hooks) split forward : backward as the planner
    splits it (`timing.forward_share`), the optimizer step (+ offload: the host step and its
    transfers), the exposed communication, the step."""
    work = t["compute_s"] + t["host_s"]
    fb = max(0.0, work - t["optimizer_s"])
    return {"forward": fb * forward_share, "backward": fb * (1 - forward_share),
            "optimizer": t["optimizer_s"] + t.get("offload_s", 0.0), "exposed_comm": t["exposed_comm_s"],
            "step": t["step_s"]}


def measured_split(phase_s: dict[str, float], exposed: dict[str, float], step_s: float | None) -> dict[str, Any]:
    """Measured phases without the communication exposed in them, that communication, the step."""
    out: dict[str, Any] = {ph: max(0.0, phase_s[ph] - exposed.get(ph, 0.0)) for ph in PHASES}
    out["exposed_comm"] = sum(exposed.get(ph, 0.0) for ph in PHASES)
    out["step"] = step_s
    return out


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    return (predicted - measured) / measured if predicted is not None and measured else None


def time_terms(predicted: dict[str, float], measured: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    terms = {k: {"predicted": predicted[k], "measured": measured[k], "rel_error": rel_error(predicted[k], measured[k])}
             for k in (*PHASES, "exposed_comm", "step")}
    share = {s: (d["exposed_comm"] / d["step"] if d["step"] else None) for s, d in
             (("predicted", predicted), ("measured", measured))}
    terms["exposed_comm_share"] = {**share, "rel_error": rel_error(share["predicted"], share["measured"])}
    return terms
