"""A rank's side of process launch: detect ranks started by torchrun, the `deepspeed` launcher,
SLURM `srun` or shardwise's own `spawn` (shardwise.train.launch.spawn) from their environment, join
the process group, and end the process without the interpreter shutdown gloo can abort in.
`python -m shardwise.train.launch.rank -m shardwise.train.cli ...` is how spawn starts trainer ranks
(`rank_main`: stop signals are recorded from the first instant, never fatal during start-up)."""

from __future__ import annotations

import functools
import os
import socket
import sys
from collections.abc import Callable

from shardwise.errors import ShardwiseError


def detect_env(environ: dict[str, str] | None = None) -> dict[str, int | str] | None:
    """Rank/world/local-rank from an external launcher, or None when we must spawn ourselves.

    torchrun and the deepspeed launcher both export RANK/WORLD_SIZE/LOCAL_RANK; `srun` exports
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (MASTER_ADDR must then come from the batch script).
    """
    e = os.environ if environ is None else environ
    if "RANK" in e and "WORLD_SIZE" in e:
        launcher = (
            "torchrun" if "TORCHELASTIC_RUN_ID" in e else "deepspeed" if "DEEPSPEED_RANK" in e else "env"
        )
        return {
            "launcher": launcher,
            "rank": int(e["RANK"]),
            "world_size": int(e["WORLD_SIZE"]),
            "local_rank": int(e.get("LOCAL_RANK", 0)),
        }
    if "SLURM_PROCID" in e and int(e.get("SLURM_NTASKS", "1")) > 1:
        return {
            "launcher": "srun",
            "rank": int(e["SLURM_PROCID"]),
            "world_size": int(e["SLURM_NTASKS"]),
            "local_rank": int(e.get("SLURM_LOCALID", 0)),
        }
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The collective backstop is this much longer than run.timeout_s, so that the rank's
# Watchdog (which names the stalled rank and phase) fires before gloo/NCCL raise their own
# timeout (which names neither).
COLLECTIVE_MARGIN_S = 30.0


# Set by `init_distributed` when this process creates a process group: from then on it ends
# through `os._exit` (see `run_rank_script`).
_JOINED_GROUP = False


def run_rank_script(main: Callable[[], int | None], *, only_if_joined: bool = False) -> None:
    """Run a rank script's `main` and end the process without Python's interpreter shutdown.

    On gloo the process groups outlive `destroy_process_group()` (DeepSpeed keeps references),
    and a gloo worker thread that drops a finished work holding a Python-owned tensor during
    `Py_FinalizeEx` must take the GIL; Python then ends that thread inside a noexcept frame and
    the process aborts ("terminate called without an active exception", rc 134: read from a
    core dump of tests/train/resume_worker.py, which hit it under CI). `os._exit` after flushing
    skips the finalization; the script has written and closed its outputs by then.

    `only_if_joined`: for the CLI entry points, which also run commands that never train (plan,
    emit): those exit normally, so atexit handlers and unclosed files still get their turn."""
    import traceback

    try:
        code = main() or 0
    except SystemExit as e:  # as the interpreter reads it: None is 0, a message is printed and is 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if only_if_joined and not _JOINED_GROUP:
        sys.exit(code)
    os._exit(code)


def set_environ(values: dict[str, str | None]) -> None:
    """Update os.environ with `values`; a variable whose value is None is removed."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def name_rank(rank: int | str) -> None:
    """Name this process `shardwise-r<rank>` (/proc/<pid>/comm: what `top`, `ps -o comm` and
    `pgrep` show): a forked rank shares its launcher's command line, and an exec'd one is just
    `python`. Linux only; elsewhere a no-op."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(f"shardwise-r{rank}"[:15])
    except OSError:
        pass


def rank_main(argv: list[str] | None = None) -> None:
    """`python -m shardwise.train.launch.rank (-m MODULE | SCRIPT) ARGS...`: a rank's entry point
    when spawn holds the stop signals (spawn_job(hold_signals=True)). Before anything else
    (torch, the config, the process group: seconds) it installs the stop handlers and unblocks
    the signals the launcher kept blocked across fork and exec (shardwise.train.launch.signals), then
    runs MODULE or SCRIPT as `python -m MODULE ARGS` / `python SCRIPT ARGS` would. A SIGTERM
    while the rank starts is therefore kept and honoured at the first step boundary (a
    checkpoint, exit 75) instead of killing it (rc 143)."""
    from shardwise.train.launch.signals import hold_at_start

    hold_at_start()
    name_rank(os.environ.get("RANK", "?"))
    import runpy

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["-m"] and len(argv) >= 2:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    else:
        raise SystemExit("usage: python -m shardwise.train.launch.rank (-m MODULE | SCRIPT) [ARGS...]")


# A CLI entry point (`shardwise`, `python -m shardwise.train.cli`): a process that joined a process
# group (it trained, in-process or as a rank) ends through `os._exit`, which gloo needs (see
# `run_rank_script`); every other command exits normally.
run_cli = functools.partial(run_rank_script, only_if_joined=True)


def init_distributed(device: str, timeout_s: float | None = None):
    """Join the process group (gloo on CPU, nccl on CUDA) and return this rank's DistEnv.

    `timeout_s` is `run.timeout_s`: rendezvous and every collective give up after
    `timeout_s + COLLECTIVE_MARGIN_S`. That is a backstop only; the Watchdog, started with
    `timeout_s`, is meant to speak first because it can say which rank stopped and where.
    None keeps torch's default (30 min; 10 min for NCCL builds).
    """
    global _JOINED_GROUP
    import datetime

    import torch
    import torch.distributed as dist

    from shardwise.train.engines.base import DistEnv

    found = detect_env() or {"rank": 0, "world_size": 1, "local_rank": 0}
    # DeepSpeed reads these from the environment even for a single in-process rank.
    for key, value in (
        ("RANK", found["rank"]),
        ("WORLD_SIZE", found["world_size"]),
        ("LOCAL_RANK", found["local_rank"]),
    ):
        os.environ.setdefault(key, str(value))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if found["world_size"] > 1:
            raise ShardwiseError("MASTER_PORT is not set: multi-rank launches must export MASTER_ADDR/PORT")
        os.environ["MASTER_PORT"] = str(free_port())
    env = DistEnv(
        rank=int(found["rank"]),
        world_size=int(found["world_size"]),
        local_rank=int(found["local_rank"]),
        device=device,
    )
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        _JOINED_GROUP = True
        extra = {}
        if timeout_s is not None:
            extra["timeout"] = datetime.timedelta(seconds=float(timeout_s) + COLLECTIVE_MARGIN_S)
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            rank=env.rank,
            world_size=env.world_size,
            device_id=env.torch_device if device == "cuda" else None,
            **extra,
        )
    return env


if __name__ == "__main__":
    rank_main()
