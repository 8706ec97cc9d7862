"""The rank side of `shardwise bench`: what one rank measures while the trainer runs.

Steps (1-based, N = run.steps): step 1 warms up (buckets, traces, kernels); steps 2..N-1 are
timed (forward / backward / optimizer wall time, the communication exposed in each phase); on
CUDA the last timed step is also profiled (torch.profiler: exposed NCCL time on the GPU
timeline); step N is instrumented: its collectives are counted (a TorchDispatchMode that slows
every op, so its time is not used), the census of model-state bytes is taken at the ends of
forward, backward and the optimizer step, and the memory timeline of that step is recorded
(shardwise.bench.timeline). Memory at the end of each phase: CUDA allocator peaks of the
phase (peaks reset at each phase start), on CPU the process's RSS.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from shardwise.bench.steptime import ANNOTATION, METHOD_CPU, METHOD_CUDA, WaitRecorder, cuda_exposed
from shardwise.bench.timeline import Timeline, rss_bytes

OUT_ENV = "SHARDWISE_BENCH_OUT"


def timed_steps(steps: int) -> list[int]:
    """1-based steps whose times are kept: between the warm-up and the instrumented last one."""
    return list(range(2, steps)) or list(range(1, max(steps, 2)))


def profiled_step(steps: int) -> int | None:
    """The CUDA step profiled for exposed communication: the last timed one."""
    timed = [s for s in timed_steps(steps) if s != steps]
    return timed[-1] if timed else None


class Probe:
    """Per-step phase times, exposed communication, per-phase memory, comm counts, census and
    the memory timeline of one rank. `_Instrumented` (run_bench.py) calls the hooks."""

    def __init__(self, run: Any, rank: int) -> None:
        import torch

        from shardwise.bench.comm import CommCounter

        self.torch, self.run, self.rank = torch, run, rank
        self.cuda = run.device == "cuda"
        self.total_steps = run.config.run.steps
        self.grad_accum = run.config.run.grad_accum
        self.ddp = run.engine_strategy.engine == "ddp"  # FSDP2 on a one-rank shard group may run as DDP
        self.counter = CommCounter()
        self.waits = WaitRecorder()
        self.timeline = Timeline(self.cuda)
        self.profiled = profiled_step(self.total_steps) if self.cuda else None
        self.steps: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.census: dict[str, int] | None = None
        self.census_s = 0.0
        self.comm: dict[str, Any] | None = None
        self.cur: dict[str, Any] | None = None
        self.engine: Any = None
        self._batch: dict[str, Any] = {}
        self._t_start = self._t_loss = self._last_grad = 0.0
        self._in_fb = False
        self._prof: Any = None
        self._annotation: Any = None

    # --- set-up
    def attach(self, engine: Any) -> None:
        """Layer hooks for the timeline, gradient hooks for DDP's backward tail."""
        self.engine = engine
        try:
            from shardwise.train.model.hf import decoder_layers

            self.timeline.attach(decoder_layers(engine.module))
        except Exception:  # a model without `model.layers`: phase samples only
            pass
        if self.ddp:
            for p in engine.module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, _param: Any) -> None:
        self._last_grad = time.perf_counter()

    # --- helpers
    def instrumented(self) -> bool:
        return len(self.steps) == self.total_steps - 1

    def _mark(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def _reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def _memory(self) -> dict[str, float]:
        if self.cuda:
            s = self.torch.cuda.memory_stats()
            return {"allocated_peak": float(s.get("allocated_bytes.all.peak", 0)),
                    "reserved_peak": float(s.get("reserved_bytes.all.peak", 0)),
                    "allocated": float(s.get("allocated_bytes.all.current", 0))}
        import resource

        return {"rss": float(rss_bytes()), "rss_peak": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}

    @staticmethod
    def _merge(old: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
        """Over the step's micro-batches: the largest reading of each key."""
        return new if old is None else {k: max(v, old.get(k, 0.0)) for k, v in new.items()}

    def _exposed(self, phase: str, window: tuple[float, float], extra=()) -> None:
        assert self.cur is not None
        if not self.cuda:
            self.cur["exposed"][phase] += self.waits.take(window, extra)

    def _annotate(self, phase: str | None) -> None:
        """Close the open phase annotation (profiled CUDA step) and open `phase`'s."""
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if phase is not None and self._prof is not None:
            self._annotation = self.torch.profiler.record_function(ANNOTATION + phase)
            self._annotation.__enter__()

    def _census(self, label: str, engine: Any) -> dict[str, int]:
        from shardwise.bench.census import take_census

        self.timeline.pause()
        c0 = time.perf_counter()
        c = take_census(engine.module, engine.optimizer, engine, exclude=tuple(self._batch.values()), gc_sweep=False)
        self.census_s += time.perf_counter() - c0
        self.timeline.resume()
        self.timeline.add_census(label, c.bytes)
        return dict(c.bytes)

    def _last_micro(self) -> bool:
        return self.cur is not None and self.cur["micro"] == self.grad_accum - 1

    # --- the hooks
    def begin_forward_backward(self, batch: dict[str, Any] | None = None) -> None:
        if self.cur is None:
            n = len(self.steps) + 1
            self.cur = {"step": n, "micro": 0, "forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0,
                        "exposed": {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}, "memory": {},
                        "instrumented": self.instrumented(), "profiled": n == self.profiled}
            if self.cur["instrumented"]:
                self.counter.reset()
                self.timeline.start()
            if self.cur["profiled"]:
                self._start_profiler()
        self._batch = batch or {}
        self.timeline.phase = "forward"
        self._reset_peak()
        self._t_start = self._t_loss = self._mark()
        self._last_grad = 0.0
        self._annotate("forward")
        self._in_fb = True

    def loss_done(self) -> None:
        if not self._in_fb or self.cur is None:
            return
        t = self._mark()
        self._annotate("backward")
        self.cur["forward_s"] += t - self._t_start
        self._exposed("forward", (self._t_start, t))
        self.cur["memory"]["forward"] = self._merge(self.cur["memory"].get("forward"), self._memory())
        self.timeline.mark("forward end")
        self.timeline.phase = "backward"
        if self.cur["instrumented"] and self._last_micro() and self.engine is not None:
            self._census("forward end", self.engine)
        self._reset_peak()
        self._t_loss = time.perf_counter()

    def end_forward_backward(self, batch: dict[str, Any], engine: Any) -> None:
        assert self.cur is not None
        t = self._mark()
        self._annotate(None)
        self._in_fb = False
        self.cur["backward_s"] += t - self._t_loss
        tail = [(self._last_grad, t)] if self.ddp and self._t_loss < self._last_grad < t else []
        self._exposed("backward", (self._t_loss, t), tail)
        self.cur["memory"]["backward"] = self._merge(self.cur["memory"].get("backward"), self._memory())
        self.timeline.mark("backward end")
        if self.cur["instrumented"] and self._last_micro() and self.census is None:
            self.census = self._census("backward end", engine)
        self.cur["micro"] += 1

    def counting(self):
        """The collective counter on the instrumented (last) step, nothing on the timed ones."""
        return self.counter if self.cur is not None and self.cur["instrumented"] else nullcontext()

    def begin_step(self) -> float:
        self._reset_peak()
        self.timeline.phase = "optimizer"
        t0 = self._mark()
        self._annotate("optimizer")
        return t0

    def end_step(self, t0: float) -> None:
        if self.cur is None:  # a step without forward_backward (not the loop's pattern)
            return
        t = self._mark()
        self.cur["optimizer_s"] += t - t0
        self._exposed("optimizer", (t0, t))
        self.cur["memory"]["optimizer"] = self._memory()
        self.timeline.mark("optimizer step end")
        if self.cur["instrumented"] and self.engine is not None:
            self._census("optimizer step end", self.engine)

    def end_zero_grad(self, t0: float) -> None:
        if self.cur is None:
            return
        t = self._mark()
        self.cur["optimizer_s"] += t - t0
        self._exposed("optimizer", (t0, t))
        self._annotate(None)
        if self.cur["profiled"]:
            self._stop_profiler()
        if self.cur["instrumented"]:
            self.comm = self.counter.counts.as_dict()
            self.timeline.mark("zero_grad end")
            self.timeline.stop(_out_dir(), self.rank)
        self.steps.append(self.cur)
        self.cur = None

    # --- CUDA profile of one step
    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        try:
            self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._prof.start()
        except Exception:
            self._prof = None

    def _stop_profiler(self) -> None:
        if self._prof is None or self.cur is None:
            return
        prof, self._prof = self._prof, None
        try:
            prof.stop()
            self.cur["exposed"] = cuda_exposed(prof)
        except Exception as e:  # no CUPTI, or an event API this torch lacks: said in the result
            self.cur["exposed_error"] = f"{type(e).__name__}: {e}"

    def result(self, rc: int | None) -> dict[str, Any]:
        return {"rank": self.rank, "rc": rc, "device": self.run.device,
                "memory_kind": "cuda" if self.cuda else "host_rss", "census": self.census,
                "census_s": self.census_s, "comm": self.comm, "steps": self.steps, "records": self.records,
                "exposed_method": METHOD_CUDA if self.cuda else METHOD_CPU, "profiled_step": self.profiled,
                "timeline": self.timeline.as_dict("cuda_allocator" if self.cuda else "host_rss")}


def _out_dir() -> Path | None:
    d = os.environ.get(OUT_ENV)
    return Path(d) if d else None
