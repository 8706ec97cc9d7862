"""Build specs from user-facing names and plan a set of strategies (pure, no I/O but reading
a user's config.json)."""

from __future__ import annotations

from pathlib import Path

from shardwise import catalog
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import Evaluation, evaluate
from shardwise.plan.memory import DEFAULT_MARGIN
from shardwise.specs import STRATEGY_NAMES, HardwareSpec, ModelSpec, Strategy, TrainSpec
from shardwise.specs.strategy import StrategyKnobs


def resolve_model(model: str | None = None, model_config: str | Path | None = None,
                  params: float | None = None) -> ModelSpec:
    if model_config is not None:
        return ModelSpec.from_hf_config(model_config)
    if params is not None:
        return ModelSpec.from_params(params)
    return catalog.get_model(model or "llama-2-7b")


def build_specs(*, model=None, model_config=None, params=None, gpu="a100-80g", gpus=8,
                gpus_per_node=None, interconnect=None, gpu_memory_gb=None, host_memory_gb=None,
                **train_fields) -> tuple[ModelSpec, HardwareSpec, TrainSpec]:
    m = resolve_model(model, model_config, params)
    extra = {"host_memory_bytes": host_memory_gb * 1e9} if host_memory_gb else {}
    hw = catalog.build_hardware(gpu=gpu, gpus=gpus, gpus_per_node=gpus_per_node,
                                interconnect=interconnect, memory_gb=gpu_memory_gb, **extra)
    return m, hw, TrainSpec(**train_fields)


def plan_strategies(model: ModelSpec, hw: HardwareSpec, train: TrainSpec,
                    names: list[str] | None = None, *, tp: int = 1, pp: int = 1,
                    accounting: str = "engine", margin: float = DEFAULT_MARGIN,
                    knobs: StrategyKnobs | None = None) -> list[Evaluation]:
    """Plan each named strategy (default: all) with the given TP/PP degrees."""
    names = list(names) if names else list(STRATEGY_NAMES)
    if tp * pp > hw.world_size:
        raise ShardwiseError(f"tp {tp} × pp {pp} = {tp * pp} exceeds the {hw.world_size} GPUs")
    plans = []
    for name in names:
        s = Strategy.with_knobs(name, knobs, tp=tp, pp=pp)
        plans.append(evaluate(model, hw, train, s, accounting=accounting, margin=margin))
    return plans
