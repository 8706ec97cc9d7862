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


def measure_ranks(rank: int, names: list[str], out_dir: str, measure, *, quiet: bool = False) -> None:
    """The body of a `shardwise.bench.worker.spawn_ranks` rank of 2: one intra-op thread, the gloo
    group joined, then `measure(rank, name)` for each of `names` in turn, written as
    `<name>.rank<rank>.json` under `out_dir`, every rank finishing each before the next.
    `quiet`: shardwise's filter of library noise (shardwise.quiet) first."""
    import json

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if quiet:
        from shardwise import quiet as noise

        noise.apply()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for name in names:
            Path(out_dir, f"{name}.rank{rank}.json").write_text(json.dumps(measure(rank, name)))
            dist.barrier()
    finally:
        dist.destroy_process_group()
