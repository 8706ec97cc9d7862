"""Process launch: spawn `--nproc` local ranks, or join ranks started by torchrun, the
`deepspeed` launcher or SLURM `srun` (detected from their environment variables)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

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


def init_distributed(device: str):
    """Join the process group (gloo on CPU, nccl on CUDA) and return this rank's DistEnv."""
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
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            rank=env.rank,
            world_size=env.world_size,
            device_id=env.torch_device if device == "cuda" else None,
        )
    return env


def spawn(
    argv: Sequence[str],
    nproc: int,
    timeout_s: float | None = None,
    extra_env: dict | None = None,
    threads_per_rank: int | None = None,
) -> int:
    """Run `python argv...` as `nproc` local ranks (torchrun's env contract); return the worst rc.

    If one rank fails the others are terminated, so a crash never leaves a hung collective.
    """
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        if threads_per_rank:
            env["OMP_NUM_THREADS"] = str(threads_per_rank)
        env.update(extra_env or {})
        procs.append(subprocess.Popen([sys.executable, *argv], env=env))
    import time

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    rcs: list[int | None] = [None] * nproc
    try:
        while any(rc is None for rc in rcs):
            for i, p in enumerate(procs):
                if rcs[i] is None:
                    rcs[i] = p.poll()
            if any(rc not in (None, 0) for rc in rcs):
                break
            if deadline is not None and time.monotonic() > deadline:
                rcs = [124 if rc is None else rc for rc in rcs]
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    bad = [1 if rc is None else rc for rc in rcs if rc != 0]
    return bad[0] if bad else 0
