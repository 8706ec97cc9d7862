"""Forked CPU ranks: on CPU, `shardwise train` starts its local ranks by forking itself, after it
has checked the run and imported what a rank runs (torch, the model's transformers code, the
engine). A rank's imports cost seconds of CPU (docs/training.md "Flow", Launch), more than a
short CPU run's training; forked, the job pays them once, and the ranks skip the checks the
launcher has just made (they inherit its checked run).

CUDA ranks are exec'd, each a fresh interpreter, as torchrun starts them: a process that has
touched the CUDA driver cannot be forked (the child's first CUDA call fails), and against a GPU
job's start-up (NCCL, loading the weights) the imports do not count.

Fork safety. GNU OpenMP, behind torch's and MKL's intra-op threads, is not fork-safe: a child
whose parent ran a parallel region on more than one thread hangs in its own first one (torch
2.13 CPU wheel: a 2000² matmul on 2 threads before the fork, the child's own on 2 threads
never returns). So the launcher of a forking job runs single-threaded: OMP_NUM_THREADS and
MKL_NUM_THREADS are 1 from before torch is loaded, libgomp never starts a pool there, and each
rank sets its own thread count (run.device cpu: cores / ranks). The ranks are exec'd instead when
that cannot be ensured: torch already loaded when the launcher decided (a caller that imported
it), another Python thread running at the fork, or `SHARDWISE_RANK_START=exec` (to rule forking
out when debugging a start-up). `run.device: auto` is decided with torch: the launcher is made
single-threaded before that, for the CPU it may find.
"""

from __future__ import annotations

import os
import sys
import threading

from shardwise.errors import ShardwiseError

RANK_START_ENV = "SHARDWISE_RANK_START"
RANK_STARTS = ("auto", "exec")
# What sizes an OpenMP or MKL pool: set to 1 in a forking launcher, given back to its ranks.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def rank_start() -> str:
    """SHARDWISE_RANK_START: 'auto' (unset: fork CPU ranks where that is safe) or 'exec'."""
    value = os.environ.get(RANK_START_ENV, "auto").strip().lower() or "auto"
    if value not in RANK_STARTS:
        raise ShardwiseError(f"environment variable {RANK_START_ENV}={os.environ[RANK_START_ENV]!r}: expected one "
                             f"of {', '.join(RANK_STARTS)}")
    return value


def exec_forced() -> bool:
    """This run's ranks are exec'd, whatever shardwise.plan.load.forked_ranks says of its device and
    size: SHARDWISE_RANK_START=exec, or a launcher other than shardwise's started them (torchrun,
    srun)."""
    from shardwise.train.launch.rank import detect_env

    outside = detect_env() is not None and os.environ.get("SHARDWISE_LAUNCHED") != "1"
    return outside or rank_start() == "exec"


def planned_forked() -> bool | None:
    """Whether this run's ranks are forked, as the host plan takes it (shardwise.plan.load's and
    shardwise.plan.host_cpu's `forked`): False where they are exec'd whatever their device and size
    (`exec_forced`), else None (the planner decides from them: shardwise.plan.load.forked_ranks)."""
    return False if exec_forced() else None


def single_threaded_launcher(device: str, world: int) -> dict[str, str | None] | None:
    """Make this launcher forkable for `world` local ranks on `device`: OMP_NUM_THREADS and
    MKL_NUM_THREADS become 1 before torch loads. Returns their earlier values (None: unset),
    which the ranks get back; None when the ranks will be exec'd (CUDA, one rank, torch already
    loaded, no fork on this platform, SHARDWISE_RANK_START=exec)."""
    from shardwise.plan.load import forked_ranks

    if not forked_ranks(device, world) or rank_start() == "exec" or not sys.platform.startswith("linux"):
        return None
    if "torch" in sys.modules:  # its OpenMP pool may exist: only a fresh interpreter is safe
        return None
    earlier = {name: os.environ.get(name) for name in THREAD_VARS}
    for name in THREAD_VARS:
        os.environ[name] = "1"
    return earlier


def launch_device(cfg, world: int) -> tuple[str, dict[str, str | None] | None]:
    """The device of a run this process launches on `world` local ranks, and
    `single_threaded_launcher`'s answer for it. `run.device: auto` asks torch whether there is a
    GPU, so the launcher is made single-threaded before that, and gets its variables back when
    there is one (its ranks are then exec'd)."""
    if cfg.run.device != "auto":
        return cfg.run.device, single_threaded_launcher(cfg.run.device, world)
    earlier = single_threaded_launcher("cpu", world)
    device = cfg.resolved_device()
    if device != "cpu" and earlier is not None:
        from shardwise.train.launch.rank import set_environ

        set_environ(earlier)
        earlier = None
    return device, earlier


def forkable() -> bool:
    """No other Python thread runs now: a fork copies only the calling thread, and a lock
    another one holds would stay held in the child for ever."""
    return threading.active_count() == 1
