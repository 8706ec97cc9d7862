"""Build specs from user-facing names and plan a set of strategies (pure, no I/O but reading
a user's config.json, itself or through the catalog's lookup of a Hugging Face id). Every number
a user gives is checked here or in `catalog.build_hardware` before any planning, with the flag
named in the message."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise import catalog
from shardwise.config.fields import check_count, check_number
from shardwise.config.strategy import STRATEGY_NAMES, StrategyKnobs
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import Evaluation, evaluate
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec

# --params above this is refused: 10 trillion parameters, ~5× the largest models trained so far
# (and --params' default shape stops at hidden 65536, ~2.6e13).
MAX_PARAMS = 1e13
# TrainSpec fields given as command-line counts (checked with the flag's name).
_COUNT_FLAGS = {"seq_len": "--seq-len", "micro_batch": "--micro-batch", "grad_accum": "--grad-accum",
                "ce_chunk": "--ce-chunk"}


def field_high(spec: type, field: str) -> int | None:
    """The `le` bound of a spec's field (the schema states it once)."""
    return next((m.le for m in spec.model_fields[field].metadata if getattr(m, "le", None) is not None), None)


def check_margin(margin: float | None) -> float:
    """`--margin`: the fraction of GPU memory kept free, 0 ≤ margin < 1 (None: the memory
    model's `default_margin`, catalog/memory.yaml)."""
    if margin is None:
        return catalog.memory_model().default_margin
    if not (isinstance(margin, int | float) and math.isfinite(margin) and 0 <= margin < 1):
        raise ShardwiseError(f"--margin {margin!r}: expected a fraction of GPU memory kept free, "
                             "at least 0 and below 1 (e.g. 0.05)")  # fmt: skip
    return margin


def check_params(params: float) -> float:
    return check_number("--params", params, high=MAX_PARAMS, unit=" of parameters",
                        hint=" (10 trillion is the largest plausible model; e.g. 7e9)")


def resolve_model(model: str | None = None, model_config: str | Path | None = None,
                  params: float | None = None) -> ModelSpec:
    """The model of `--model-config` (a local config.json), else `--params` (the default shape),
    else `--model` as shardwise.catalog.get_model resolves a name (default llama-2-7b)."""
    if model_config is not None:
        return ModelSpec.from_hf_config(model_config)
    if params is not None:
        return ModelSpec.from_params(check_params(params))
    return catalog.get_model(model or "llama-2-7b")


