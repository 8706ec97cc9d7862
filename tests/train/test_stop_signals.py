"""Stop signals and summary.json without torch ( the 2-rank runs of
`shardwise train` are in test_stop_signals_e2e.py).

- a stop that reaches a rank while it starts (before the trainer's StopRequest exists, even
  between fork and exec) is kept, not fatal, when the launcher holds the signals;
- SIGHUP stops a rank like SIGTERM, unless it was ignored at start (nohup): then the launcher
  neither forwards nor handles it and the ranks inherit the ignore;
- a rank stopping on a peer's vote names the peer's signal;
- summary.json: atomic, `running` replaced by `failed` only while it is this run's marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardwise.errors import ExitCode
from shardwise.train.launch.watchdog import proc_state
from shardwise.train.observe.metrics import read_summary, run_ended, run_started, write_summary

WORKERS = Path(__file__).parent / "fault_workers"
STOP_WORKER = WORKERS / "stop_worker.py"
LAUNCHER = WORKERS / "hold_launcher.py"


def wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


def children(pid: int) -> list[int]:
    """Live child pids of `pid`, from /proc (field 4 of /proc/<pid>/stat is the parent)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 1 :].split()
        if len(rest) > 1 and int(rest[1]) == pid and rest[0] not in ("Z", "X"):
            found.append(int(d.name))
    return found


