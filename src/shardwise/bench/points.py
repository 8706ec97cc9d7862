"""`shardwise bench`, parent side: the points of a run or a `--sweep`, validated, launched and
set beside the plan.

Each point (the config, its `--set` overrides, one `--sweep` combination) is validated like
`shardwise train` does (load_config + preflight: the same RunSpec, the same planner) before any
runs. Then, as the trainer does:
- without a launcher in the environment, each point is launched with
  `shardwise.train.launch.spawn.spawn` as `python -m shardwise.bench.run_bench CONFIG --set ...` on
  `nproc` local ranks, which write `rank<r>.json` under `<out>/runs/<point>/bench`;
- under torchrun, the `deepspeed` launcher or `srun` (RANK / WORLD_SIZE or SLURM_* in the
  environment) this process IS a rank: it runs each point in-process (`run_bench.run_rank`)
  and the results are gathered over the process group; rank 0 writes the outputs.
`compare` (shardwise.bench.compare) sets each point beside its plan; rank 0 / the parent
writes bench.json and report.md (shardwise.bench.bench_report).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise import strict_json
from shardwise.errors import ExitCode, ShardwiseError

# What a bench point forces on the config: N steps, no checkpoints or exports (not even on SIGTERM:
# an interrupted point is not resumed, it is left out of the report), quiet ranks, host syncs at the
# logging steps only (none on a clock: the measured steps are the same whatever their speed).
FORCED = ("checkpointing.save_final=false", "checkpointing.save_every_steps=null",
          "checkpointing.save_every_minutes=null", "checkpointing.save_on_interrupt=false",
          "checkpointing.resume=null", "logging.progress=false", "logging.every_seconds=null",
          "logging.trackers=[]")
# Stops that end a bench early with the points measured so far reported (and exit code 75).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")


@dataclass
class Point:
    label: str
    overrides: list[str]  # the sweep's own overrides (after the user's --set)
    slug: str = ""
    all_overrides: list[str] = field(default_factory=list)
    run: Any = None
    world: int = 1
    device: str = "cpu"
    planned_bytes: float | None = None


class BenchFailed(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# Short names for the usual axes (`--sweep strategies=zero2,zero3 --sweep micro_batch=1,2,4`).
ALIASES = {"strategy": "strategy.name", "strategies": "strategy.name", "micro_batch": "run.micro_batch",
           "grad_accum": "run.grad_accum", "checkpointing": "checkpointing.activation"}


def parse_sweep(sweep: list[str] | None, aliases: dict[str, str] | None = None) -> list[tuple[str, list[str]]]:
    """`key=v1,v2` (repeatable) -> [(label, [key=v, ...]), ...]: the cartesian product. `key` is
    section.field, or a short name of ALIASES (`seq_len` too when `aliases` names its field)."""
    axes: list[tuple[str, list[str]]] = []
    names = {**ALIASES, **(aliases or {})}
    for s in sweep or []:
        key, eq, values = s.partition("=")
        key = names.get(key.strip(), key.strip())
        vals = [v.strip() for v in values.split(",")] if eq else []
        if not key or not eq or not vals or any(not v for v in vals):
            raise ShardwiseError(f"--sweep {s!r}: expected section.field=v1,v2,... (e.g. "
                                 "--sweep strategy.name=ddp,zero2,zero3,fsdp)")
        if "." not in key:
            raise ShardwiseError(f"--sweep {s!r}: field {key!r} is not section.field (e.g. run.micro_batch) "
                                 f"nor one of {', '.join(sorted(names))}")
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


def outer_launcher() -> dict[str, Any] | None:
    """The launcher's rank/world when an outer launcher started this process, else None (a rank
    of our own spawn runs `python -m shardwise.bench.run_bench`, never this CLI)."""
    from shardwise.train.launch.rank import detect_env

    return None if os.environ.get("SHARDWISE_LAUNCHED") == "1" else detect_env()


def prepare(config: Path, overrides: list[str], steps: int, nproc: int | None, out: Path,
            sweep: list[str] | None, force: bool, world: int | None = None) -> list[Point]:
    """Every point validated (config, data, strategy vs world size, planner) before any runs.
    `world`: the launcher's world size (then `--nproc` does not apply)."""
    from shardwise.config.load import load_config
    from shardwise.train.preflight import preflight

    if steps < 1:
        raise ShardwiseError(f"--steps {steps}: expected at least 1 optimizer step (3 or more for steady-state "
                             "collective counts)")
    if nproc is not None and nproc < 1:
        raise ShardwiseError(f"--nproc {nproc}: expected at least 1 local rank")
    if not config.is_file():
        raise ShardwiseError(f"{config}: config file not found")
    base = load_config(config, overrides)
    seq = "data.synthetic.seq_len" if base.data.kind == "synthetic" else "data.sft.max_length"
    points = []
    for label, extra in parse_sweep(sweep, {"seq_len": seq, "sequence": seq}):
        p = Point(label=label, overrides=extra, slug=_slug(label))
        p.all_overrides = [*overrides, *extra, f"run.steps={steps}",
                           f"checkpointing.output_dir={(out / 'runs' / p.slug).resolve()}", *FORCED]
        cfg = load_config(config, p.all_overrides)
        p.world = world if world is not None else nproc if nproc is not None else cfg.run.nproc
        p.device = cfg.resolved_device()
        p.run, check = preflight(cfg, p.world, p.device, force=force)
        if p.run.layout.pp > 1:
            raise ShardwiseError(f"{config}: point {label!r}: strategy.pp {p.run.layout.pp}: the bench splits each "
                                 "micro-batch's forward, backward and optimizer step, and a pipeline schedule "
                                 "interleaves the micro-batches of all stages; bench a pp 1 layout (shardwise train "
                                 "runs pp > 1 and reports its step time and memory)")
        p.planned_bytes = check.planned_bytes
        points.append(p)
    return points


