"""Typed, validated, frozen inputs of the planner and the trainer."""

from shardwise.specs.hardware import GPUSpec, HardwareSpec, LinkSpec
from shardwise.specs.inventory import ParamTensor
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import (
    STRATEGIES,
    STRATEGY_NAMES,
    DDPKnobs,
    DeepSpeedKnobs,
    FSDPKnobs,
    Strategy,
    StrategyFacts,
)
from shardwise.specs.train import TrainSpec

__all__ = [
    "STRATEGIES",
    "STRATEGY_NAMES",
    "DDPKnobs",
    "DeepSpeedKnobs",
    "FSDPKnobs",
    "GPUSpec",
    "HardwareSpec",
    "LinkSpec",
    "ModelSpec",
    "ParallelLayout",
    "ParamTensor",
    "Strategy",
    "StrategyFacts",
    "TrainSpec",
]
