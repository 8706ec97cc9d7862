"""Turn a hang into an error that names the rank and the collective.

A rank blocked in a collective cannot say why: the peer it waits for may be stopped,
swapping, dead on another node or stuck in its own collective. NCCL and gloo eventually
time out with a message that names neither. Each rank therefore runs a `Watchdog`: a
daemon thread that publishes a heartbeat file (`run_dir/heartbeat/rank-00001.json`:
pid, host, step, phase) every second and, when the rank's own phase has not changed for
`run.timeout_s`, prints one line naming its phase and what every peer's heartbeat says,
then exits the process with `ExitCode.HUNG`. `os._exit` because the main thread is blocked
inside C++ and no Python-level exception could reach it.

The collective backstop (`init_distributed(timeout_s=...)`) is set a little longer than the
watchdog's timeout so that the watchdog, which can name the culprit, speaks first.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from shardwise import strict_json
from shardwise.errors import ExitCode

HEARTBEAT_DIR = "heartbeat"
# A peer whose last beat is older than this is not responding (its beats come every
# `interval_s`; a loaded host can delay one by a second or two, not by five).
STALE_S = 5.0
# How many unresponsive peers one message lists before it counts the rest.
_MAX_LISTED = 8

_PROC_STATES = {
    "T": "stopped",
    "t": "stopped by a debugger",
    "D": "in uninterruptible I/O wait",
    "Z": "exited, not yet reaped",
    "X": "exited",
}


def heartbeat_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank-{rank:05d}.json"


def proc_state(pid: int) -> str | None:
    """The one-letter state of a local process from /proc (None when it does not exist).

    Field 3 of /proc/<pid>/stat follows the command name in parentheses, which may itself
    contain spaces and parentheses: split after the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 1 :].split()
    return rest[0] if rest else None


def describe_state(pid: int) -> str | None:
    """Words for a local process that cannot be making progress: 'stopped', 'gone', ... (else None)."""
    state = proc_state(pid)
    if state is None:
        return "process gone"
    return _PROC_STATES.get(state)


def read_heartbeat(run_dir: Path | str, rank: int) -> dict | None:
    try:
        return json.loads(heartbeat_path(run_dir, rank).read_text())
    except (OSError, ValueError):
        return None


def describe_peers(
    run_dir: Path | str,
    world_size: int,
    exclude_rank: int | None = None,
    *,
    since: float | None = None,
    now: float | None = None,
) -> str:
    """What the heartbeats of ranks `0..world_size-1` (but `exclude_rank`) say, in one line.

    Unresponsive peers (stale beat, no file, exited or left) are listed one by one: one of
    them is the likely culprit; responsive ones are grouped by (step, phase) so that a
    512-rank job still gives one readable line. `since` (wall time this rank started) marks
    a heartbeat file older than it as left over from an earlier run. Process states
    ('stopped', 'process gone') are only known for peers on this host.
    """
    now = time.time() if now is None else now
    host = socket.gethostname()
    bad: list[str] = []
    groups: dict[tuple[int, str], list[tuple[int, dict]]] = {}
    for r in range(world_size):
        if r == exclude_rank:
            continue
        hb = read_heartbeat(run_dir, r)
        if hb is None:
            bad.append(f"rank {r}: no heartbeat in {heartbeat_path(run_dir, r).parent}"
                       " (not started, or on a host that does not share this directory)")
            continue
        if since is not None and hb.get("time", 0.0) < since - STALE_S:
            bad.append(f"rank {r}: no heartbeat since this rank started (the file is from an earlier run)")
            continue
        pid = hb.get("pid")
        age = now - float(hb.get("time", 0.0))
        where = f"at step {hb.get('step')} in {hb.get('phase')!r}"
        if hb.get("done"):
            bad.append(f"rank {r} (pid {pid}) has left the job (finished or failed {where}, {age:.0f} s ago)")
            continue
        state = describe_state(int(pid)) if pid and hb.get("host") == host else None
        if state in ("process gone", _PROC_STATES["Z"], _PROC_STATES["X"]):
            bad.append(f"rank {r} (pid {pid}) has exited (last heartbeat {age:.0f} s ago {where})")
            continue
        # A stopped process cannot answer however fresh its last beat (it may have stopped
        # right after writing it).
        if age > STALE_S or state in (_PROC_STATES["T"], _PROC_STATES["t"]):
            bad.append(f"rank {r} (pid {pid}) last heartbeat {age:.0f} s ago {where} — not responding"
                       + (f" ({state})" if state else ""))
            continue
        groups.setdefault((int(hb.get("step", -1)), str(hb.get("phase"))), []).append((r, hb))
    parts = bad[:_MAX_LISTED]
    if len(bad) > _MAX_LISTED:
        parts.append(f"and {len(bad) - _MAX_LISTED} more not responding")
    for (step, phase), members in sorted(groups.items()):
        stuck = min(now - float(hb.get("phase_since", now)) for _, hb in members)
        if len(members) == 1:
            r, hb = members[0]
            who = f"rank {r} (pid {hb.get('pid')})"
        else:
            who = f"ranks {_ranges([r for r, _ in members])}"
        parts.append(f"{who} responding, at step {step} in {phase!r} for {stuck:.0f} s")
    return "; ".join(parts) if parts else "no peers"


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


class Watchdog:
    """One per rank: heartbeat file every `interval_s`, HUNG exit after `timeout_s` in one phase.

    The training loop calls `phase(name, step)` on its own thread whenever it moves on (every
    call counts as progress, even with the same name). It only swaps one tuple, so it costs
    nothing next to a step; all I/O happens on the watchdog's thread. Start it before
    `init_distributed` so that a rank that never joins is named by the ones that did.
    """

    def __init__(self, run_dir: Path | str, rank: int, world_size: int, timeout_s: float,
                 *, interval_s: float = 1.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.interval_s = float(timeout_s), float(interval_s)
        self.path = heartbeat_path(self.run_dir, rank)
        # (phase, step, monotonic time of the change): one attribute, so the thread never
        # sees a new phase with an old time (or the reverse).
        self._state: tuple[str, int, float] = ("start", 0, time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_wall = time.time()
        self._host = socket.gethostname()

    def phase(self, name: str, step: int) -> None:
        self._state = (name, step, time.monotonic())

    def start(self) -> Watchdog:
        if self._thread is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._started_wall = time.time()
        self._state = (self._state[0], self._state[1], time.monotonic())
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"shardwise-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; the last heartbeat says the rank has left, so peers still waiting see
        why it does not answer instead of a silence."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self._beat(done=True)
        except OSError:
            pass

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _beat(self, done: bool = False) -> None:
        name, step, since = self._state
        now_wall, now_mono = time.time(), time.monotonic()
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": self._host,
            "step": step,
            "phase": name,
            "phase_since": now_wall - (now_mono - since),
            "time": now_wall,
            "done": done,
        }
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(strict_json.dumps(record))
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except OSError:
                pass  # a full or vanished run dir must not kill the rank; the timeout still works
            state = self._state
            if time.monotonic() - state[2] > self.timeout_s and self._state is state:
                self._hang(state)

    def _hang(self, state: tuple[str, int, float]) -> None:
        name, step, since = state
        stalled = time.monotonic() - since
        peers = describe_peers(self.run_dir, self.world_size, self.rank, since=self._started_wall)
        msg = (f"shardwise: rank {self.rank} made no progress for {stalled:.0f} s in {name!r} at step {step}"
               f" (run.timeout_s = {self.timeout_s:g}). Peers: {peers}")
        try:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(ExitCode.HUNG)
