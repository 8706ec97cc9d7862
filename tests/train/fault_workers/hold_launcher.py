"""`spawn_job` in a process of its own with `hold_signals` on or off, as `shardwise train`
starts its ranks (on): the test signals the launcher, or its ranks, while they start.

    python hold_launcher.py --out D [--no-hold] -- WORKER ARGS...

Writes `D/started` from `on_start` (the launcher's handlers are in place) and exits with the
job's code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.train.launch.spawn import spawn_job

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--nproc", type=int, default=2)
p.add_argument("--no-hold", action="store_true")
p.add_argument("argv", nargs=argparse.REMAINDER)
args = p.parse_args()
argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
job = spawn_job(
    argv,
    args.nproc,
    threads_per_rank=1,
    extra_env={"PYTHONWARNINGS": "ignore"},
    grace_s=2.0,
    hold_signals=not args.no_hold,
    on_start=lambda: (args.out / "started").write_text("1"),
)
sys.exit(job.rc)
