"""Typed, validated, frozen inputs of the planner and the trainer."""

from shardwise.specs.hardware import GPUSpec, HardwareSpec, LinkSpec
from shardwise.specs.inventory import ParamTensor
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec

__all__ = [
    "GPUSpec",
    "HardwareSpec",
    "LinkSpec",
    "ModelSpec",
    "ParallelLayout",
    "ParamTensor",
    "Strategy",
    "TrainSpec",
]
