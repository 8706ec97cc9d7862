"""`spawn` in a process of its own, so a test can signal (or SIGKILL) the launcher.

    python run_launcher.py --nproc 2 [--run-dir D] [--grace-s G] [--timeout-s T] -- WORKER ARGS...
"""

from __future__ import annotations

import argparse
import sys

from shardwise.train.launch.spawn import spawn

p = argparse.ArgumentParser()
p.add_argument("--nproc", type=int, default=2)
p.add_argument("--run-dir", default=None)
p.add_argument("--grace-s", type=float, default=2.0)
p.add_argument("--timeout-s", type=float, default=None)
p.add_argument("argv", nargs=argparse.REMAINDER)
args = p.parse_args()
argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
sys.exit(spawn(argv, args.nproc, timeout_s=args.timeout_s, threads_per_rank=1,
               extra_env={"PYTHONWARNINGS": "ignore"}, run_dir=args.run_dir, grace_s=args.grace_s))
