"""spawn: `--nproc` local ranks that are never orphaned, interrupted together and reported by name.

A spawned job fails or stops as one: the launcher forwards interrupts to every rank, names the
rank that failed (its exit code or signal, or that it is stopped), ends the others and never
leaves a process behind, even when it is itself SIGKILLed. The ranks' side (environment,
process group, exit) is shardwise.train.launch.rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.errors import ExitCode, ShardwiseError
from shardwise.train.launch.rank import free_port

# Seconds a surviving rank gets between SIGTERM and SIGKILL once the job has failed. Its
# peers are gone, so a rank blocked in a collective will not notice SIGTERM: keep it short.
GRACE_S = 5.0
# Forwarded to every rank: each saves a checkpoint at its next step boundary and exits 75. SIGHUP
# is not forwarded (nor handled) when it was ignored at start (`nohup`): the ranks inherit the ignore.
FORWARDED_SIGNALS = tuple(
    s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None), getattr(signal, "SIGHUP", None))
    if s is not None
)
# A second one of these means "now": the ranks are killed without a checkpoint.
_HARD_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1

_EXIT_MEANING = {
    ExitCode.FAILED: "an unexpected error; its traceback is above",
    ExitCode.USER_ERROR: "a user error; the message is above",
    ExitCode.NONFINITE: "NaN/Inf loss or grad norm beyond run.nonfinite_patience",
    ExitCode.HUNG: "no progress within run.timeout_s; the watchdog's message is above",
    ExitCode.NO_SPACE: "a save, the export or a log ran out of disk space; the previous checkpoint is intact",
    ExitCode.INTERRUPTED: "interrupted; a checkpoint was saved",
}
_SIGNAL_HINT = {
    "SIGKILL": " (out of host memory? `dmesg` shows the OOM killer)",
    "SIGSEGV": " (a crash in native code)",
    "SIGBUS": " (a crash in native code, or /dev/shm is full)",
    "SIGABRT": " (an abort in native code; its message is above)",
}


def _say(msg: str) -> None:
    # os.write, not print: this also runs inside signal handlers, where a buffered write
    # that the handler interrupted would raise "reentrant call".
    try:
        os.write(2, f"shardwise: {msg}\n".encode())
    except OSError:
        pass


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(rank: int, pid: int, returncode: int) -> str:
    """'rank 1 (pid 4242) was killed by signal SIGKILL (...)' / 'rank 0 (pid 4241) exited with
    code 3 (NONFINITE: ...)': Popen's negative return codes are signals."""
    if returncode < 0:
        name = _signame(-returncode)
        return f"rank {rank} (pid {pid}) was killed by signal {name}{_SIGNAL_HINT.get(name, '')}"
    try:
        code = ExitCode(returncode)
        meaning = f" ({code.name}: {_EXIT_MEANING[code]})" if code in _EXIT_MEANING else ""
    except ValueError:
        meaning = ""
    return f"rank {rank} (pid {pid}) exited with code {returncode}{meaning}"


def shell_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _pdeathsig() -> Callable[..., int] | None:
    """libc's prctl, resolved in the launcher: nothing is loaded between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _child_setup(launcher_pid: int) -> Callable[[], None]:
    """Runs in each rank between fork and exec (a forked rank: first thing after the fork).

    Its own session: a terminal's Ctrl-C reaches only the launcher, which forwards it exactly
    once (a rank that got it twice would take the second as "kill now"), and the rank's
    whole process tree (data-loader workers, compile workers) can be killed as one group.
    PR_SET_PDEATHSIG: the kernel SIGKILLs the rank when the launcher dies, even by SIGKILL.
    If the launcher died before prctl ran, the rank already has a new parent: die now.
    """
    prctl = _pdeathsig()

    def setup() -> None:
        os.setsid()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


class ForkedRank:
    """A rank forked from the launcher (spawn_job's `fork_target`), with the part of Popen's
    interface the launcher uses: `pid`, `returncode` (negative: killed by that signal), `poll`,
    `wait`, `send_signal`."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a pid that was reaped, and so may be reused
            os.kill(self.pid, sig)


def _fork_rank(target: Callable[[], int], env: dict[str, str | None], setup: Callable[[], None]) -> ForkedRank:
    """Fork a rank that sets `env` (None: unset), runs `target` and ends by os._exit with its
    code: it never returns into the launcher's frames (their `finally` blocks, the output dir's
    lock, atexit handlers are the launcher's)."""
    from shardwise.train.launch.rank import name_rank, run_rank_script, set_environ

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)

    def rank() -> int:
        setup()
        for sig in FORWARDED_SIGNALS:  # as exec leaves them: the launcher's handlers are not the rank's
            if signal.getsignal(sig) not in (signal.SIG_IGN, signal.SIG_DFL):
                signal.signal(sig, signal.SIG_DFL)
        set_environ(env)
        name_rank(os.environ["RANK"])
        return target()

    run_rank_script(rank)  # os._exit, whatever happens
    os._exit(1)  # unreachable


