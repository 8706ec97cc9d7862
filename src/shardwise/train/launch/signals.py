"""Preemption: SIGTERM (what `scancel`, Kubernetes and torchrun send), SIGUSR1 (SLURM's
`--signal=USR1@120` warning), SIGINT and SIGHUP (a closed SSH session) ask a rank to stop at
the next step boundary. SIGHUP that was ignored when the process started (`nohup`) stays
ignored: installing a handler would undo what nohup asked for.

The handler only records the request. The loop carries it in the step's one host-side
all-reduce, so every rank sees a request made to any rank, all stop after the same optimizer
step, save one checkpoint together and exit with ExitCode.INTERRUPTED (75). A rank never
stops alone mid-collective (that would hang its peers until the watchdog fires).

A request is never lost to start-up: a rank's entry point calls `hold_at_start` before it
imports anything heavy (spawn's ranks run through shardwise.train.launch.rank, which does it first;
the launcher keeps the signals blocked from fork until then), and the StopRequest that training
enters takes over what arrived meanwhile; the loop honours it at its first step boundary.

The vote carries no signal number, so the rank that received the signal publishes it in the run
directory (`<output_dir>/.shardwise/stop/rank-00001.json`, written before its vote is cast) and
a rank that stops on a peer's vote names that signal (`StopRequest.signum`, `describe`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from shardwise import strict_json

STOP_SIGNALS = tuple(
    s
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, getattr(signal, "SIGHUP", None))
    if s is not None
)
# Under the run directory (the watchdog's, shardwise.train.cli._run_dir): one file per rank
# that received a stop signal.
STOP_DIR = "stop"


def stop_signals() -> tuple[int, ...]:
    """The signals taken as a stop request now: STOP_SIGNALS less SIGHUP while it is ignored."""
    hup = getattr(signal, "SIGHUP", None)
    return tuple(s for s in STOP_SIGNALS if not (s == hup and signal.getsignal(s) == signal.SIG_IGN))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(msg: str) -> None:
    # os.write, not print: a handler that interrupted a print to the same stream would raise
    # "reentrant call" inside the training loop.
    try:
        os.write(2, f"shardwise: {msg}\n".encode())
    except OSError:
        pass


# Process-wide state: signal dispositions are per process, and so is what they recorded.
_early: StopRequest | None = None  # installed by hold_at_start, for the life of the process
_active: StopRequest | None = None  # the innermost entered StopRequest
_trained = False  # a StopRequest (training) has been exited: no step boundary comes any more
_share: tuple[Path, int, int] | None = None  # (run_dir, rank, world_size), see `share`
_unpublished: int | None = None  # received before `share` said where to publish it


class StopRequest:
    """Installed for the duration of training on the main thread (a no-op elsewhere).

    `escalate`: a second SIGINT raises KeyboardInterrupt (an interactive single process).
    Ranks started by a launcher do not escalate: the launcher forwards a terminal's Ctrl-C
    on top of the one the terminal already sent, and escalates itself on the next one.
    """

    def __init__(self, escalate: bool | None = None):
        self.escalate = escalate if escalate is not None else "SHARDWISE_LAUNCHED" not in os.environ
        self._signum: int | None = None
        self._previous: dict[int, object] = {}
        self._outer: StopRequest | None = None

    @property
    def requested(self) -> bool:
        """This process received a stop signal (what it votes in the step's all-reduce)."""
        return self._signum is not None

    @property
    def signum(self) -> int | None:
        """The signal of the stop request: the one this process received, else the one a peer
        published (see `share`), else None."""
        if self._signum is not None:
            return self._signum
        peer = peer_request()
        return peer[0] if peer else None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._signum is not None and signum == signal.SIGINT and self.escalate:
            raise KeyboardInterrupt
        if self._signum is None:
            self._signum = signum
            _publish(signum)
            name = signal_name(signum)
            if self is not _early:
                _say(f"{name} received: checkpoint at the next step boundary, then exit")
            elif _trained:
                _say(
                    f"{name} received after the last training step: the run finishes (no step boundary is left)"
                )
            else:
                _say(
                    f"{name} received while starting: kept; the run stops at its first step boundary with a "
                    "checkpoint, then exits"
                )

    def __enter__(self) -> StopRequest:
        global _active
        if threading.current_thread() is threading.main_thread():
            for s in stop_signals():
                self._previous[s] = signal.signal(s, self._handle)
            # After the handlers: a signal from now on lands here, one before was kept by the
            # start-up recorder (hold_at_start).
            if (
                self._signum is None
                and _early is not None
                and _early is not self
                and _early._signum is not None
            ):
                self._signum = _early._signum
        self._outer, _active = _active, self
        return self

    def __exit__(self, *exc: object) -> None:
        global _active, _trained
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous.clear()
        _active, self._outer = self._outer, None
        if self is not _early:
            _trained = True


def hold_at_start() -> StopRequest:
    """Record stop signals from now on, for the life of the process; call it first thing in a
    rank (idempotent). Until training enters its StopRequest, a signal is only kept (the
    training loop honours it at its first step boundary); after training it lets the run
    finish. Unblocks the signals a launcher kept blocked across fork and exec
    (spawn_job(hold_signals=True)); pending ones arrive now, at the recorder."""
    global _early
    if _early is None and threading.current_thread() is threading.main_thread():
        _early = StopRequest()
        _early.__enter__()
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return _early if _early is not None else StopRequest()


def share(run_dir: Path | str, rank: int, world_size: int) -> None:
    """Publish this rank's stop signal under `run_dir` (shared by all ranks, like the
    watchdog's heartbeats) and read its peers' there. Removes this rank's file of an earlier
    run: called before the rank joins the process group, so no peer reads it after that."""
    global _share, _unpublished
    _share = (Path(run_dir), int(rank), int(world_size))
    try:
        stop_path(run_dir, rank).unlink(missing_ok=True)
    except OSError:
        pass
    pending = _unpublished if _unpublished is not None else (_early._signum if _early is not None else None)
    if pending is not None:
        _publish(pending)


def stop_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / STOP_DIR / f"rank-{rank:05d}.json"


def _publish(signum: int) -> None:
    """Called in the handler, before this rank's vote: the peers that act on the vote find it."""
    global _unpublished
    if _share is None:
        _unpublished = signum
        return
    run_dir, rank, _ = _share
    path = stop_path(run_dir, rank)
    record = {"rank": rank, "pid": os.getpid(), "signal": signal_name(signum), "signum": int(signum),
              "time": time.time()}  # fmt: skip
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, strict_json.dumps(record).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _unpublished = None
    except OSError:
        _unpublished = signum


def peer_request() -> tuple[int, int] | None:
    """(signum, rank) of the first stop signal a peer published, or None."""
    if _share is None:
        return None
    run_dir, me, world = _share
    found = []
    for r in range(world):
        if r == me:
            continue
        try:
            rec = json.loads(stop_path(run_dir, r).read_text())
            found.append((float(rec["time"]), int(rec["signum"]), r))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not found:
        return None
    _, signum, rank = min(found)
    return signum, rank


def describe(signum: int) -> str:
    """How Interrupted names what stopped the run on this rank: 'SIGUSR1', 'SIGUSR1 (sent to
    rank 1)', or, when the active StopRequest knows of no signal at all (the loop then passes
    its SIGTERM default), that another rank asked."""
    active = _active
    if active is None or active.requested:
        return signal_name(signum)
    peer = peer_request()
    if peer is None:
        return "a stop request of another rank (its signal is not visible here)"
    return f"{signal_name(peer[0])} (sent to rank {peer[1]})"


class StoppedBeforeStart(BaseException):
    """A stop signal while the launcher was still checking the run (config, model, data,
    preflight, the output directory), before any rank started: nothing ran, so nothing was saved.
    A BaseException, like KeyboardInterrupt: no `except Exception` in the checks swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)} before any rank started (the launcher was checking "
                         "the run): nothing ran, no checkpoint was written and the output directory is as it was; "
                         "run the same command again")


@contextmanager
def stop_before_start() -> Iterator[None]:
    """While the launcher checks a run on the main thread: a stop signal (`stop_signals`) raises
    StoppedBeforeStart where the launcher is, at once (the checks can take minutes: a large
    data cache). The previous handlers come back on exit; the launcher's own (spawn_job) or the
    in-process rank's (`hold_at_start`) take over right after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise StoppedBeforeStart(signum)

    previous = {s: signal.signal(s, stop) for s in stop_signals()}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
