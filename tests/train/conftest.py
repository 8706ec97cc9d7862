"""Shared helpers: run a worker script on N gloo ranks, once per test session.

Results are cached in a directory shared by all pytest-xdist workers and guarded by a file
lock, so the (slow) multi-process runs happen once however the tests are distributed.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
from filelock import FileLock

HERE = Path(__file__).parent
WORKER = HERE / "parity_worker.py"
TIMEOUT_S = 240


def run_ranks(script: Path, args: list[str], nproc: int, timeout_s: float = TIMEOUT_S) -> None:
    from shardwise.train.launch.spawn import spawn

    rc = spawn(
        [str(script), *args],
        nproc,
        timeout_s=timeout_s,
        threads_per_rank=1,
        extra_env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"},
    )
    if rc == 124:
        pytest.fail(f"{script.name} {args} timed out after {timeout_s}s on {nproc} ranks")
    assert rc == 0, f"{script.name} {args} failed on {nproc} ranks (rc {rc}); see captured stderr"


def run_once(out: Path, script: Path, launches: list[tuple[list[str], int, float]]) -> Path:
    """Run `script --out OUT --runs ITEMS...` for each (items, nproc, timeout_s) of `launches`,
    in order, once per test session however the tests are distributed (a file lock and a DONE
    marker in the shared `out`); returns `out`."""
    with FileLock(str(out) + ".lock"):
        if not (out / "DONE").exists():
            out.mkdir(exist_ok=True)
            for items, nproc, timeout_s in launches:
                run_ranks(script, ["--out", str(out), "--runs", *items], nproc, timeout_s=timeout_s)
            (out / "DONE").touch()
    return out


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    # The parent of the per-worker basetemp is common to all xdist workers of a session.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    d = root / "train-shared"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session")
def ranks_runner(shared_dir):
    """`runner(runs, nproc)` -> output dir, each distinct request executed once per session."""

    def run(runs: list[str], nproc: int) -> Path:
        key = hashlib.sha1(f"{nproc}:{' '.join(runs)}".encode()).hexdigest()[:12]
        return run_once(shared_dir / key, WORKER, [(runs, nproc, TIMEOUT_S)])

    return run


sys.path.insert(0, str(HERE))  # parity_worker's constants are shared with the tests


DEMO = HERE.parent.parent / "examples" / "demo.yaml"
DEMO_STEPS = 25  # five progress lines at the demo's logging.every: 5


@pytest.fixture(scope="session")
def demo_run(shared_dir):
    """`demo_run(strategy)` -> {"out", "log", "rc", "peak", "cap"}: `shardwise train
    examples/demo.yaml` on 2 CPU ranks for DEMO_STEPS steps with its final export, stdout and
    stderr through one pipe (a batch log), Python's warnings as a user sees them, the whole job in
    a memory cgroup capped at the plan's own node figure + 15% (shardwise.plan.host_cpu); run
    once per session per strategy however xdist distributes the tests that read it."""
    import json
    import subprocess

    from cgroup_run import run_capped

    def run(strategy: str) -> dict:
        out = shared_dir / f"demo-{strategy}"
        meta = shared_dir / f"demo-{strategy}.json"
        with FileLock(str(out) + ".lock"):
            if not meta.exists():
                from shardwise.config.load import load_config
                from shardwise.run.bridge import run_spec
                from shardwise.train.host_memory import planned_cpu

                sets = [f"run.steps={DEMO_STEPS}", f"strategy.name={strategy}", f"checkpointing.output_dir={out}",
                        "checkpointing.save_final=true"]
                plan = planned_cpu(run_spec(load_config(DEMO, sets), 2, "cpu"))
                cap = int(1.15 * plan.per_node)
                env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "SHARDWISE_VERBOSE")}
                cmd = [sys.executable, "-m", "shardwise.train.cli", str(DEMO)]
                for s in sets:
                    cmd += ["--set", s]
                r = run_capped(cmd, cap=cap, env={**env, "DS_ACCELERATOR": "cpu"}, timeout=TIMEOUT_S,
                               cwd=HERE.parent.parent, stderr=subprocess.STDOUT, capture_output=False,
                               stdout=subprocess.PIPE)
                meta.write_text(json.dumps({"out": str(out), "log": r.stdout, "rc": r.returncode, "peak": plan.peak,
                                            "cap": cap}))
        return json.loads(meta.read_text())

    return run