def _kill_group(p: subprocess.Popen | ForkedRank, sig: int) -> None:
    """`sig` to the rank's session (itself and whatever it started), or to it alone when the
    group is already gone."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        if p.returncode is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def _is_stopped(pid: int) -> bool:
    from shardwise.train.launch.watchdog import proc_state

    return proc_state(pid) == "T"


def _hung_rank(procs: list[subprocess.Popen | ForkedRank], rcs: list[int | None],
               run_dir: Path | str | None) -> tuple[int, str] | None:
    """When a watchdog gave up (exit 4): the rank that made no progress, and how it is known. A
    rank still running that is stopped (state T) first, then one whose heartbeat is stale (it
    cannot even beat: swapping, in uninterruptible I/O); None when neither is seen (the rank whose
    watchdog fired is then the one that stalled: its own phase did not move)."""
    from shardwise.train.launch.watchdog import STALE_S, read_heartbeat

    live = [r for r, rc in enumerate(rcs) if rc is None]
    for r in live:
        if _is_stopped(procs[r].pid):
            return r, "stopped, state T"
    if run_dir is not None:
        import time

        for r in live:
            hb = read_heartbeat(run_dir, r)
            if hb is not None and time.time() - float(hb.get("time", 0.0)) > STALE_S:
                return r, (f"its last heartbeat is {time.time() - float(hb['time']):.0f} s old, at step "
                           f"{hb.get('step')} in {hb.get('phase')!r}")
    return None


def _stop_ranks(procs: list[subprocess.Popen | ForkedRank], grace_s: float) -> None:
    """End every rank still running: SIGCONT first (a stopped process leaves SIGTERM pending
    forever), SIGTERM, then SIGKILL to its whole process group after `grace_s`."""
    import time

    live = [(rank, p) for rank, p in enumerate(procs) if p.poll() is None]
    for rank, p in live:
        if _is_stopped(p.pid):
            _say(f"rank {rank} (pid {p.pid}) is stopped (state T): it could not make progress; ending it")
    for _, p in live:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for _, p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        _kill_group(p, signal.SIGKILL)
    for _, p in live:
        p.wait()


@dataclass
class SpawnResult:
    """How a spawned job ended. `rc` as `spawn` returns it; `reason`: why it failed, as the
    launcher said it (None when every rank exited 0 or 75); `failed_rank`: the rank that failed
    first: the one that died, or, when a watchdog gave up (exit 4), the rank that made no
    progress (stopped, or its heartbeat stale), not the rank that noticed; `signal`: the signal
    that killed `failed_rank` ('SIGKILL'), if one did; `collateral`: how the other ranks that
    failed on their own ended (a peer's death breaks their collectives); `heartbeats`: what the
    ranks' last heartbeats said when it failed (needs run_dir)."""

    rc: int
    reason: str | None = None
    failed_rank: int | None = None
    heartbeats: str | None = None
    signal: str | None = None
    collateral: list[str] = field(default_factory=list)


# Exits every rank takes together, by a decision they reach collectively (the loop's vote on a
# non-finite streak, a save's shared failure, a refusal in every rank): no rank caused the others'.
SHARED_EXITS = (ExitCode.USER_ERROR, ExitCode.NONFINITE, ExitCode.NO_SPACE)


def first_failure(exited: list[tuple[int, int]]) -> int:
    """The rank, of those (rank, returncode) seen failed in one poll, that failed first: a death
    by SIGKILL, then by another signal, then an exit code; the lowest rank among equals. A peer
    of a dead rank fails because of it (a broken collective: an exit code, or an abort) and is
    reaped in the same poll when it went quickly."""
    def order(item: tuple[int, int]) -> tuple[int, int]:
        rank, rc = item
        return (0 if rc == -signal.SIGKILL else 1 if rc < 0 else 2, rank)

    return min(exited, key=order)[0]


def spawn(argv: Sequence[str], nproc: int, timeout_s: float | None = None, extra_env: dict | None = None,
          threads_per_rank: int | None = None, **kw) -> int:
    """`spawn_job(...).rc`: run `python argv...` as `nproc` local ranks and return an exit code."""
    return spawn_job(argv, nproc, timeout_s, extra_env, threads_per_rank, **kw).rc


def spawn_job(
    argv: Sequence[str],
    nproc: int,
    timeout_s: float | None = None,
    extra_env: dict | None = None,
    threads_per_rank: int | None = None,
    *,
    run_dir: Path | str | None = None,
    grace_s: float = GRACE_S,
    hold_signals: bool = False,
    on_start: Callable[[], None] | None = None,
    fork_target: Callable[[], int] | None = None,
) -> SpawnResult:
    """Run `python argv...` as `nproc` local ranks (torchrun's env contract).

    No rank outlives the launcher: each has PR_SET_PDEATHSIG, so even a SIGKILLed launcher
    takes its ranks along. SIGTERM/SIGINT/SIGUSR1/SIGHUP are forwarded to every rank and the
    launcher keeps waiting; a second SIGTERM/SIGINT kills the ranks at once. SIGHUP ignored
    when this is called (`nohup`) stays ignored, here and in the ranks. The handlers are
    installed only when called on the main thread, and the previous ones come back on return.

    `hold_signals`: the ranks are shardwise trainers (each saves a checkpoint at its next step
    boundary and exits 75 on a stop signal). They run `python -m shardwise.train.launch.rank ARGV`,
    whose first act installs the stop handlers (shardwise.train.launch.signals.hold_at_start); the
    forwarded signals stay blocked from fork until then, so a stop that arrives while a rank
    starts is kept and honoured at its first step boundary, never fatal. Without it the ranks
    are any script, and the launcher promises nothing about what they do with a signal.
    `on_start` runs once the launcher's handlers are in place, before the first rank starts.

    `fork_target` (with `hold_signals`): the ranks are forks of this process, each running
    `fork_target()` with its rank's environment and the signal handlers an exec'd rank starts
    with, and exiting with what it returns (argv is then unused). The caller must be fork-safe
    (shardwise.train.launch.fork: no OpenMP pool ever ran, no other thread). Else each rank is
    `python argv`.

    One rank exiting non-zero (other than 75) or dying by a signal fails the job: one line on
    stderr names it, and the others get SIGCONT, SIGTERM and, after `grace_s`, SIGKILL of their
    process groups, so a crash never leaves a hung collective or a stray process.

    `rc` is 0 when all ranks succeed; the first failing rank's code (128 + N for a death by
    signal N; of the ranks found failed in one poll, a death by SIGKILL first: `first_failure`;
    4 when a watchdog gave up, whichever rank it names as stalled); 75 when the ranks were
    interrupted and all exited 0 or 75; 128 + N after a second interrupt N; 124 when `timeout_s` (a wall-clock limit on the whole job, unlike
    run.timeout_s) runs out. `run_dir`, where the ranks' Watchdogs write heartbeats, adds each
    rank's last known step and phase to a failure message (stale heartbeats and stop records
    are cleared first).
    """
    import time

    if nproc < 1:
        raise ShardwiseError(f"--nproc must be at least 1, got {nproc}")
    if run_dir is not None:
        from shardwise.train.launch.signals import STOP_DIR
        from shardwise.train.launch.watchdog import HEARTBEAT_DIR, describe_peers

        for sub in (HEARTBEAT_DIR, STOP_DIR):
            for old in (Path(run_dir) / sub).glob("rank-*.json"):
                old.unlink(missing_ok=True)
    port = free_port()
    procs: list[subprocess.Popen | ForkedRank] = []
    received: list[int] = []
    escalated: list[int] = []
    hard = [0]  # SIGTERM/SIGINT delivered so far
    started = False

    def deliver(signum: int) -> None:
        name = _signame(signum)
        live = [p for p in procs if p.returncode is None]
        hard[0] += signum in _HARD_SIGNALS
        if signum in _HARD_SIGNALS and hard[0] >= 2:
            if not escalated:
                escalated.append(signum)
                _say(f"second {name}: killing {len(live)} rank(s) now, without a checkpoint")
            for p in procs:
                _kill_group(p, signal.SIGKILL)
            return
        for p in live:
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass
        again = f" (send {name} again to kill them now)" if signum in _HARD_SIGNALS else ""
        promise = (f"; each saves a checkpoint at its next step boundary (the first, if it is still starting) and "
                   f"exits with code {int(ExitCode.INTERRUPTED)}, or finishes if it is past its last step"
                   if hold_signals else "")  # fmt: skip
        _say(f"{name}: forwarded to {len(live)} rank(s){promise}{again}")

    def on_signal(signum: int, frame) -> None:
        received.append(signum)
        if started:
            deliver(signum)

    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in FORWARDED_SIGNALS:
            if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # nohup: a hang-up must not reach the ranks, which inherit the ignore
            previous[sig] = signal.signal(sig, on_signal)
    held = hold_signals and hasattr(signal, "pthread_sigmask")
    try:
        if on_start is not None:
            on_start()
        setup = _child_setup(os.getpid())
        cmd = [sys.executable, *(["-m", "shardwise.train.launch.rank"] if hold_signals else []), *argv]
        # Blocked in this thread while it forks: each rank starts with them blocked (the mask
        # survives fork and exec) until its entry point has its handlers; ours run on unblock.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS) if held else None
        if fork_target is not None:
            import gc

            gc.freeze()  # what the launcher built stays out of the ranks' collections (and their copies)
        try:
            for rank in range(nproc):
                env: dict[str, str | None] = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(nproc),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                if threads_per_rank:
                    env["OMP_NUM_THREADS"] = str(threads_per_rank)
                env.update(extra_env or {})
                if fork_target is not None:
                    procs.append(_fork_rank(fork_target, env, setup))
                    continue
                full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
                procs.append(subprocess.Popen(cmd, env=full, preexec_fn=setup))
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        started = True
        for signum in list(received):  # arrived while the ranks were starting
            deliver(signum)

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rcs: list[int | None] = [None] * nproc
        failed: int | None = None
        detector = 0  # the rank whose exit failed the job (`failed` too, unless a watchdog named another)
        reason: str | None = None
        stopped_seen: set[int] = set()
        next_state_check = time.monotonic() + 1.0
        while any(rc is None for rc in rcs):
            exited = []
            for rank, p in enumerate(procs):
                if rcs[rank] is None and (rc := p.poll()) is not None:
                    rcs[rank] = rc
                    if rc not in (0, ExitCode.INTERRUPTED):
                        exited.append((rank, rc))
            if exited and failed is None and not escalated:
                failed = detector = first_failure(exited)
                reason = describe_exit(failed, procs[failed].pid, rcs[failed])
                if rcs[failed] == ExitCode.HUNG:
                    culprit = _hung_rank(procs, rcs, run_dir)
                    if culprit is not None and culprit[0] != failed:
                        reason = (f"rank {culprit[0]} (pid {procs[culprit[0]].pid}) made no progress "
                                  f"({culprit[1]}); {reason}")
                        failed = culprit[0]
                _say(reason)
            if failed is not None:
                break
            if deadline is not None and time.monotonic() > deadline:
                waiting = [f"{r} (pid {procs[r].pid})" for r, rc in enumerate(rcs) if rc is None]
                reason = f"the job ran past its {timeout_s:g} s limit; still running: rank {', '.join(waiting)}"
                _say(reason)
                break
            if time.monotonic() >= next_state_check:
                next_state_check = time.monotonic() + 1.0
                for rank, p in enumerate(procs):
                    if rcs[rank] is None and _is_stopped(p.pid):
                        if rank not in stopped_seen:
                            stopped_seen.add(rank)
                            _say(f"rank {rank} (pid {p.pid}) is stopped (state T); the job cannot progress "
                                 f"until it continues (kill -CONT {p.pid})")
                    else:
                        stopped_seen.discard(rank)
            time.sleep(0.05)

        heartbeats = None
        if any(rc is None for rc in rcs) or failed is not None:
            if run_dir is not None:
                heartbeats = describe_peers(run_dir, nproc)
                _say(f"last heartbeats: {heartbeats}")
            _stop_ranks(procs, grace_s)
        if escalated:
            name = _signame(escalated[0])
            return SpawnResult(128 + escalated[0], f"a second {name}: the ranks were killed without a checkpoint",
                               heartbeats=heartbeats)
        if failed is not None and failed != 0 and rcs[failed] in SHARED_EXITS and procs[0].returncode == rcs[failed]:
            # every rank took the same decision (a non-finite stop, a full disk, a refusal): rank 0's
            # own summary says why; the rank that happened to exit first is no culprit
            failed = detector = 0
            rcs[0] = procs[0].returncode  # rank 0 may have been ended by _stop_ranks after its decision
        if failed is not None:
            code = int(rcs[detector])  # type: ignore[arg-type]  # a hang: 4 (HUNG), whichever rank stalled
            killed = _signame(-code) if detector == failed and code < 0 else None
            collateral = [describe_exit(r, procs[r].pid, rc) for r, rc in enumerate(rcs)
                          if r not in (failed, detector) and rc not in (None, 0, ExitCode.INTERRUPTED)]
            return SpawnResult(shell_code(code), reason, failed, heartbeats, killed, collateral)
        if any(rc is None for rc in rcs):
            return SpawnResult(124, reason, heartbeats=heartbeats)
        return SpawnResult(int(ExitCode.INTERRUPTED) if ExitCode.INTERRUPTED in rcs else 0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Whatever path got here (an exception included), nothing may be left running.
        if any(p.poll() is None for p in procs):
            for p in procs:
                _kill_group(p, signal.SIGKILL)
            for p in procs:
                p.wait()
