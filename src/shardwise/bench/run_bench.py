"""`shardwise bench`: N steps of the real trainer, measured per rank and set beside the plan.

Parent side (`bench_points`): each point (the config, its `--set` overrides, one `--sweep`
combination) is validated like `shardwise train` does (load_config + preflight: the same
RunSpec, the same planner), then launched with `shardwise.train.launch.spawn` as
`python -m shardwise.bench.run_bench CONFIG --set ...` on `nproc` local ranks.

Rank side (`rank_main`): the rank runs `shardwise.train.cli._worker` (the trainer's own rank
body: watchdog, process group, metrics, the one loop) with three hooks installed from outside:
`shardwise.train.loop.build_engine` returns the real engine wrapped in `_Instrumented`, the
engine module's `token_loss_sum` marks the end of the forward (forward = model + loss,
backward = the rest of `forward_backward`), and `Metrics.log_step` copies the loop's
StepRecords. Per optimizer step the wrapper times forward / backward / optimizer (step +
zero_grad; `torch.cuda.synchronize()` at each mark on CUDA) and reads memory at the end of each
phase: on CUDA the allocator's allocated/reserved peaks of that phase (peaks reset at each
phase start), on CPU the process's RSS (host memory: never compared with the GPU plan).

The LAST step is the instrumented one: its collectives are counted (`CommCounter`, a
TorchDispatchMode that slows every op, so that step is not timed) and after its last
backward the census (`take_census`) counts model-state bytes by category through the live
engine. Steps 1-2 carry one-off traffic (DDP's bucket rebuild, ZeRO-3's trace), so the comm
counts are steady-state only with --steps >= 3; timing uses the steps between the first
(warm-up) and the last. Each rank writes `rank<r>.json` under $SHARDWISE_BENCH_OUT.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

PARTS = ("params", "grads", "master_params", "optimizer_states")
PHASES = ("forward", "backward", "optimizer")
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "p2p", "all_to_all")
OUT_ENV = "SHARDWISE_BENCH_OUT"
# What a bench point forces on the config: N steps, no checkpoints or exports, quiet ranks.
FORCED = ("checkpointing.save_final=false", "checkpointing.save_every_steps=null",
          "checkpointing.save_every_minutes=null", "checkpointing.resume=null", "logging.progress=false",
          "logging.tensorboard=false", "logging.wandb=false")


# ================================================================= rank side
class _Probe:
    """Per-step phase times, per-phase memory, comm counts and the census of one rank."""

    def __init__(self, run: Any, rank: int) -> None:
        import torch

        from shardwise.bench.comm import CommCounter

        self.torch, self.run, self.rank = torch, run, rank
        self.cuda = run.device == "cuda"
        self.total_steps = run.config.run.steps
        self.grad_accum = run.config.run.grad_accum
        self.counter = CommCounter()
        self.steps: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.census: dict[str, int] | None = None
        self.census_s = 0.0
        self.comm: dict[str, Any] | None = None
        self.cur: dict[str, Any] | None = None
        self._t_start = self._t_loss = 0.0
        self._in_fb = False

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

        try:
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss = 0
        return {"rss": float(rss), "rss_peak": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}

    @staticmethod
    def _merge(old: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
        """Over the step's micro-batches: the largest reading of each key."""
        return new if old is None else {k: max(v, old.get(k, 0.0)) for k, v in new.items()}

    # --- the hooks
    def begin_forward_backward(self) -> None:
        if self.cur is None:
            self.cur = {"step": len(self.steps) + 1, "micro": 0, "forward_s": 0.0, "backward_s": 0.0,
                        "optimizer_s": 0.0, "memory": {}, "instrumented": self.instrumented()}
            if self.cur["instrumented"]:
                self.counter.reset()
        self._reset_peak()
        self._t_start = self._t_loss = self._mark()
        self._in_fb = True

    def loss_done(self) -> None:
        if not self._in_fb or self.cur is None:
            return
        t = self._mark()
        self.cur["forward_s"] += t - self._t_start
        self.cur["memory"]["forward"] = self._merge(self.cur["memory"].get("forward"), self._memory())
        self._reset_peak()
        self._t_loss = t

    def end_forward_backward(self, batch: dict[str, Any], engine: Any) -> None:
        assert self.cur is not None
        t = self._mark()
        self._in_fb = False
        self.cur["backward_s"] += t - self._t_loss
        self.cur["memory"]["backward"] = self._merge(self.cur["memory"].get("backward"), self._memory())
        self.cur["micro"] += 1
        if self.cur["instrumented"] and self.cur["micro"] == self.grad_accum and self.census is None:
            from shardwise.bench.census import take_census

            c0 = time.perf_counter()
            census = take_census(engine.module, engine.optimizer, engine, exclude=tuple(batch.values()),
                                 gc_sweep=False)
            self.census, self.census_s = dict(census.bytes), time.perf_counter() - c0

    def counting(self):
        """The collective counter on the instrumented (last) step, nothing on the timed ones."""
        return self.counter if self.cur is not None and self.cur["instrumented"] else nullcontext()

    def begin_step(self) -> float:
        self._reset_peak()
        return self._mark()

    def end_step(self, t0: float) -> None:
        if self.cur is None:  # a step without forward_backward (not the loop's pattern)
            return
        self.cur["optimizer_s"] += self._mark() - t0
        self.cur["memory"]["optimizer"] = self._memory()

    def end_zero_grad(self, t0: float) -> None:
        if self.cur is None:
            return
        self.cur["optimizer_s"] += self._mark() - t0
        if self.cur["instrumented"]:
            self.comm = self.counter.counts.as_dict()
        self.steps.append(self.cur)
        self.cur = None

    def result(self, rc: int) -> dict[str, Any]:
        return {"rank": self.rank, "rc": rc, "device": self.run.device,
                "memory_kind": "cuda" if self.cuda else "host_rss", "census": self.census,
                "census_s": self.census_s, "comm": self.comm, "steps": self.steps, "records": self.records}


