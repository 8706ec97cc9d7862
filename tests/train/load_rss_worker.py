"""One rank of the load-memory checks (tests/train/test_load_memory.py): builds ONE run from a
local checkpoint as the trainer does, records this process's peak RSS once the weights are in
(VmHWM: the process's lifetime peak, so one run per launch), then trains one step.

`--runs CKPT:strategy:lora|full`; rank r writes `rank<r>.json` with the measured peak, the
planner's load phase for the run (shardwise.train.model.weights.planned_load) and the step's loss.
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.engines import build_engine
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.model.build import build_model
from shardwise.train.model.weights import planned_load, zero3


def config(path: str, strategy: str, mode: str) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"path": path},
        "data": {"kind": "synthetic", "synthetic": {"samples": 8, "seq_len": 8, "seed": 7}},
        "strategy": {"name": strategy},
        "precision": "bf16-mixed",
        "run": {"steps": 1, "micro_batch": 1, "grad_accum": 1, "seed": 3, "device": "cpu", "compile": False},
        "logging": {"progress": False, "tensorboard": False},
        "lora": {"rank": 8, "alpha": 16, "target_modules": "all-linear"} if mode == "lora" else None,
    })


def peak_rss() -> float:
    """This process's peak RSS: VmHWM of /proc/self/status, the high-water mark of its own address
    space. Not ru_maxrss: Linux carries the pre-exec image's peak into it, so a rank spawned by a
    large parent (a pytest worker at 1.9 GB) would report the parent's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def main() -> None:
    (item,), env, out = start_worker("ckpt:strategy:lora|full")
    path, strategy, mode = item.split(":")
    run = run_spec(config(path, strategy, mode), env.world_size, "cpu")
    start = peak_rss()
    model = build_model(run, deferred=True)
    if zero3(run):  # the partitions are filled inside build_model; the engine adds fp32 masters
        loaded = peak_rss()
        engine = build_engine(model, run, env)
    else:  # the engine places the meta model and reads each rank's part (weights.materialize)
        engine = build_engine(model, run, env)
        loaded = peak_rss()
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    if engine.name == "fsdp2":
        params = sum(p.numel() for p in engine.module.parameters())  # DTensor numel is global
    g = torch.Generator().manual_seed(env.rank)
    ids = torch.randint(0, run.model.vocab_size, (1, 8), generator=g)
    with engine.sync_grads(True):
        loss = engine.forward_backward({"input_ids": ids, "labels": ids.clone()}, 1.0 / 16)
    engine.step()
    plan = planned_load(run)
    (out / f"rank{env.rank}.json").write_text(json.dumps({
        "start_rss": start, "loaded_rss": loaded, "plan": plan.as_dict(), "params": params,
        "loss": float(loss), "finite": math.isfinite(float(loss)), "engine": engine.name}))
    engine.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
