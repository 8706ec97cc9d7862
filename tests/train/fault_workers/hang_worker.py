"""Two gloo ranks all-reducing in a loop under a Watchdog; rank 1 SIGSTOPs itself.

Rank 0 then blocks in the all-reduce with a peer that can never answer: its watchdog must
name rank 1 as stopped, and the phase, well before gloo's own (longer) timeout.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.train.launch.rank import init_distributed
from shardwise.train.launch.watchdog import Watchdog

p = argparse.ArgumentParser()
p.add_argument("--run-dir", type=Path, required=True)
p.add_argument("--timeout-s", type=float, default=5.0)
p.add_argument("--stop-rank", type=int, default=1)
p.add_argument("--stop-at", type=int, default=3)
args = p.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)

with Watchdog(args.run_dir, rank, world, args.timeout_s) as wd:
    wd.phase("init_process_group", 0)
    init_distributed("cpu", timeout_s=args.timeout_s)
    (args.run_dir / f"pid-{rank}").write_text(str(os.getpid()))
    t = torch.ones(4)
    for step in range(1, 1000):
        wd.phase("forward_backward", step)
        time.sleep(0.05)
        if rank == args.stop_rank and step == args.stop_at:
            time.sleep(1.5)  # mid-forward long enough for a heartbeat to say so
            os.kill(os.getpid(), signal.SIGSTOP)
        wd.phase("all_reduce(step counts)", step)
        dist.all_reduce(t)
    dist.destroy_process_group()