class _Instrumented:
    """The real engine, with forward_backward / step / zero_grad measured; all else delegated."""

    def __init__(self, engine: Any, probe: _Probe) -> None:
        self.__dict__["_engine"], self.__dict__["_probe"] = engine, probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def forward_backward(self, batch: dict[str, Any], loss_scale: float) -> Any:
        p = self._probe
        p.begin_forward_backward()
        with p.counting():
            out = self._engine.forward_backward(batch, loss_scale)
        p.end_forward_backward(batch, self._engine)
        return out

    def step(self) -> float:
        p = self._probe
        t0 = p.begin_step()
        with p.counting():
            norm = self._engine.step()
        p.end_step(t0)
        return norm

    def zero_grad(self) -> None:
        p = self._probe
        t0 = p._mark()
        with p.counting():
            self._engine.zero_grad()
        p.end_zero_grad(t0)


_ENGINE_MODULES = {"deepspeed": "shardwise.train.engines.deepspeed", "fsdp2": "shardwise.train.engines.fsdp",
                   "ddp": "shardwise.train.engines.ddp"}


@contextmanager
def _installed(probe: _Probe):
    """The three hooks, undone on exit."""
    import importlib
    from dataclasses import asdict

    from shardwise.train import loop, metrics

    engine_mod = importlib.import_module(_ENGINE_MODULES[probe.run.strategy.engine])
    orig_build, orig_loss, orig_log = loop.build_engine, engine_mod.token_loss_sum, metrics.Metrics.log_step
    orig_summary = metrics.print_summary

    def build_engine(model, run, env, **kw):
        return _Instrumented(orig_build(model, run, env, **kw), probe)

    def token_loss_sum(logits, labels):
        out = orig_loss(logits, labels)
        probe.loss_done()
        return out

    def log_step(self, rec):
        orig_log(self, rec)
        probe.records.append(asdict(rec))

    loop.build_engine, engine_mod.token_loss_sum, metrics.Metrics.log_step = build_engine, token_loss_sum, log_step
    metrics.print_summary = lambda s: None  # the parent prints one table for the bench
    try:
        yield
    finally:
        loop.build_engine, engine_mod.token_loss_sum, metrics.Metrics.log_step = orig_build, orig_loss, orig_log
        metrics.print_summary = orig_summary