def launch(config: Path, p: Point, out: Path) -> list[dict[str, Any]]:
    """Run one point on `p.world` spawned local ranks; return the per-rank results (rank order)."""
    from shardwise.bench.probe import OUT_ENV
    from shardwise.train.cli import _own_output_dir, _run_dir
    from shardwise.train.launch.spawn import spawn

    rank_dir = out / "runs" / p.slug / "bench"
    rank_dir.mkdir(parents=True, exist_ok=True)
    for old in [*rank_dir.glob("rank*.json"), *rank_dir.glob("memory_snapshot_rank*.pickle")]:
        old.unlink()
    argv = ["-m", "shardwise.bench.run_bench", str(config), *[a for o in p.all_overrides for a in ("--set", o)]]
    extra = {"SHARDWISE_LAUNCHED": "1", OUT_ENV: str(rank_dir.resolve())}
    extra |= {"DS_ACCELERATOR": "cpu"} if p.device == "cpu" else {}
    threads = max(1, (os.cpu_count() or 1) // p.world) if p.device == "cpu" else None
    lock = _own_output_dir(p.run.config, None)  # a fresh run: FORCED sets checkpointing.resume=null
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


def launch_here(p: Point, out: Path, rank: int, last: bool = True) -> list[dict[str, Any]] | None:
    """Run one point as this rank of the outer launcher's job; rank 0 gets every rank's result.
    The process group outlives every point but the `last` (the next point joins it)."""
    from shardwise.bench.probe import OUT_ENV
    from shardwise.bench.run_bench import run_rank
    from shardwise.train.cli import _own_output_dir

    rank_dir = out / "runs" / p.slug / "bench"
    rank_dir.mkdir(parents=True, exist_ok=True)
    os.environ[OUT_ENV] = str(rank_dir.resolve())  # where a CUDA memory snapshot goes
    lock = _own_output_dir(p.run.config, None) if rank == 0 else None  # fresh, as in launch
    try:
        rc, _, results = run_rank(p.run, p.planned_bytes, rank, gather=True, keep_group=not last)
    finally:
        if lock is not None:
            lock.release()
    if rc != 0 or results is None:
        raise BenchFailed(f"bench point {p.label!r}: rank {rank} of the trainer exited with code {rc}"
                          + ("" if results else " before the ranks' results were gathered"), rc or 1)
    for r in results:
        r["rc"] = rc if r["rank"] == rank else r["rc"]
    (rank_dir / f"rank{rank}.json").write_text(strict_json.dumps(results[rank]))
    return results if rank == 0 else None


def bench_points(config: Path, overrides: list[str], steps: int, nproc: int | None, out: Path,
                 sweep: list[str] | None, force: bool, progress: bool | str = True) -> dict[str, Any] | None:
    """Validate, run and compare every point; write bench.json and report.md under `out`.
    Under an outer launcher only rank 0 writes and returns the document (the others: None).
    `progress`: as logging.progress (a bar on a terminal, a line per point start and end
    otherwise; False: nothing)."""
    from shardwise.bench.bench_report import write_report
    from shardwise.bench.compare import compare, memory_note

    launched = outer_launcher()
    rank = int(launched["rank"]) if launched else 0
    out.mkdir(parents=True, exist_ok=True)
    points = prepare(config, overrides, steps, nproc, out, sweep, force,
                     world=int(launched["world_size"]) if launched else None)

    stops: list[int] = []  # stop signals received while the bench ran (_stops_recorded)

    def run_point(p: Point) -> dict[str, Any] | None:
        ranks = launch_here(p, out, rank, last=p is points[-1]) if launched else launch(config, p, out)
        return compare(p, ranks, steps) if ranks is not None else None

    results: list[dict[str, Any] | None] = []
    failed: BenchFailed | None = None

    from shardwise.console import PointsProgress, resolve_mode

    shown = PointsProgress(resolve_mode(progress) if rank == 0 else "off", len(points))

    def run_all() -> None:
        nonlocal failed
        for p in points:
            if watch():
                return
            shown.started(p.label, f"{p.world} rank(s), {steps} steps")
            try:
                results.append(run_point(p))
            except BenchFailed as e:  # a point that failed or was interrupted: report those before it
                shown.finished(p.label, ok=False)
                failed = e
                return
            shown.finished(p.label)

    with _stops_recorded(stops, enabled=not launched) as watch:
        try:
            run_all()
        finally:
            shown.close()
    if rank != 0:
        if failed is not None:
            raise failed
        return None
    doc = {"config": str(config), "steps": steps, "overrides": overrides, "sweep": sweep or [],
           "device": points[0].device, "launcher": launched["launcher"] if launched else "spawn",
           "memory_note": memory_note(points[0].device), "points": results}
    # a stop that came after the last point was measured changes nothing: the bench is complete
    stopped = None if failed is None and len(results) == len(points) else _stop_text(stops, failed)
    if stopped is not None:
        if not results:  # nothing measured: nothing to report
            raise failed if failed is not None else BenchFailed(f"bench {stopped} before any point was measured",
                                                                 int(ExitCode.INTERRUPTED))
        doc["incomplete"] = {"reason": stopped, "measured": len(results), "points": len(points),
                             "not_measured": [p.label for p in points[len(results):]]}
    (out / "bench.json").write_text(strict_json.dumps(doc, indent=2))
    write_report(out, doc)
    if stopped is not None:
        # a stop ends the bench with 75 whatever it did to the point in flight (a rank still starting
        # dies of the forwarded SIGTERM: 143); a point that failed on its own keeps its code
        code = int(ExitCode.INTERRUPTED) if stops or failed is None else failed.code
        raise BenchFailed(f"bench {stopped} after {len(results)} of {len(points)} points; {out / 'bench.json'} and "
                          f"{out / 'report.md'} hold the measured ones"
                          + (f" ({failed})" if failed is not None else ""), code)
    return doc


def _stop_text(stops: list[int], failed: BenchFailed | None) -> str | None:
    """Why the bench ended early, or None when every point was measured."""
    if stops:
        return f"interrupted by {signal.Signals(stops[0]).name}"
    if failed is None:
        return None
    interrupted = failed.code == ExitCode.INTERRUPTED or failed.code - 128 in (signal.SIGTERM, signal.SIGINT)
    return "interrupted" if interrupted else "stopped by a failed point"


@contextmanager
def _stops_recorded(stops: list[int], enabled: bool = True) -> Iterator[Any]:
    """Record SIGTERM/SIGINT/SIGHUP/SIGUSR1 in `stops` for the bench's lifetime, wherever they
    land; yields `watch()`, which collects what arrived and returns `stops`.

    Between points a stop used to kill the process with nothing written; now the bench writes
    what it measured and exits 75. During a point, spawn's own handler forwards the stop to the
    ranks (they stop at the next step: the point fails with 75) but keeps it to itself, and a
    stop that lands as the ranks finish is forwarded to none and the point completes: so the
    signal numbers are also taken from the wakeup fd (`signal.set_wakeup_fd`), which the
    interpreter writes for every signal that has a Python handler, spawn's included. Main
    thread only (elsewhere Python sets no handlers); the previous handlers and fd come back."""
    wanted = [sig for name in STOP_SIGNALS if (sig := getattr(signal, name, None)) is not None]
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield lambda: stops
        return
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    previous: dict[int, Any] = {}
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for sig in wanted:
        if signal.getsignal(sig) == signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            continue
        previous[sig] = signal.signal(sig, lambda signum, frame: None)  # the fd records it

    def watch() -> list[int]:
        while True:
            try:
                data = os.read(r, 512)
            except BlockingIOError:
                break
            if not data:
                break
            stops.extend(b for b in data if b in wanted)
        return stops

    try:
        yield watch
    finally:
        watch()
        signal.set_wakeup_fd(old_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(r)
        os.close(w)
