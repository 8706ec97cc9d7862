"""One rank of the regional-compile runs (tests/train/test_compile.py), launched by `spawn`.

`--runs strategy:mode` items, mode `compiled` or `eager`: the parity config (fp32, tiny Llama)
trained 6 steps on batches whose sequence length changes (32, 48, 48, 64, 40, 64), as packed or
padded SFT batches do. Rank 0 writes `<strategy>-<mode>.json`: losses, and dynamo's counters
(graphs compiled, frames) after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).parent))
from parity_worker import parity_config

from shardwise.config.schema import TrainConfig
from shardwise.data.labels import IGNORE_INDEX
from shardwise.run import run_spec
from shardwise.train.launch.rank import init_distributed, run_rank_script
from shardwise.train.loop import train

LENGTHS = (32, 48, 48, 64, 40, 64)
GLOBAL = 4


def batches(rank: int, world: int, vocab: int):
    micro = GLOBAL // world
    for i, length in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, vocab, (GLOBAL, length), generator=g)
        labels = ids.clone()
        labels[:, : length // 4] = IGNORE_INDEX  # a prompt mask, unequal targets per row
        labels[0, : length // 2] = IGNORE_INDEX
        sl = slice(rank * micro, (rank + 1) * micro)
        yield [{"input_ids": ids[sl], "labels": labels[sl]}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", nargs="+", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    os.chdir(Path(args.out).resolve())  # the runs' default output_dir lands here, not in the checkout
    for item in args.runs:
        strategy, mode = item.split(":")
        raw = parity_config(strategy, env.world_size, 1).model_dump()
        raw["run"] |= {"steps": len(LENGTHS), "compile": mode == "compiled", "compile_backend": "aot_eager"}
        run = run_spec(TrainConfig.model_validate(raw), env.world_size, "cpu")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        res = train(run, env, steps=batches(env.rank, env.world_size, run.model.vocab_size))
        counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("stats", "frames")}
        if env.is_main:
            (Path(args.out) / f"{strategy}-{mode}.json").write_text(json.dumps(
                {"losses": res.losses, "counters": counters, "fused_kernels": run.train.fused_kernels}))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)  # no interpreter shutdown: see its docstring (a gloo abort at exit)