def rank_main(argv: list[str] | None = None) -> int:
    """One rank of a bench point (started by `spawn`): the trainer's rank body, measured."""
    import argparse
    import warnings

    from shardwise.train import cli as train_cli
    from shardwise.train.config import load_config
    from shardwise.train.launch import detect_env
    from shardwise.train.preflight import preflight

    warnings.filterwarnings("ignore", category=FutureWarning)
    ap = argparse.ArgumentParser(prog="shardwise.bench.run_bench")
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    found = detect_env() or {"rank": 0, "world_size": 1}
    rank, world = int(found["rank"]), int(found["world_size"])
    cfg = load_config(a.config, a.set)
    run, check = preflight(cfg, world, cfg.resolved_device(), force=True)  # the parent checked the plan
    probe = _Probe(run, rank)
    with _installed(probe):
        rc = train_cli._worker(run, check.planned_bytes, None)
    out = Path(os.environ.get(OUT_ENV, cfg.checkpointing.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(probe.result(rc)))
    tmp.replace(out / f"rank{rank}.json")
    return rc


# ================================================================= parent side
@dataclass
class Point:
    label: str
    overrides: list[str]  # the sweep's own overrides (after the user's --set)
    slug: str = ""
    all_overrides: list[str] = field(default_factory=list)
    run: Any = None
    world: int = 1
    device: str = "cpu"


def parse_sweep(sweep: list[str] | None) -> list[tuple[str, list[str]]]:
    """`key=v1,v2` (repeatable) -> [(label, [key=v, ...]), ...]: the cartesian product."""
    axes: list[tuple[str, list[str]]] = []
    for s in sweep or []:
        key, eq, values = s.partition("=")
        key = key.strip()
        vals = [v.strip() for v in values.split(",")] if eq else []
        if not key or not eq or not vals or any(not v for v in vals):
            raise ShardwiseError(f"--sweep {s!r}: expected section.field=v1,v2,... (e.g. "
                                 "--sweep strategy.name=ddp,zero2,zero3,fsdp)")
        if "." not in key:
            raise ShardwiseError(f"--sweep {s!r}: field {key!r} is not section.field (e.g. run.micro_batch)")
        if any(k == key for k, _ in axes):
            raise ShardwiseError(f"--sweep {s!r}: field {key!r} is swept twice")
        axes.append((key, vals))
    if not axes:
        return [("run", [])]
    out = []
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
        out.append((" ".join(f"{k}={v}" for k, v in combo), [f"{k}={v}" for k, v in combo]))
    return out


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "run"


def prepare(config: Path, overrides: list[str], steps: int, nproc: int | None, out: Path,
            sweep: list[str] | None, force: bool) -> list[Point]:
    """Every point validated (config, data, strategy vs world size, planner) before any runs."""
    from shardwise.train.config import load_config
    from shardwise.train.preflight import preflight

    if steps < 1:
        raise ShardwiseError(f"--steps {steps}: expected at least 1 optimizer step (3 or more for steady-state "
                             "collective counts)")
    if nproc is not None and nproc < 1:
        raise ShardwiseError(f"--nproc {nproc}: expected at least 1 local rank")
    if not config.is_file():
        raise ShardwiseError(f"{config}: config file not found")
    points = []
    for label, extra in parse_sweep(sweep):
        p = Point(label=label, overrides=extra, slug=_slug(label))
        p.all_overrides = [*overrides, *extra, f"run.steps={steps}",
                           f"checkpointing.output_dir={(out / 'runs' / p.slug).resolve()}", *FORCED]
        cfg = load_config(config, p.all_overrides)
        p.world = nproc if nproc is not None else cfg.run.nproc
        p.device = cfg.resolved_device()
        p.run, _ = preflight(cfg, p.world, p.device, force=force)
        points.append(p)
    return points


def launch(config: Path, p: Point, out: Path) -> list[dict[str, Any]]:
    """Run one point on its ranks; return the per-rank results (rank order)."""
    from shardwise.train.cli import _own_output_dir, _run_dir
    from shardwise.train.launch import spawn

    rank_dir = out / "runs" / p.slug / "bench"
    rank_dir.mkdir(parents=True, exist_ok=True)
    for old in rank_dir.glob("rank*.json"):
        old.unlink()
    argv = ["-m", "shardwise.bench.run_bench", str(config), *[a for o in p.all_overrides for a in ("--set", o)]]
    extra = {"SHARDWISE_LAUNCHED": "1", OUT_ENV: str(rank_dir.resolve())}
    extra |= {"DS_ACCELERATOR": "cpu"} if p.device == "cpu" else {}
    threads = max(1, (os.cpu_count() or 1) // p.world) if p.device == "cpu" else None
    lock = _own_output_dir(p.run.config)
    try:
        rc = spawn(argv, p.world, extra_env=extra, threads_per_rank=threads, run_dir=_run_dir(p.run.config))
    finally:
        lock.release()
    files = [rank_dir / f"rank{r}.json" for r in range(p.world)]
    missing = [str(f) for f in files if not f.is_file()]
    if rc != 0 or missing:
        raise BenchFailed(f"bench point {p.label!r}: the trainer exited with code {rc}"
                          + (f"; no result from {', '.join(missing)}" if missing else ""), rc or 1)
    return [json.loads(f.read_text()) for f in files]


class BenchFailed(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _term(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    err = (predicted - measured) / measured if predicted is not None and measured else None
    return {"predicted": predicted, "measured": measured, "rel_error": err}


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def compare(p: Point, ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Predicted and measured side by side for one point."""
    from shardwise.plan.comm import plan_comm
    from shardwise.plan.flops import model_flops_per_token
    from shardwise.plan.memory import plan_memory

    run = p.run
    plan = plan_memory(run.model, run.hardware, run.train, run.strategy)
    comm_plan = plan_comm(run.model, run.hardware, run.train, run.strategy)
    cuda = p.device == "cuda"
    # model states: the planner's per-GPU bytes against the largest rank's census
    states = {t: _term(float(getattr(plan.gpu, t)), float(max((r["census"] or {}).get(t, 0) for r in ranks)))
              for t in PARTS}
    total_m = max(sum((r["census"] or {}).get(t, 0) for t in PARTS) for r in ranks)
    states["model_states"] = _term(float(plan.gpu.model_states), float(total_m))
    # collectives of the instrumented (last) step, bytes per rank as the planner counts them
    measured_comm = [(r["comm"] or {}).get("bytes", {}) for r in ranks]
    kinds = [k for k in COMM_KINDS if getattr(comm_plan, k) or any(m.get(k) for m in measured_comm)]
    comm = {k: _term(float(getattr(comm_plan, k)), float(max(m.get(k, 0) for m in measured_comm))) for k in kinds}
    # memory by phase, per rank (the last timed step's readings; on CPU: host RSS)
    memory = {}
    for r in ranks:
        last = r["steps"][-1]["memory"] if r["steps"] else {}
        memory[f"rank{r['rank']}"] = {ph: last.get(ph, {}) for ph in PHASES}
    # time: steps between the warm-up and the instrumented last one
    timed_idx = list(range(1, steps - 1)) or list(range(max(steps - 1, 1))) or [0]
    per_rank_time = []
    for r in ranks:
        sel = [s for s in r["steps"] if s["step"] - 1 in timed_idx] or r["steps"]
        per_rank_time.append({f"{ph}_s": _median([s[f"{ph}_s"] for s in sel]) for ph in PHASES})
    records = ranks[0]["records"]
    sel = [rec for rec in records if rec["step"] - 1 in timed_idx] or records
    step_s = _median([rec["step_time_s"] for rec in sel])
    tokens = sel[-1]["tokens"] if sel else 0
    tps = tokens / step_s if step_s else None
    fpt = model_flops_per_token(run.model, run.train.seq_len)
    peak = run.hardware.gpu.peak_flops(run.train.compute_dtype) if cuda else None
    # the breakdown of rank 0 (whose StepRecords give the step time); every rank's is kept
    phase_s = {f"{ph}_s": per_rank_time[0][f"{ph}_s"] or 0.0 for ph in PHASES}
    from shardwise.plan.evaluate import evaluate

    planned = evaluate(run.model, run.hardware, run.train, run.strategy).time
    timing = {**phase_s, "step_s": step_s,
              # the planner's step for the same specs (on CPU it prices the GPU it was asked to plan)
              "predicted": {k: getattr(planned, k) for k in ("step_s", "compute_s", "gemm_s", "attention_s",
                                                             "memory_bound_s", "optimizer_s", "host_s",
                                                             "exposed_comm_s", "tokens_per_s_per_gpu")},
              "other_s": max(0.0, step_s - sum(phase_s.values())) if step_s else None,
              "tokens_per_s": tps, "tflops": tps * fpt / 1e12 if tps else None,
              "mfu": tps * fpt / (peak * p.world) if tps and peak else None,
              "timed_steps": [i + 1 for i in timed_idx], "per_rank": per_rank_time}
    doc: dict[str, Any] = {
        "label": p.label, "short": " ".join(o.partition("=")[2] for o in p.overrides) or p.label,
        "overrides": p.overrides, "strategy": run.strategy.name, "engine": run.strategy.engine,
        "world_size": p.world, "device": p.device, "micro_batch": run.config.run.micro_batch,
        "grad_accum": run.config.run.grad_accum, "seq_len": run.train.seq_len,
        "model_states": states, "comm": comm,
        "comm_step": steps, "comm_steady_state": steps >= 3,
        "memory_kind": "cuda_allocator" if cuda else "host_rss",
        "memory_by_phase": memory, "time": timing,
        "final_loss": records[-1]["loss"] if records else None,
    }
    if cuda:  # the plan's allocator figures exist only to compare with the allocator
        ph = plan.gpu.phases
        doc["memory_plan"] = {"forward": ph["forward"], "step": ph["step"], "allocated": plan.gpu.allocated,
                              "reserved": plan.gpu.reserved}
    return doc


def bench_points(config: Path, overrides: list[str], steps: int, nproc: int | None, out: Path,
                 sweep: list[str] | None, force: bool, progress: bool = True) -> dict[str, Any]:
    """Validate, run and compare every point; write bench.json and report.md under `out`."""
    from shardwise.bench.bench_report import write_report

    out.mkdir(parents=True, exist_ok=True)
    points = prepare(config, overrides, steps, nproc, out, sweep, force)
    results = []
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.fields[info]}"))
        task = bar.add_task("bench", total=len(points), info="")
        with bar:
            for p in points:
                bar.update(task, info=p.label)
                results.append(compare(p, launch(config, p, out), steps))
                bar.advance(task)
    else:
        for p in points:
            results.append(compare(p, launch(config, p, out), steps))
    doc = {"config": str(config), "steps": steps, "overrides": overrides, "sweep": sweep or [],
           "device": points[0].device, "memory_note": _memory_note(points[0].device), "points": results}
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    write_report(out, doc)
    return doc


def _memory_note(device: str) -> str:
    if device == "cuda":
        return ("memory_by_phase: torch.cuda.memory_stats() allocated/reserved peaks of each phase "
                "(peaks reset at each phase start), compared with the plan's phases")
    return ("memory_by_phase: host memory (process RSS at the end of each phase); it is not comparable with "
            "the GPU plan, which is compared on model-state bytes only (census)")


if __name__ == "__main__":
    sys.exit(rank_main())
