"""Engines behind the one `Engine` interface. This factory is the only place that branches
on the engine kind; the loop, data, logging and checkpointing never do."""

from __future__ import annotations

from typing import Any

from shardwise.run import RunSpec
from shardwise.train.engines.base import DistEnv, Engine


def engine_class(run: RunSpec) -> type[Engine]:
    """The Engine class that runs `run` (importing it imports its engine: deepspeed, FSDP2)."""
    if run.layout.pp > 1:  # FSDP2 and TP inside each stage (shardwise.run.resolve.check_pipeline refuses the rest)
        from shardwise.train.engines.pipeline import PipelineEngine

        return PipelineEngine
    engine = run.engine_strategy.engine  # FSDP2 with a one-rank shard group may run as DDP
    if run.layout.tp > 1 and engine != "deepspeed":
        engine = "fsdp2"  # TP (alone: planned as DDP at tp, one data rank) runs in the FSDP2 engine; ZeRO × TP in AutoTP
    if engine == "deepspeed":
        from shardwise.train.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine
    if engine == "fsdp2":
        from shardwise.train.engines.fsdp import FSDP2Engine

        return FSDP2Engine
    from shardwise.train.engines.ddp import DDPEngine

    return DDPEngine


def build_engine(model, run: RunSpec, env: DistEnv, *, mesh: Any = None) -> Engine:
    """Wrap `model` (fp32, on CPU) as `run` says. `mesh`: a device mesh built beforehand by
    `shardwise.train.engines.mesh.build_mesh(run.layout, ...)` (FSDP2 builds it itself otherwise)."""
    if env.world_size != run.world_size:
        raise ValueError(f"the run was planned for {run.world_size} ranks but {env.world_size} joined")
    cls = engine_class(run)
    return cls(model, run, env, mesh=mesh) if getattr(cls, "takes_mesh", False) else cls(model, run, env)
