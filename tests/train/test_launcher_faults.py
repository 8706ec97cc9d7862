"""A job fails or stops as one, says which rank did it, and leaves no process behind.

Real processes and real signals throughout: the launcher runs in a subprocess of its own
(fault_workers/run_launcher.py) so it can be signalled or SIGKILLed, and its ranks are tiny
scripts (fault_workers/sleeper.py, no torch) except for the hang test, which needs two gloo
ranks blocked in a collective. Every process a test starts is SIGKILLed at teardown if it
is somehow still there, so a failing test cannot leak ranks into the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardwise.errors import ExitCode, ShardwiseError
from shardwise.train.launch.spawn import spawn
from shardwise.train.launch.watchdog import Watchdog, describe_peers, heartbeat_path, proc_state

WORKERS = Path(__file__).parent / "fault_workers"
SLEEPER = WORKERS / "sleeper.py"
GRACE_S = 2.0


def alive(pid: int) -> bool:
    """True while `pid` is one of this test's processes and has not exited (a zombie that
    nobody reaps, e.g. under a container's PID 1, counts as gone)."""
    if proc_state(pid) in (None, "Z", "X"):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"fault_workers" in cmdline or b"time.sleep(600)" in cmdline


def wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


class Job:
    """One launcher subprocess; its stdout/stderr go to files (a pipe would stay open as long
    as any rank lived, and a test waiting on it would hang instead of failing)."""

    def __init__(self, out: Path, worker: Path, worker_args: list[str], nproc: int, **launcher: object):
        self.out, self.nproc = out, nproc
        self.log = out / "launcher.log"
        args = [f"--{k.replace('_', '-')}={v}" for k, v in launcher.items()]
        cmd = [sys.executable, str(WORKERS / "run_launcher.py"), f"--nproc={nproc}", f"--grace-s={GRACE_S}",
               *args, "--", str(worker), *worker_args]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out)
        self.started = time.monotonic()

    def pids(self, prefix: str = "pid") -> dict[int, int]:
        found = {}
        for f in self.out.glob(f"{prefix}-*"):
            try:
                found[int(f.name.rsplit("-", 1)[1])] = int(f.read_text())
            except ValueError:
                pass
        return found

    def wait_for_ranks(self, timeout_s: float = 30.0) -> dict[int, int]:
        if not wait_until(lambda: len(self.pids()) == self.nproc or self.proc.poll() is not None, timeout_s):
            pytest.fail(f"ranks did not start within {timeout_s} s:\n{self.stderr()}")
        assert len(self.pids()) == self.nproc, f"launcher exited early:\n{self.stderr()}"
        return self.pids()

    def wait(self, timeout_s: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running after {timeout_s} s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def got(self, signame: str) -> set[int]:
        return {int(f.name.rsplit("-", 1)[1]) for f in self.out.glob(f"got-{signame}-*")}

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in [*self.pids().values(), *self.pids("grandchild").values()]:
            if alive(pid):
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass


@pytest.fixture
def launch(tmp_path):
    jobs: list[Job] = []

    def start(worker_args: list[str], nproc: int = 2, worker: Path = SLEEPER, **launcher: object) -> Job:
        out = tmp_path / f"job{len(jobs)}"
        out.mkdir()
        if worker == SLEEPER:
            worker_args = ["--out", str(out), *worker_args]
        jobs.append(Job(out, worker, worker_args, nproc, **launcher))
        return jobs[-1]

    yield start
    for job in jobs:
        job.cleanup()


def assert_all_gone(job: Job, timeout_s: float = 5.0) -> None:
    pids = [*job.pids().values(), *job.pids("grandchild").values()]
    assert pids, "the workers wrote no pid files"
    assert wait_until(lambda: not any(alive(p) for p in pids), timeout_s), (
        f"still running: {[p for p in pids if alive(p)]}\n{job.stderr()}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP],
                         ids=lambda s: s.name)
def test_interrupt_reaches_every_rank_and_the_job_exits_75(launch, sig):
    job = launch([])
    job.wait_for_ranks()
    job.proc.send_signal(sig)
    rc = job.wait()
    assert rc == ExitCode.INTERRUPTED, job.stderr()
    assert job.got(sig.name) == {0, 1}
    assert f"{sig.name}: forwarded to 2 rank(s)" in job.stderr()
    assert_all_gone(job, timeout_s=0.5)  # the launcher returned only after its ranks exited


def test_second_sigint_or_sigterm_kills_the_ranks_now(launch):
    job = launch(["--ignore-signals", "--grandchild"])  # a checkpoint that never finishes
    job.wait_for_ranks()
    job.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: job.got("SIGTERM") == {0, 1}, 10)
    time.sleep(0.3)
    assert job.proc.poll() is None, "the launcher must keep waiting for ranks saving a checkpoint"
    job.proc.send_signal(signal.SIGINT)
    assert job.wait() == 128 + signal.SIGINT, job.stderr()
    assert "second SIGINT: killing 2 rank(s) now" in job.stderr()
    assert_all_gone(job)  # ranks and the processes they started


def test_sigkilled_launcher_takes_its_ranks_along(launch):
    job = launch([])
    pids = job.wait_for_ranks()
    job.proc.kill()
    job.proc.wait()
    assert wait_until(lambda: not any(alive(p) for p in pids.values()), 5), "orphaned ranks survived"