class Launcher:
    def __init__(
        self,
        out: Path,
        *,
        hold: bool = True,
        start_s: float = 1.0,
        live_s: float = 30.0,
        ignore_hup: bool = False,
    ):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            str(LAUNCHER),
            "--out",
            str(out),
            *([] if hold else ["--no-hold"]),
            "--",
            str(STOP_WORKER),
            "--out",
            str(out),
            f"--start-s={start_s}",
            f"--live-s={live_s}",
        ]
        preexec = (lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None
        with open(out / "launcher.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec)

    def log(self) -> str:
        return (self.out / "launcher.log").read_text(errors="replace")

    def started(self, timeout_s: float = 30) -> None:
        assert wait_until(lambda: (self.out / "started").exists() or self.proc.poll() is not None, timeout_s)
        assert self.proc.poll() is None, self.log()

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running after {timeout_s} s:\n{self.log()}")

    def got(self, name: str) -> set[int]:
        return {int(f.name.rsplit("-", 1)[1]) for f in self.out.glob(f"got-{name}-*")}

    def pids(self) -> list[int]:
        return [int(f.read_text()) for f in self.out.glob("pid-*")]

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids():
            if proc_state(pid) not in (None, "Z", "X"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


@pytest.fixture
def launcher(tmp_path):
    made: list[Launcher] = []

    def start(**kw) -> Launcher:
        made.append(Launcher(tmp_path / f"job{len(made)}", **kw))
        return made[-1]

    yield start
    for job in made:
        job.cleanup()


@pytest.mark.parametrize("hold", [True, False], ids=["held", "not-held"])
def test_sigterm_to_the_launcher_while_ranks_start(launcher, hold):
    """Forwarded the moment the ranks are forked, before any of their code runs: held, every
    rank keeps it and stops as promised (75); not held, they die of it (143) and the launcher
    promises no checkpoint."""
    job = launcher(hold=hold)
    job.started()
    job.proc.send_signal(signal.SIGTERM)
    rc = job.wait()
    if hold:
        assert rc == ExitCode.INTERRUPTED, job.log()
        assert job.got("SIGTERM") == {0, 1}, job.log()
        assert (
            "each saves a checkpoint at its next step boundary (the first, if it is still starting)"
            in job.log()
        )
    else:
        assert rc == 128 + signal.SIGTERM, job.log()
        assert "SIGTERM: forwarded to 2 rank(s)" in job.log() and "checkpoint" not in job.log()


def test_sigterm_to_a_rank_between_fork_and_its_handlers_is_kept(launcher):
    """Straight to each rank as soon as it exists as a process (a fork of the launcher, not yet
    exec'd, or a Python still starting): the signals the launcher blocked across fork and exec
    stay pending until the rank's entry point has its recorder."""
    job = launcher(start_s=0.5)
    signalled: set[int] = set()

    def signal_new() -> bool:
        for pid in children(job.proc.pid):
            if pid not in signalled:
                os.kill(pid, signal.SIGTERM)
                signalled.add(pid)
        return len(signalled) == 2 or job.proc.poll() is not None

    assert wait_until(signal_new, 30), job.log()
    assert job.wait() == ExitCode.INTERRUPTED, job.log()
    assert job.got("SIGTERM") == {0, 1}, job.log()


def test_sighup_stops_ranks_like_sigterm(launcher):
    job = launcher(start_s=0.0)
    job.started()
    assert wait_until(lambda: len(job.pids()) == 2, 30), job.log()
    job.proc.send_signal(signal.SIGHUP)
    assert job.wait() == ExitCode.INTERRUPTED, job.log()
    assert job.got("SIGHUP") == {0, 1}


def test_sighup_ignored_at_start_stays_ignored_in_launcher_and_ranks(launcher):
    """nohup: the launcher installs no SIGHUP handler (so it does not die of it or forward it)
    and the ranks inherit the ignore, which their StopRequest leaves alone."""
    job = launcher(start_s=0.0, live_s=3.0, ignore_hup=True)
    job.started()
    assert wait_until(lambda: len(list(job.out.glob("hup-*"))) == 2, 30), job.log()
    assert {f.read_text() for f in job.out.glob("hup-*")} == {"ignored"}
    time.sleep(0.3)  # both inside their StopRequest
    job.proc.send_signal(signal.SIGHUP)
    for pid in job.pids():
        os.kill(pid, signal.SIGHUP)
    assert job.wait() == 0, job.log()  # the ranks lived their 3 s and finished
    assert not job.got("SIGHUP") and "SIGHUP" not in job.log()


def run_py(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, **kw)  # fmt: skip


def test_stop_request_handles_sighup_unless_ignored():
    code = """
        import os, signal
        from shardwise.train.launch.signals import StopRequest
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            print(stop.requested, stop.signum == signal.SIGHUP, signal.getsignal(signal.SIGHUP) != signal.SIG_IGN)
        print(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)
    """
    r = run_py(code)
    assert r.returncode == 0 and r.stdout.split("\n")[0] == "True True True", r.stdout + r.stderr
    r = run_py(code, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    lines = r.stdout.split("\n")
    assert r.returncode == 0 and lines[0] == "False False False", r.stdout + r.stderr
    assert lines[1] == "True"  # and it is still ignored after training


def test_a_stop_received_before_training_is_taken_over_and_named():
    r = run_py("""
        import os, signal
        from shardwise.train.launch.signals import StopRequest, hold_at_start
        hold_at_start()
        os.kill(os.getpid(), signal.SIGUSR1)  # while "starting": recorded, not fatal
        with StopRequest() as stop:
            print(stop.requested, signal.Signals(stop.signum).name)
    """)
    assert r.returncode == 0 and r.stdout.strip() == "True SIGUSR1", r.stdout + r.stderr
    assert "SIGUSR1 received while starting: kept" in r.stderr


def test_a_rank_stopping_on_a_peers_vote_names_the_peers_signal(tmp_path):
    """Rank 1 received SIGUSR1 and published it; rank 0, which received nothing, names it
    (Interrupted's message, which rank 0 writes into summary.json)."""
    run_dir = tmp_path / "run"
    r1 = run_py(f"""
        import os, signal
        from shardwise.train.launch.signals import StopRequest, share
        share({str(run_dir)!r}, 1, 2)
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            print(stop.requested)
    """)
    assert r1.stdout.strip() == "True", r1.stderr
    r0 = run_py(f"""
        from shardwise.train.loop import Interrupted
        from shardwise.train.launch.signals import StopRequest, share
        share({str(run_dir)!r}, 0, 2)
        with StopRequest() as stop:
            import signal
            print(stop.requested, signal.Signals(stop.signum).name)
            print(Interrupted(stop.signum, 6, None))
    """)
    lines = r0.stdout.splitlines()
    assert lines[0] == "False SIGUSR1", r0.stdout + r0.stderr
    assert lines[1].startswith("stopped by SIGUSR1 (sent to rank 1) after step 6"), lines
    # No peer published (another host, no shared dir): no signal is made up.
    r = run_py(f"""
        from shardwise.train.loop import Interrupted
        from shardwise.train.launch.signals import StopRequest, share
        share({str(tmp_path / "elsewhere")!r}, 0, 2)
        import signal
        with StopRequest() as stop:
            print(stop.signum, Interrupted(signal.SIGTERM, 3, None))
    """)
    assert r.stdout.startswith("None stopped by a stop request of another rank"), r.stdout + r.stderr


def test_write_summary_is_atomic_with_a_tmp_name_cleanup_knows(tmp_path, monkeypatch):
    from shardwise.train import outputs

    write_summary(tmp_path, {"status": "completed"})
    assert read_summary(tmp_path) == {"status": "completed"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shardwise", "summary.json"]  # and its record
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(Path(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_summary(tmp_path, {"status": "running"})
    assert seen[0].name.startswith(outputs.TMP_PREFIX) and outputs.is_own_tmp(seen[0])


def test_run_ended_replaces_only_this_runs_running_marker(tmp_path):
    write_summary(tmp_path, {"status": "completed", "reason": None})  # an earlier run's
    run = run_started(tmp_path, tmp_path / "cfg.yaml", 2)
    s = read_summary(tmp_path)
    assert s["status"] == "running" and s["run"] == run and run["pid"] == os.getpid()
    assert run["config"] == str((tmp_path / "cfg.yaml").resolve()) and run["world_size"] == 2
    assert not run_ended(tmp_path, {}, "no marker: nothing to settle")
    assert not run_ended(tmp_path, dict(run, started="earlier"), "another run's marker")
    assert read_summary(tmp_path)["status"] == "running"
    assert run_ended(tmp_path, run, "rank 0 (pid 1) exited with code 4 (HUNG)", exit_code=4, failed_rank=0,
                     heartbeats=None)  # fmt: skip
    s = read_summary(tmp_path)
    assert s == {"status": "failed", "reason": "rank 0 (pid 1) exited with code 4 (HUNG)", "run": run,
                 "exit_code": 4, "failed_rank": 0}  # fmt: skip
    # What rank 0 wrote in this run is the truth: never replaced.
    write_summary(tmp_path, {"status": "interrupted", "reason": "stopped by SIGTERM", "run": run})
    assert not run_ended(tmp_path, run, "the launcher's guess")
    assert read_summary(tmp_path)["status"] == "interrupted"
    assert json.loads((tmp_path / "summary.json").read_text())["reason"] == "stopped by SIGTERM"
