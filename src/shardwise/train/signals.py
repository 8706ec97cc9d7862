"""Preemption: SIGTERM (what `scancel`, Kubernetes and torchrun send), SIGUSR1 (SLURM's
`--signal=USR1@120` warning) and SIGINT ask a rank to stop at the next step boundary.

The handler only records the request. The loop carries it in the step's one host-side
all-reduce, so every rank sees a request made to any rank, all stop after the same optimizer
step, save one checkpoint together and exit with ExitCode.INTERRUPTED (75). A rank never
stops alone mid-collective (that would hang its peers until the watchdog fires).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Installed for the duration of training on the main thread (a no-op elsewhere).

    `escalate`: a second SIGINT raises KeyboardInterrupt (an interactive single process).
    Ranks started by a launcher do not escalate: the launcher forwards a terminal's Ctrl-C
    on top of the one the terminal already sent, and escalates itself on the next one.
    """

    def __init__(self, escalate: bool | None = None):
        self.escalate = escalate if escalate is not None else "SHARDWISE_LAUNCHED" not in os.environ
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT and self.escalate:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
            name = signal.Signals(signum).name
            print(f"shardwise: {name} received: checkpoint at the next step boundary, then exit", flush=True)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous.clear()
