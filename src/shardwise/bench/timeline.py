"""The memory timeline of one step (`shardwise bench`, the instrumented last step).

Samples at each decoder layer's forward (pre- and post-hook), at the start of each layer's
backward (a hook on the gradient of the layer's output), at the phase boundaries, and, at the
ends of forward / backward / optimizer step, the census of model-state bytes by category.
What a sample reads: on CUDA the allocator's `memory_allocated` / `memory_reserved`; on CPU
the process's resident set (host memory: never set beside the GPU plan). On CUDA the
allocator's own history is recorded as well (`torch.cuda.memory._record_memory_history`) and
its snapshot saved for https://pytorch.org/memory_viz; `snapshot_series` turns it into the
allocated-bytes curve of the step.

Time is the step's wall clock with the census pauses taken out; the step is the one whose
collectives are counted, so it runs slower than the timed ones (the axis is for order, not speed).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

MAX_POINTS = 2000


def rss_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak: the best there is


class Timeline:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.samples: list[dict[str, Any]] = []
        self.markers: list[dict[str, Any]] = []
        self.census: list[dict[str, Any]] = []
        self.phase = "forward"
        self.active = False
        self._t0 = 0.0
        self._paused = 0.0
        self._pause_start = 0.0
        self._hooks: list[Any] = []
        self.snapshot_path: str | None = None
        self.snapshot_series: list[tuple[float, float]] | None = None

    # --- clock
    def now(self) -> float:
        return time.perf_counter() - self._t0 - self._paused

    def start(self) -> None:
        self._t0, self._paused, self.active = time.perf_counter(), 0.0, True
        if self.cuda:
            try:
                import torch

                try:  # Python frames only: C++ stacks on every allocation would slow the step a lot
                    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
                except TypeError:  # an older signature
                    torch.cuda.memory._record_memory_history(max_entries=200_000)
            except Exception:  # an allocator without history (another backend): samples only
                pass
        self.sample("step start")

    def pause(self) -> None:
        self._pause_start = time.perf_counter()

    def resume(self) -> None:
        self._paused += time.perf_counter() - self._pause_start

    # --- readings
    def _read(self) -> dict[str, float]:
        if self.cuda:
            import torch

            return {"bytes": float(torch.cuda.memory_allocated()), "reserved": float(torch.cuda.memory_reserved())}
        return {"bytes": float(rss_bytes())}

    def sample(self, label: str) -> None:
        if self.active:
            self.samples.append({"t_s": self.now(), "label": label, "phase": self.phase, **self._read()})

    def mark(self, label: str) -> None:
        """A phase boundary: a marker on the plot and a sample."""
        if self.active:
            self.markers.append({"t_s": self.now(), "label": label})
            self.sample(label)

    def add_census(self, label: str, by_category: dict[str, int]) -> None:
        if self.active:
            self.census.append({"t_s": self.now(), "label": label, "bytes": dict(by_category)})

    def stop(self, out_dir: Path | None, rank: int) -> None:
        self.sample("step end")
        self.active = False
        if self.cuda:
            self._save_snapshot(out_dir, rank)

    def _save_snapshot(self, out_dir: Path | None, rank: int) -> None:
        try:
            import pickle

            import torch

            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:
            return
        self.snapshot_series = snapshot_series(snap)
        if out_dir is not None:
            path = Path(out_dir) / f"memory_snapshot_rank{rank}.pickle"
            with open(path, "wb") as f:
                pickle.dump(snap, f)
            self.snapshot_path = str(path)

    # --- per-layer hooks
    def attach(self, layers: list[Any]) -> None:
        """Forward pre/post hooks on each decoder layer; the post hook puts a gradient hook on
        the layer's output (the start of that layer's backward). Recomputed forwards (activation
        checkpointing, during backward) are sampled as such and get no gradient hook."""
        for i, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(self._pre(i)))
            self._hooks.append(layer.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(module, args):
            if self.active:
                self.sample(f"L{i} {'recompute' if self.phase == 'backward' else 'forward'} start")
        return hook

    def _post(self, i: int):
        def hook(module, args, output):
            if not self.active:
                return
            if self.phase == "backward":
                self.sample(f"L{i} recompute end")
                return
            self.sample(f"L{i} forward end")
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if getattr(out, "requires_grad", False) and hasattr(out, "register_hook"):
                def grad_hook(g, i=i):
                    self.sample(f"L{i} backward start")
                out.register_hook(grad_hook)
        return hook

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def as_dict(self, kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": kind, "samples": self.samples, "markers": self.markers, "census": self.census}
        if self.snapshot_series is not None:
            out["allocator_series"] = self.snapshot_series
        if self.snapshot_path:
            out["snapshot"] = self.snapshot_path
        return out


def snapshot_series(snap: dict[str, Any], max_points: int = MAX_POINTS) -> list[tuple[float, float]]:
    """(seconds from the first event, allocated bytes) from a `torch.cuda.memory._snapshot()`:
    the device traces' `alloc` / `free_completed` events, starting from what the segments
    held before the history began (their allocated blocks minus what the trace allocates and
    never frees is not knowable, so the curve starts at 0 and shows the step's changes)."""
    events = []
    for trace in snap.get("device_traces", []):
        for e in trace:
            action, size, t = e.get("action"), e.get("size", 0), e.get("time_us")
            if t is None:
                continue
            if action == "alloc":
                events.append((t, size))
            elif action == "free_completed":
                events.append((t, -size))
    if not events:
        return []
    events.sort()
    t0, live = events[0][0], 0.0
    series: list[tuple[float, float]] = []
    for t, d in events:
        live += d
        series.append(((t - t0) / 1e6, live))
    if len(series) > max_points:  # keep the extremes of each bucket: peaks survive thinning
        step = len(series) / (max_points / 2)
        thin: list[tuple[float, float]] = []
        for k in range(int(max_points / 2)):
            chunk = series[int(k * step):int((k + 1) * step)] or series[-1:]
            lo, hi = min(chunk, key=lambda x: x[1]), max(chunk, key=lambda x: x[1])
            thin += sorted({lo, hi})
        series = thin
    return series