def test_rank_killed_by_a_signal_is_named_and_its_peer_stopped(launch):
    job = launch(["--fail-rank=1", "--fail-how=SIGKILL"])
    pids = job.wait_for_ranks()
    rc = job.wait()
    assert rc == 128 + signal.SIGKILL, job.stderr()
    assert f"shardwise: rank 1 (pid {pids[1]}) was killed by signal SIGKILL" in job.stderr()
    assert job.got("SIGTERM") == {0}  # asked politely first
    assert_all_gone(job)


def test_rank_exit_code_is_named_and_a_peer_ignoring_sigterm_is_killed(launch):
    job = launch(["--fail-rank=1", "--fail-how=3", "--ignore-signals", "--grandchild"])
    pids = job.wait_for_ranks()
    rc = job.wait()
    assert rc == ExitCode.NONFINITE, job.stderr()
    assert f"shardwise: rank 1 (pid {pids[1]}) exited with code 3 (NONFINITE: " in job.stderr()
    assert job.got("SIGTERM") == {0}
    assert_all_gone(job)  # rank 0 ignored SIGTERM: SIGKILLed after the grace, with its child


def test_a_shared_decision_that_rank_0_reaches_while_being_stopped_still_exits_with_its_code(launch):
    # Rank 1 runs out of disk first; rank 0 reaches the same decision (exit 74) only as the
    # launcher is already ending it. The job is that shared failure, not a crash of the launcher.
    job = launch(["--fail-rank=1", f"--fail-how={int(ExitCode.NO_SPACE)}", f"--exit-on-term={int(ExitCode.NO_SPACE)}"])
    job.wait_for_ranks()
    rc = job.wait()
    err = job.stderr()
    assert rc == ExitCode.NO_SPACE, err
    assert "Traceback" not in err, err
    assert_all_gone(job)


def test_stopped_rank_is_named_and_cannot_outlive_the_job(launch):
    job = launch(["--fail-rank=1", "--fail-how=SIGSTOP"], timeout_s=4)
    pids = job.wait_for_ranks()
    rc = job.wait()
    assert rc == 124, job.stderr()
    err = job.stderr()
    assert f"rank 1 (pid {pids[1]}) is stopped (state T)" in err
    assert "ran past its 4 s limit" in err
    assert_all_gone(job)


def test_hung_collective_names_the_stopped_rank_and_the_phase(launch, tmp_path):
    timeout_s = 5.0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = launch(["--run-dir", str(run_dir), f"--timeout-s={timeout_s}"], worker=WORKERS / "hang_worker.py",
                 run_dir=run_dir)
    job.out = run_dir  # the hang worker writes its pid files there
    pids = job.wait_for_ranks(60)
    joined = time.monotonic()
    rc = job.wait(60)
    elapsed = time.monotonic() - joined
    err = job.stderr()
    assert rc == ExitCode.HUNG, err
    assert "shardwise: rank 0 made no progress for" in err
    assert "in 'all_reduce(step counts)' at step 3" in err
    assert f"rank 1 (pid {pids[1]}) last heartbeat" in err
    assert "at step 3 in 'forward_backward' — not responding (stopped)" in err
    # the launcher names the rank that stalled first, then the one whose watchdog gave up
    assert (f"shardwise: rank 1 (pid {pids[1]}) made no progress (stopped, state T); rank 0 (pid {pids[0]}) "
            "exited with code 4 (HUNG: ") in err, err
    assert f"rank 1 (pid {pids[1]}) is stopped (state T)" in err
    # The watchdog, not gloo's timeout (timeout_s + 30), ended it; the stopped rank needed no grace.
    assert elapsed < timeout_s + 6, (elapsed, err)
    assert_all_gone(job)


def test_nproc_below_one_is_a_user_error():
    with pytest.raises(ShardwiseError, match="at least 1"):
        spawn([str(SLEEPER)], 0)


def test_signal_handlers_are_restored(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)}
    assert spawn([str(SLEEPER), "--out", str(tmp_path), "--live-s=0"], 1) == 0
    assert {s: signal.getsignal(s) for s in before} == before


def test_watchdog_heartbeat_and_peer_report(tmp_path):
    """Heartbeat files as peers see them: fresh, finished, missing, and a stopped local process."""
    with Watchdog(tmp_path, rank=0, world_size=4, timeout_s=60, interval_s=0.1) as wd:
        wd.phase("optimizer step", 7)
        assert wait_until(lambda: json.loads(heartbeat_path(tmp_path, 0).read_text())["step"] == 7, 5)
        beat = json.loads(heartbeat_path(tmp_path, 0).read_text())
        assert beat["pid"] == os.getpid() and beat["phase"] == "optimizer step" and not beat["done"]
    assert json.loads(heartbeat_path(tmp_path, 0).read_text())["done"]

    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        assert wait_until(lambda: proc_state(stopped.pid) == "T", 5)
        beat = dict(beat, rank=1, pid=stopped.pid, done=False, step=3, phase="forward_backward")
        beat["time"] = beat["phase_since"] = time.time() - 21
        heartbeat_path(tmp_path, 1).write_text(json.dumps(beat))
        text = describe_peers(tmp_path, 3, exclude_rank=None)
    finally:
        stopped.kill()
        stopped.wait()
    assert "rank 0 (pid" in text and "has left the job (finished or failed at step 7 in 'optimizer step'" in text
    assert f"rank 1 (pid {stopped.pid}) last heartbeat 21 s ago at step 3 in 'forward_backward'" in text
    assert "not responding (stopped)" in text
    assert "rank 2: no heartbeat" in text
    assert describe_peers(tmp_path, 3, exclude_rank=1).count("rank 1") == 0
