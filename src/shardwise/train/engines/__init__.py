"""Engines behind the one `Engine` interface. This factory is the only place that branches
on the engine kind; the loop, data, logging and checkpointing never do."""

from __future__ import annotations

from typing import Any

from shardwise.run import RunSpec
from shardwise.train.engines.base import DistEnv, Engine


def build_engine(model, run: RunSpec, env: DistEnv, *, mesh: Any = None) -> Engine:
    """Wrap `model` (fp32, on CPU) as `run` says. `mesh`: a device mesh built beforehand by
    `shardwise.train.parallel.build_mesh(run.layout, ...)` (FSDP2 builds it itself otherwise)."""
    if env.world_size != run.world_size:
        raise ValueError(f"the run was planned for {run.world_size} ranks but {env.world_size} joined")
    engine = run.engine_strategy.engine  # FSDP2 with a one-rank shard group may run as DDP
    if run.layout.tp > 1 and engine != "deepspeed":
        engine = "fsdp2"  # TP (alone: planned as DDP at tp, one data rank) runs in the FSDP2 engine; ZeRO × TP in AutoTP
    if engine == "deepspeed":
        from shardwise.train.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, run, env)
    if engine == "fsdp2":
        from shardwise.train.engines.fsdp import FSDP2Engine

        return FSDP2Engine(model, run, env, mesh=mesh)
    from shardwise.train.engines.ddp import DDPEngine

    return DDPEngine(model, run, env)
