"""`shardwise bench`, parent side: the points of a run or a `--sweep`, validated, launched and
set beside the plan.

Each point (the config, its `--set` overrides, one `--sweep` combination) is validated like
`shardwise train` does (load_config + preflight: the same RunSpec, the same planner) before any
runs. Then, as the trainer does:
- without a launcher in the environment, each point is launched with
  `shardwise.train.spawn.spawn` as `python -m shardwise.bench.run_bench CONFIG --set ...` on
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

# What a bench point forces on the config: N steps, no checkpoints or exports, quiet ranks.
FORCED = ("checkpointing.save_final=false", "checkpointing.save_every_steps=null",
          "checkpointing.save_every_minutes=null", "checkpointing.resume=null", "logging.progress=false",
          "logging.tensorboard=false", "logging.wandb=false")


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


# Short names for the usual axes (the issue's `--sweep strategies=zero2,zero3 --sweep micro_batch=1,2,4`).
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
    from shardwise.train.launch import detect_env

    return None if os.environ.get("SHARDWISE_LAUNCHED") == "1" else detect_env()


def prepare(config: Path, overrides: list[str], steps: int, nproc: int | None, out: Path,
            sweep: list[str] | None, force: bool, world: int | None = None) -> list[Point]:
    """Every point validated (config, data, strategy vs world size, planner) before any runs.
    `world`: the launcher's world size (then `--nproc` does not apply)."""
    from shardwise.train.config import load_config
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
        p.planned_bytes = check.planned_bytes
        points.append(p)
    return points


def launch(config: Path, p: Point, out: Path) -> list[dict[str, Any]]:
    """Run one point on `p.world` spawned local ranks; return the per-rank results (rank order)."""
    from shardwise.bench.probe import OUT_ENV
    from shardwise.train.cli import _own_output_dir, _run_dir
    from shardwise.train.spawn import spawn

    rank_dir = out / "runs" / p.slug / "bench"
    rank_dir.mkdir(parents=True, exist_ok=True)
    for old in [*rank_dir.glob("rank*.json"), *rank_dir.glob("memory_snapshot_rank*.pickle")]:
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


def launch_here(p: Point, out: Path, rank: int, last: bool = True) -> list[dict[str, Any]] | None:
    """Run one point as this rank of the outer launcher's job; rank 0 gets every rank's result.
    The process group outlives every point but the `last` (the next point joins it)."""
    from shardwise.bench.probe import OUT_ENV
    from shardwise.bench.run_bench import run_rank
    from shardwise.train.cli import _own_output_dir

    rank_dir = out / "runs" / p.slug / "bench"
    rank_dir.mkdir(parents=True, exist_ok=True)
    os.environ[OUT_ENV] = str(rank_dir.resolve())  # where a CUDA memory snapshot goes
    lock = _own_output_dir(p.run.config) if rank == 0 else None
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
    (rank_dir / f"rank{rank}.json").write_text(json.dumps(results[rank]))
    return results if rank == 0 else None


def bench_points(config: Path, overrides: list[str], steps: int, nproc: int | None, out: Path,
                 sweep: list[str] | None, force: bool, progress: bool = True) -> dict[str, Any] | None:
    """Validate, run and compare every point; write bench.json and report.md under `out`.
    Under an outer launcher only rank 0 writes and returns the document (the others: None)."""
    from shardwise.bench.bench_report import write_report
    from shardwise.bench.compare import compare, memory_note

    launched = outer_launcher()
    rank = int(launched["rank"]) if launched else 0
    if launched:  # as the spawned ranks do (run_bench.rank_main): torch's deprecation notes, once per call
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
    out.mkdir(parents=True, exist_ok=True)
    points = prepare(config, overrides, steps, nproc, out, sweep, force,
                     world=int(launched["world_size"]) if launched else None)

    def run_point(p: Point) -> dict[str, Any] | None:
        ranks = launch_here(p, out, rank, last=p is points[-1]) if launched else launch(config, p, out)
        return compare(p, ranks, steps) if ranks is not None else None

    results = []
    if progress and rank == 0:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.fields[info]}"))
        task = bar.add_task("bench", total=len(points), info="")
        with bar:
            for p in points:
                bar.update(task, info=p.label)
                results.append(run_point(p))
                bar.advance(task)
    else:
        results = [run_point(p) for p in points]
    if rank != 0:
        return None
    doc = {"config": str(config), "steps": steps, "overrides": overrides, "sweep": sweep or [],
           "device": points[0].device, "launcher": launched["launcher"] if launched else "spawn",
           "memory_note": memory_note(points[0].device), "points": results}
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    write_report(out, doc)
    return doc
