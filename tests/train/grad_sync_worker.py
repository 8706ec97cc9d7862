"""One rank of the FSDP2 gradient-sync check (tests/train/test_grad_sync.py), launched through `spawn`.

Each item is `NAME=MACHINE`: an fsdp run of tiny-llama-bench (fp32, micro-batch 2 × grad_accum
GA) planned on the hardware spec MACHINE (`hardware.machine`: the test sets the GPU memory there).
The trainer's loop trains STEPS steps under a `CommCounter` (collectives over a one-rank group left
out), and rank 0 writes `NAME.json`: the planner's choice (the memory plan the preflight checks,
`memory_as_run`), the trainer's (`RunSpec.grad_sync`, what the FSDP2 engine runs), the
reduce-scatter calls per step the engine issued, and the number of `fully_shard` units.
"""

from __future__ import annotations

import json

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train import loop
from shardwise.train.launch.rank import run_rank_script

GA = 4
STEPS = 2


def config(machine: str, out) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"name": "tiny-llama-bench", "attention": "eager"},
        "data": {"kind": "synthetic", "synthetic": {"samples": 64, "seq_len": 32, "seed": 7}},
        "strategy": {"name": "fsdp"},
        "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0},
        "precision": "fp32",
        "hardware": {"machine": machine},
        "run": {"steps": STEPS, "micro_batch": 2, "grad_accum": GA, "seed": 3, "device": "cpu"},
        "checkpointing": {"output_dir": str(out), "save_every_minutes": None},
        "logging": {"every": 1, "every_seconds": None, "progress": False, "trackers": []},
    })


def main() -> None:
    from torch.distributed.fsdp import FSDPModule

    from shardwise.bench.comm import CommCounter
    from shardwise.plan.evaluate import memory_as_run

    items, env, out = start_worker("NAME=MACHINE")
    for item in items:
        name, machine = item.split("=", 1)
        run = run_spec(config(machine, out / name), env.world_size, "cpu")
        planned = memory_as_run(run.model, run.hardware, run.train, run.strategy)  # as preflight plans it
        units: list[int] = []
        build = loop.build_engine

        def counting_build(*args, build=build, units=units, **kwargs):
            engine = build(*args, **kwargs)
            units.append(sum(isinstance(m, FSDPModule) for m in engine.module.modules()))
            return engine

        loop.build_engine = counting_build
        try:
            with CommCounter(one_rank_groups=False) as counter:
                res = loop.train(run, env)
        finally:
            loop.build_engine = build
        if env.is_main:
            (out / f"{name}.json").write_text(json.dumps({
                "planned": planned.grad_sync.as_dict() if planned.grad_sync else None,
                "planned_fits": planned.fits,
                "planned_held_grads": planned.gpu.held_grads,
                "trainer": run.grad_sync.as_dict() if run.grad_sync else None,
                "reduce_scatter_calls_per_step": counter.counts.calls.get("reduce_scatter", 0) / STEPS,
                "units": units,
                "losses": res.losses,
            }))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
