"""Engines behind the one `Engine` interface. This factory is the only place that branches
on the engine kind; the loop, data, logging and checkpointing never do."""

from __future__ import annotations

from shardwise.specs import Strategy
from shardwise.train.config import TrainConfig
from shardwise.train.engines.base import DistEnv, Engine


def build_engine(model, cfg: TrainConfig, strategy: Strategy, env: DistEnv) -> Engine:
    if strategy.engine == "deepspeed":
        from shardwise.train.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg, strategy, env)
    if strategy.engine == "fsdp2":
        from shardwise.train.engines.fsdp import FSDP2Engine

        return FSDP2Engine(model, cfg, strategy, env)
    from shardwise.train.engines.ddp import DDPEngine

    return DDPEngine(model, cfg, strategy, env)
