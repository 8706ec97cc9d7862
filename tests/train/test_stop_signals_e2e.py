"""`shardwise train` on 2 gloo ranks (CPU), real signals: what a closed SSH session, nohup, a
stop during start-up and SIGUSR1 do, and what summary.json says.

- SIGHUP to the launcher: a checkpoint, exit 75, the summary names SIGHUP;
- SIGHUP ignored at start (nohup), then SIGHUP to the launcher and to a rank: the run completes;
- SIGTERM the moment the ranks start: the launcher's promise (a checkpoint, 75) is kept;
- SIGUSR1 to one rank: the summary rank 0 writes names SIGUSR1;
- summary.json says `running` while the run trains (with who started it), `failed` with the
  reason when rank 0 is killed while starting or a rank hangs (exit 4: naming the rank that
  stalled, not the one whose watchdog noticed), never an earlier run's `completed`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults_e2e import CONFIG, _alive, finish, rank_pids, wait_for_step
from test_stop_signals import children, wait_until

from shardwise.errors import ExitCode
from shardwise.train.launch.watchdog import heartbeat_path

pytestmark = pytest.mark.distributed


def start(out: Path, *extra: str, steps: int = 12, ignore_hup: bool = False, config: Path = CONFIG) -> subprocess.Popen:
    sets = [f"checkpointing.output_dir={out}", f"run.steps={steps}", "checkpointing.save_every_steps=4",
            "logging.progress=false", "logging.trackers=[]", "run.timeout_s=20"]  # fmt: skip
    argv = [sys.executable, "-m", "shardwise.train.cli", str(config), "--nproc", "2"]
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    preexec = (lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None  # nohup
    return subprocess.Popen([*argv, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec)  # fmt: skip


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def wait_running(out: Path, p: subprocess.Popen, timeout: float = 120) -> dict:
    """Until the launcher has written this run's `running` summary (its handlers are in place
    and the ranks are about to be forked)."""

    def marked() -> bool:
        try:
            return summary(out)["run"]["pid"] == p.pid
        except (OSError, ValueError, KeyError, TypeError):
            return p.poll() is not None

    assert wait_until(marked, timeout), "no running summary"
    assert p.poll() is None, p.stdout.read()[-3000:]
    return summary(out)


def rank_of(pid: int) -> int | None:
    """The rank a process of the job is, by the name ranks give themselves (shardwise-r<N>)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return int(name[len("shardwise-r"):]) if name.startswith("shardwise-r") and name[11:].isdigit() else None


def an_earlier_completed_run(out: Path) -> None:
    """Its summary, written (and recorded as shardwise's) as a run writes it: a fresh run may replace it."""
    from shardwise.train.observe.metrics import write_summary

    write_summary(out, {"status": "completed", "reason": None, "steps": 12})


def assert_interrupted_by(out: Path, name: str, rc: int, log: str) -> dict:
    assert rc == ExitCode.INTERRUPTED, log[-3000:]
    s = summary(out)
    assert s["status"] == "interrupted" and f"stopped by {name}" in s["reason"], s
    ckpt = Path(s["checkpoint"])
    assert ckpt.name == f"step-{s['start_step'] + s['steps']:08d}" and (ckpt / "manifest.json").is_file()
    return s


def test_sighup_to_the_launcher_checkpoints_and_exits_75(tmp_path):
    """A closed SSH session: the launcher gets SIGHUP and forwards it; the ranks handle it."""
    p = start(tmp_path, steps=400)
    wait_for_step(tmp_path, 2, p)
    pids = rank_pids(tmp_path)
    p.send_signal(signal.SIGHUP)
    rc, log = finish(p)
    assert "SIGHUP: forwarded to 2 rank(s)" in log
    assert_interrupted_by(tmp_path, "SIGHUP", rc, log)
    assert not any(_alive(pid) for pid in pids.values())


def test_sighup_ignored_at_start_is_ignored_by_launcher_and_ranks(tmp_path):
    """nohup shardwise train ...: SIGHUP was SIG_IGN at start; a hang-up to the launcher and
    one to a rank change nothing and the run completes."""
    p = start(tmp_path, steps=12, ignore_hup=True)
    wait_for_step(tmp_path, 2, p)
    pids = rank_pids(tmp_path)
    p.send_signal(signal.SIGHUP)
    os.kill(pids[1], signal.SIGHUP)
    rc, log = finish(p)
    assert rc == 0, log[-3000:]
    assert "SIGHUP" not in log
    assert summary(tmp_path)["status"] == "completed" and summary(tmp_path)["steps"] == 12