def build_specs(*, model=None, model_config=None, params=None, gpu="a100-80g", gpus=8,
                gpus_per_node=None, interconnect=None, gpu_memory_gb=None, host_memory_gb=None,
                nics_per_node=None, profile=None, machine=None,
                defaults: Callable[[ModelSpec], dict[str, Any]] | None = None,
                **train_fields) -> tuple[ModelSpec, HardwareSpec, TrainSpec]:
    """The specs of `shardwise plan`/`explain` flags. Checks first, in flag order, so a bad
    number is refused before anything is built or planned. `machine` (a MachineHardware:
    `plan --hardware`) gives the GPU, node size, links, NICs and host memory; the hardware
    flags given with it (not None) override its values, and `gpus` defaults to one node.
    A train field that is None was not given: `defaults(model)` gives it (the trainer's, for
    the model planned), else TrainSpec's own default."""
    train_fields = {k: v for k, v in train_fields.items() if v is not None}
    if params is not None and model_config is None:
        check_params(params)
    if machine is None and (gpu is None or gpus is None):
        gpu, gpus = gpu or "a100-80g", gpus or 8
    if interconnect is not None and gpus_per_node is None and machine is None:
        catalog.check_link_name(interconnect)  # an unknown name first: the valid ones, closest first
        raise ShardwiseError(
            f"--interconnect {interconnect} needs --gpus-per-node: whether the link joins GPUs inside a node "
            f"or the nodes depends on how many of the {gpus} GPUs share one (e.g. --gpus-per-node "
            f"{min(gpus, 8) if isinstance(gpus, int) and gpus > 0 else 8} for nodes of that many GPUs, "
            "--gpus-per-node 1 for single-GPU machines)")
    for field, flag in _COUNT_FLAGS.items():
        if field in train_fields:
            check_count(flag, train_fields[field], high=field_high(TrainSpec, field))
    rank, high = train_fields.get("lora_rank", 0), field_high(TrainSpec, "lora_rank")
    if not isinstance(rank, int) or not 0 <= rank <= high:
        raise ShardwiseError(f"--lora-rank {rank!r}: expected 0 (full fine-tuning) or a rank 1..{high:,}")
    extra: dict[str, Any] = {}
    if host_memory_gb is not None:
        extra["host_memory_bytes"] = check_number("--host-memory-gb", host_memory_gb, high=1e6, unit=" of GB") * 1e9
    if nics_per_node is not None:
        extra["nics_per_node"] = check_count("--nics-per-node", nics_per_node, high=64)
    if machine is not None:
        hw = machine.hardware(gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, interconnect=interconnect,
                              memory_gb=gpu_memory_gb, **extra)
    else:
        hw = catalog.build_hardware(gpu=gpu, gpus=gpus, gpus_per_node=gpus_per_node,
                                    interconnect=interconnect, memory_gb=gpu_memory_gb, **extra)
    if profile is not None:  # rates measured on the user's GPUs replace the catalog's
        from shardwise.specs.profile import load_profile

        hw = load_profile(profile).apply(hw)
    m = resolve_model(model, model_config, params)
    if defaults is not None:
        train_fields = defaults(m) | train_fields
    if train_fields.get("base_quant", "none") != "none" and not train_fields.get("lora_rank"):
        raise ShardwiseError("--qlora needs --lora-rank: QLoRA trains LoRA adapters on the 4-bit base")
    if train_fields.get("lora_modules_to_save"):
        from shardwise.plan.lora import saved_module_params

        try:
            saved_module_params(m, train_fields["lora_modules_to_save"])
        except ShardwiseError as e:
            raise ShardwiseError(str(e).replace("lora.modules_to_save", "--lora-modules-to-save")) from None
    try:
        train = TrainSpec(**train_fields)
    except ShardwiseError as e:  # the flag that gave the field, as every check above names it
        raise ShardwiseError(re.sub(r"TrainSpec: field '(\w+)' =", lambda f: "--" + f[1].replace("_", "-"),
                                    str(e))) from None
    return m, hw, train


def plan_strategies(model: ModelSpec, hw: HardwareSpec, train: TrainSpec,
                    names: list[str] | None = None, *, tp: int = 1, pp: int = 1,
                    accounting: str = "engine", margin: float | None = None,
                    knobs: StrategyKnobs | None = None) -> list[Evaluation]:
    """Plan each named strategy (default: all that can be laid out, `plan_layouts`)."""
    return plan_layouts(model, hw, train, names, tp=tp, pp=pp, accounting=accounting, margin=margin,
                        knobs=knobs)[0]


def plan_layouts(model: ModelSpec, hw: HardwareSpec, train: TrainSpec,
                 names: list[str] | None = None, *, tp: int = 1, pp: int = 1,
                 accounting: str = "engine", margin: float | None = None,
                 knobs: StrategyKnobs | None = None) -> tuple[list[Evaluation], dict[str, str]]:
    """Plan each named strategy with the given TP/PP degrees, and the strategies left out with
    the reason. A named strategy that cannot run so is refused; of the default list (all 13),
    those that cannot (ZeRO-2/3 under pipeline parallelism, an fsdp-hybrid shard group that
    does not divide the data-parallel degree) are left out, unless none can: then the first
    reason is the error."""
    margin = check_margin(margin)
    tp, pp = check_count("--tp", tp), check_count("--pp", pp)
    if tp * pp > hw.world_size:
        raise ShardwiseError(f"tp {tp} × pp {pp} = {tp * pp} exceeds the {hw.world_size} GPUs")
    plans, skipped = [], {}
    for name in list(names) if names else STRATEGY_NAMES:
        try:
            s = Strategy.with_knobs(name, knobs, tp=tp, pp=pp)
            plans.append(evaluate(model, hw, train, s, accounting=accounting, margin=margin))
        except ShardwiseError as e:
            if names:
                raise
            skipped[name] = str(e)
    if not plans:
        raise ShardwiseError(next(iter(skipped.values())))
    return plans, skipped
