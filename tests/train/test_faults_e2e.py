"""`shardwise train` survives what clusters do to jobs (2 gloo ranks on CPU, real signals).

- a rank SIGKILLed at a random step, then `--resume latest`: the final weights equal the
  uninterrupted run's, bit for bit;
- SIGTERM to the launcher: every rank checkpoints at the next step boundary, the job exits
  75, no process is left, and the resumed run again ends on the uninterrupted weights;
- a SIGSTOPped rank: the job fails within run.timeout_s with a message naming that rank;
- SIGKILL in the middle of a checkpoint save: the partial checkpoint is never used, the
  previous one loads, and the next run removes the leftovers;
- NaN from a diverging learning rate: exit 3, status failed, nothing exported.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.errors import ExitCode
from shardwise.train.launch.watchdog import heartbeat_path, proc_state

HERE = Path(__file__).parent
REPO = HERE.parent.parent
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"
STEPS = 12


def _alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


def start(out: Path, *extra: str, steps: int = STEPS) -> subprocess.Popen:
    """The CLI in its own process (so it can be signalled), 2 ranks, checkpoints every 4 steps."""
    sets = [f"checkpointing.output_dir={out}", f"run.steps={steps}", "checkpointing.save_every_steps=4",
            "checkpointing.keep_last=3", "checkpointing.save_final=true", "logging.progress=false",
            "logging.trackers=[]", "run.timeout_s=20"]  # fmt: skip
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--nproc", "2"]
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([*argv, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"shardwise train did not finish in {timeout}s:\n{out[-3000:]}")
    return p.returncode, out


def wait_for_step(out: Path, step: int, p: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if p.poll() is not None:
            pytest.fail(f"the run ended (rc {p.returncode}) before step {step}:\n{p.stdout.read()[-3000:]}")
        if path.is_file():
            lines = path.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        time.sleep(0.02)
    pytest.fail(f"step {step} not reached in {timeout}s")


def rank_pids(out: Path) -> dict[int, int]:
    return {r: json.loads(heartbeat_path(out / ".shardwise", r).read_text())["pid"] for r in range(2)}


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("uninterrupted")
    rc, log = finish(start(out))
    assert rc == 0, log[-3000:]
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    return weights(out)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sigkill_of_a_random_rank_then_resume_latest(tmp_path, uninterrupted):
    rng = random.Random()
    rank, step = rng.randrange(2), rng.randrange(5, STEPS - 3)
    print(f"killing rank {rank} after step {step}")
    p = start(tmp_path)
    wait_for_step(tmp_path, step, p)
    pids = rank_pids(tmp_path)
    os.kill(pids[rank], signal.SIGKILL)
    rc, log = finish(p)
    assert rc == 128 + signal.SIGKILL, log[-3000:]
    assert f"rank {rank} (pid {pids[rank]}) was killed by signal SIGKILL" in log
    assert not any(_alive(pid) for pid in pids.values())
    assert not (tmp_path / "model").exists()  # nothing exported from a dead run
    rc, log = finish(start(tmp_path, "--resume", "latest"))
    assert rc == 0, log[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and 0 < summary["start_step"] <= step
    assert_same(weights(tmp_path), uninterrupted)


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_checkpoints_every_rank_and_exits_75(tmp_path, uninterrupted, target):
    """SIGTERM to the launcher (scancel, Kubernetes) or to one rank only: the job stops as one."""
    p = start(tmp_path)
    wait_for_step(tmp_path, 6, p)
    pids = rank_pids(tmp_path)
    os.kill(p.pid if target == "launcher" else pids[1], signal.SIGTERM)
    rc, log = finish(p)
    assert rc == ExitCode.INTERRUPTED, log[-3000:]
    assert not _alive(p.pid) and not any(_alive(pid) for pid in pids.values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["reason"]
    stopped_at = summary["start_step"] + summary["steps"]
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == f"step-{stopped_at:08d}" and (ckpt / "manifest.json").is_file()
    assert stopped_at < STEPS and not (tmp_path / "model").exists()
    rc, log = finish(start(tmp_path, "--resume", "latest"))
    assert rc == 0, log[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == stopped_at
    assert_same(weights(tmp_path), uninterrupted)


def test_a_stopped_rank_fails_the_job_naming_it(tmp_path):
    p = start(tmp_path, "--set", "run.timeout_s=6", steps=400)
    wait_for_step(tmp_path, 3, p)
    pids = rank_pids(tmp_path)
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        rc, log = finish(p, timeout=90)
    finally:
        for pid in pids.values():  # never leave a stopped process behind, even on failure
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    waited = time.monotonic() - t0
    assert rc == ExitCode.HUNG, log[-3000:]
    assert f"rank 1 (pid {pids[1]})" in log and "stopped" in log, log[-3000:]
    assert waited < 6 + 20, f"took {waited:.0f}s to notice a stopped rank with run.timeout_s=6"
    assert not any(_alive(pid) for pid in pids.values())


def test_nan_loss_stops_the_run_and_exports_nothing(tmp_path):
    rc, log = finish(start(tmp_path, "--set", "optimizer.lr=1e6", "--set", "optimizer.max_grad_norm=0"))
    assert rc == ExitCode.NONFINITE, log[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "non-finite" in summary["reason"]
    assert not (tmp_path / "model").exists()
    for d in (tmp_path / "checkpoints").glob("step-*"):  # any checkpoint holds finite weights
        from shardwise.train.checkpoint.sharded import read_tensors

        assert all(bool(torch.isfinite(t).all()) for t in read_tensors(d).values()), d


SLOW_SAVE = HERE / "fault_workers" / "slow_save.py"


def test_sigkill_during_a_save_never_uses_the_partial_checkpoint(tmp_path):
    from shardwise.train.checkpoint.directory import checkpoints_dir
    from shardwise.train.checkpoint.sharded import read_tensors, resolve_resume
    from shardwise.train.outputs import clean_stale_outputs

    p = subprocess.Popen([sys.executable, str(SLOW_SAVE), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    tmp = checkpoints_dir(tmp_path) / ".tmp-step-00000002"
    deadline = time.monotonic() + 120
    while not any(tmp.glob("__0_*.distcp")):  # the second save is writing its shards
        assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.stdout else ""
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert tmp.is_dir() and not (tmp / "manifest.json").exists()
    assert not (checkpoints_dir(tmp_path) / "step-00000002").exists()
    latest = resolve_resume("latest", tmp_path)
    assert latest is not None and latest.name == "step-00000001"
    assert torch.equal(read_tensors(latest)["model.w"], torch.full((4,), 1.0))
    assert clean_stale_outputs(tmp_path) == [tmp.name] and not tmp.exists()


@pytest.mark.parametrize("left", ["empty", "published-unmarked"])
def test_a_save_killed_at_its_first_or_last_instant_does_not_block_the_next_save_of_that_step(tmp_path, left):
    """A kill between the temp directory's mkdir and its marker leaves an empty `.tmp-step-N`
    that start-up clean-up cannot call ours; the resumed run's save of step N must still publish
    (CI once failed `--resume latest` with FileExistsError on `.tmp-step-00000008`). A kill
    between publish's rename and the marker's removal leaves a stray marker in the published
    step, which must load and be counted as a checkpoint."""
    from shardwise.train.checkpoint.directory import checkpoints_dir
    from shardwise.train.outputs import TMP_MARKER

    rc, log = finish(start(tmp_path, steps=4))
    assert rc == 0, log[-3000:]
    root = checkpoints_dir(tmp_path)
    if left == "empty":
        (root / ".tmp-step-00000008").mkdir()
    else:
        (root / "step-00000004" / TMP_MARKER).touch()
    rc, log = finish(start(tmp_path, "--resume", "latest", steps=8))
    assert rc == 0, log[-3000:]
    assert "resumed after step 4" in log
    assert (root / "step-00000008" / "manifest.json").is_file() and not (root / ".tmp-step-00000008").exists()
