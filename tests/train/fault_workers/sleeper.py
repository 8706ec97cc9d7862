"""A stand-in rank for the launcher's fault tests: no torch, starts in milliseconds.

Writes `pid-<rank>` once its signal handlers are in place (the test signals only after
that), records each signal it gets as `got-<SIGNAME>-<rank>` and, like the trainer, exits
75 on an interrupt. Options make one rank fail in a chosen way.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

INTERRUPTED = 75

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--ignore-signals", action="store_true", help="record interrupts but keep running")
p.add_argument("--grandchild", action="store_true", help="start a child process (a data-loader worker)")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--fail-after", type=float, default=0.5, help="seconds after all pid files exist")
p.add_argument("--fail-how", default="SIGKILL", help="a signal name, or an exit code")
p.add_argument("--live-s", type=float, default=60.0)
p.add_argument("--exit-on-term", type=int, default=None,
               help="exit with this code on SIGTERM: a rank that took the failing rank's decision a moment later")
args = p.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def write(name: str, text: str) -> None:
    tmp = args.out / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, args.out / name)


def on_signal(signum, frame) -> None:
    write(f"got-{signal.Signals(signum).name}-{rank}", str(time.time()))
    if args.exit_on_term is not None and signum == signal.SIGTERM:
        os._exit(args.exit_on_term)
    if not args.ignore_signals:
        os._exit(INTERRUPTED)


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(sig, on_signal)
if args.grandchild:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    write(f"grandchild-{rank}", str(child.pid))
write(f"pid-{rank}", str(os.getpid()))

if rank == args.fail_rank:
    # Fail only once every rank is up, so the test knows all the pids it must see gone.
    while not all((args.out / f"pid-{r}").exists() for r in range(world)):
        time.sleep(0.02)
    time.sleep(args.fail_after)
    if args.fail_how.isdigit():
        sys.exit(int(args.fail_how))
    os.kill(os.getpid(), getattr(signal, args.fail_how))
deadline = time.monotonic() + args.live_s
while time.monotonic() < deadline:
    time.sleep(0.05)
