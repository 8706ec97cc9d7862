"""Run a command as the only member of a fresh cgroup v1 memory controller, capped: the whole
process tree (`shardwise train`'s launcher and every rank it spawns) shares the cap, as a job
under a batch scheduler does. Needs root and /sys/fs/cgroup/memory (CI and the development
machines have both); where either is missing the command runs uncapped and says so."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup/memory")


def cgroup_available() -> bool:
    return os.geteuid() == 0 and (CGROUP / "cgroup.procs").is_file()


def run_capped(cmd: list[str], cap: int, env: dict[str, str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` (`kw` may change how output is
    captured) with the tree capped at `cap` bytes; the result's `peak` is the group's
    memory.max_usage_in_bytes (None uncapped)."""
    kw = {"capture_output": True, **kw}
    if not kw["capture_output"]:
        kw.pop("capture_output")
    if not cgroup_available():
        r = subprocess.run(cmd, env=env, text=True, timeout=timeout, check=False, **kw)
        r.peak = None
        print(f"cgroup_run: no cgroup v1 memory controller or not root: ran without the {cap} B cap")
        return r
    with memory_cgroup(cap) as join:
        r = subprocess.run(cmd, env=env, text=True, timeout=timeout, check=False, preexec_fn=join, **kw)
        r.peak = int((join.group / "memory.max_usage_in_bytes").read_text())
        return r


@contextlib.contextmanager
def memory_cgroup(cap: int | None, name: str | None = None):
    """A fresh cgroup v1 memory controller (capped at `cap` bytes unless None), removed on exit.
    Yields the `preexec_fn` that puts a child in it before it execs (so every process it starts
    is in it too); its `group` is the cgroup's directory."""
    group = CGROUP / (name or f"shardwise-test-{uuid.uuid4().hex[:12]}")
    group.mkdir()
    try:
        if cap is not None:
            (group / "memory.limit_in_bytes").write_text(str(cap))
        procs = str(group / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        join.group = group
        yield join
    finally:
        for _ in range(50):  # the kernel frees the group once its last process is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
