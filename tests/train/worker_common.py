"""The start every multi-rank test worker shares: `--out DIR --runs ITEM...`, one intra-op
thread, the gloo group joined, and the worker's cwd in its output dir (so a run's default
output_dir, runs/shardwise, never lands in the checkout)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def start_worker(runs_help: str):
    """Parse the worker's arguments and join the group; returns (run items, DistEnv, out dir)."""
    import torch

    from shardwise.train.launch.rank import init_distributed

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", nargs="+", required=True, help=runs_help)
    args = ap.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    out = Path(args.out).resolve()
    os.chdir(out)
    return args.runs, env, out