def test_sigterm_as_the_ranks_start_keeps_the_launchers_promise(tmp_path):
    """SIGTERM while the ranks are being forked (their handlers cannot exist yet): the launcher
    says they checkpoint at their next step boundary and exit 75, and they do, at step 1."""
    p = start(tmp_path, steps=400)
    wait_running(tmp_path, p)
    p.send_signal(signal.SIGTERM)
    rc, log = finish(p)
    assert "SIGTERM: forwarded to" in log and "exits with code 75" in log, log[-3000:]
    s = assert_interrupted_by(tmp_path, "SIGTERM", rc, log)
    assert s["start_step"] == 0 and s["steps"] == 1
    assert "received while starting: kept" in log


def test_sigusr1_to_one_rank_is_named_in_the_summary(tmp_path):
    """Only rank 1 gets SIGUSR1; rank 0 stops on its vote and writes the summary naming it."""
    p = start(tmp_path, steps=400)
    wait_for_step(tmp_path, 2, p)
    os.kill(rank_pids(tmp_path)[1], signal.SIGUSR1)
    rc, log = finish(p)
    s = assert_interrupted_by(tmp_path, "SIGUSR1", rc, log)
    assert "SIGTERM" not in s["reason"] and "(sent to rank 1)" in s["reason"]


def test_summary_says_running_while_the_run_trains(tmp_path):
    an_earlier_completed_run(tmp_path)
    p = start(tmp_path, steps=8)
    wait_for_step(tmp_path, 2, p)
    s = summary(tmp_path)
    assert s["status"] == "running" and s["reason"] is None, s
    assert (
        s["run"]["pid"] == p.pid
        and s["run"]["config"] == str(CONFIG.resolve())
        and s["run"]["world_size"] == 2
    )
    rc, log = finish(p)
    assert rc == 0, log[-3000:]
    done = summary(tmp_path)
    assert done["status"] == "completed" and done["run"] == s["run"]


def test_rank_0_killed_while_starting_leaves_failed_not_an_earlier_completed(tmp_path):
    an_earlier_completed_run(tmp_path)
    p = start(tmp_path, steps=400)
    wait_running(tmp_path, p)
    rank0: list[int] = []

    def found() -> bool:
        rank0[:] = [pid for pid in children(p.pid) if rank_of(pid) == 0]
        return bool(rank0) or p.poll() is not None

    assert wait_until(found, 60) and rank0, "rank 0 never started"
    os.kill(rank0[0], signal.SIGKILL)
    rc, log = finish(p)
    assert rc == 128 + signal.SIGKILL, log[-3000:]
    s = summary(tmp_path)
    assert s["status"] == "failed", s
    assert f"rank 0 (pid {rank0[0]}) was killed by signal SIGKILL" in s["reason"]
    assert s["failed_rank"] == 0 and s["exit_code"] == 128 + signal.SIGKILL and s["run"]["pid"] == p.pid


def test_a_hang_leaves_failed_with_the_watchdogs_reason(tmp_path):
    """Rank 1 stops before it joins the process group; rank 0's watchdog gives up after
    run.timeout_s (exit 4) and cannot write a summary: the launcher writes `failed`."""
    an_earlier_completed_run(tmp_path)
    p = start(tmp_path, "--set", "run.timeout_s=4", steps=400)
    beat = heartbeat_path(tmp_path / ".shardwise", 1)
    assert wait_until(lambda: beat.is_file() or p.poll() is not None, 120), "rank 1 never started"
    pid1 = json.loads(beat.read_text())["pid"]
    os.kill(pid1, signal.SIGSTOP)
    try:
        rc, log = finish(p, timeout=90)
    finally:
        if _alive(pid1):
            os.kill(pid1, signal.SIGKILL)
    assert rc == ExitCode.HUNG, log[-3000:]
    s = summary(tmp_path)
    assert s["status"] == "failed" and s["exit_code"] == ExitCode.HUNG, s
    # the rank that made no progress, not rank 0 whose watchdog noticed it
    assert s["failed_rank"] == 1 and f"rank 1 (pid {pid1}) made no progress (stopped" in s["reason"], s
    assert "rank 0" in s["reason"] and "exited with code 4 (HUNG" in s["reason"], s
    assert f"rank 1 (pid {pid1})" in s["heartbeats"] and "stopped" in s["heartbeats"], s


@pytest.fixture(autouse=True)
def _no_leftovers():
    before = set(children(os.getpid()))
    yield
    for pid in set(children(os.getpid())) - before:  # a failed test's launcher: never leave it running
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
