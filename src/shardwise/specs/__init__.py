"""Typed, validated, frozen inputs of the planner and the trainer."""

from shardwise.specs.hardware import GPUSpec, HardwareSpec, LinkSpec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec, ParamTensor
from shardwise.specs.strategy import STRATEGY_NAMES, DeepSpeedKnobs, Strategy
from shardwise.specs.train import TrainSpec

__all__ = [
    "STRATEGY_NAMES",
    "DeepSpeedKnobs",
    "GPUSpec",
    "HardwareSpec",
    "LinkSpec",
    "ModelSpec",
    "ParallelLayout",
    "ParamTensor",
    "Strategy",
    "TrainSpec",
]
