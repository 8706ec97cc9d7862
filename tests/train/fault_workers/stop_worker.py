"""A stand-in trainer rank for the stop-signal tests: no torch, like a rank of `shardwise train`.

It takes `--start-s` to start (the trainer's imports, config and process group) before it
enters a StopRequest, then waits for a stop request and exits 75, or exits 0 after `--live-s`.
Writes `pid-<rank>` at once, `hup-<rank>` (SIGHUP's disposition when it started: 'ignored' or
'default'), and `got-<SIGNAME>-<rank>` with the stop it acted on.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--start-s", type=float, default=1.0)
p.add_argument("--live-s", type=float, default=30.0)
args = p.parse_args()
rank = int(os.environ["RANK"])
hup = "ignored" if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else "default"


def write(name: str, text: str) -> None:
    tmp = args.out / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, args.out / name)


write(f"hup-{rank}", hup)
write(f"pid-{rank}", str(os.getpid()))
time.sleep(args.start_s)  # "start-up": a signal now is fatal unless something holds it

from shardwise.train.launch.signals import StopRequest  # noqa: E402

with StopRequest() as stop:
    deadline = time.monotonic() + args.live_s
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.02)
if stop.requested:
    write(f"got-{signal.Signals(stop.signum).name}-{rank}", "1")
    sys.exit(75)
sys.exit(0)
