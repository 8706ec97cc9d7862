"""Checks that run once, before any rank starts: model source, data files, tokenizer, the
strategy against the world size, and the planner's memory check (refuse what will not fit).

Everything here is torch-free and fast, so a bad config fails in a second with one message
instead of N ranks each printing a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import ShardwiseError
from shardwise.specs import STRATEGY_NAMES, ParallelLayout, Strategy, TrainSpec
from shardwise.train.config import TrainConfig
from shardwise.train.model import check_model_source, model_spec


def seq_len(cfg: TrainConfig) -> int:
    if cfg.data.kind == "synthetic":
        return cfg.data.synthetic.seq_len
    return int(cfg.data.sft.get("max_length", 2048))


def train_spec(cfg: TrainConfig, **overrides) -> TrainSpec:
    fields = {
        "seq_len": seq_len(cfg),
        "micro_batch": cfg.run.micro_batch,
        "grad_accum": cfg.run.grad_accum,
        "precision": cfg.precision,
        "checkpointing": cfg.checkpointing.activation,
        "attention": cfg.model.attention,
    }
    return TrainSpec(**(fields | overrides))


def strategy(cfg: TrainConfig, world_size: int) -> Strategy:
    s = Strategy.from_name(
        cfg.strategy.name, **({"shard_group": cfg.strategy.shard_group} if cfg.strategy.shard_group else {})
    )
    try:
        ParallelLayout.for_strategy(s, world_size, world_size)
    except ShardwiseError as e:
        raise ShardwiseError(
            f"{cfg.source}: strategy.name {s.name!r} cannot run on {world_size} rank(s): {e}"
        ) from None
    if s.fsdp_sharding == "hybrid" and (world_size // (s.shard_group or world_size)) < 1:
        raise ShardwiseError(
            f"{cfg.source}: strategy 'fsdp-hybrid' needs a shard group dividing {world_size} ranks"
        )
    return s


def check_data(cfg: TrainConfig) -> None:
    if cfg.data.tokenizer is not None and not Path(cfg.data.tokenizer).is_dir():
        raise ShardwiseError(f"{cfg.source}: data.tokenizer {cfg.data.tokenizer!r} is not a directory")
    if cfg.data.kind == "synthetic":
        return
    from shardwise.data.formats import resolve_files
    from shardwise.train.sft_data import data_config

    dc = data_config(cfg)
    resolve_files(dc.train_files, where=f"{cfg.source}: data.sft.train_files")


@dataclass(frozen=True)
class MemoryCheck:
    planned_bytes: float
    capacity_bytes: float
    fits: bool
    gpu: str


def check_memory(cfg: TrainConfig, world_size: int, device: str, force: bool = False) -> MemoryCheck | None:
    """The planner's verdict for this run; refuses a non-fitting plan with the nearest one that fits."""
    from shardwise.catalog import build_hardware
    from shardwise.plan.memory import plan_memory

    enabled = cfg.hardware.check_memory if cfg.hardware.check_memory is not None else device == "cuda"
    spec = model_spec(cfg.model)
    hw = build_hardware(gpu=cfg.hardware.gpu, gpus=world_size, gpus_per_node=world_size)
    s = strategy(cfg, world_size)
    plan = plan_memory(spec, hw, train_spec(cfg), s)
    result = MemoryCheck(plan.gpu.total, plan.capacity_bytes, plan.fits, cfg.hardware.gpu)
    if plan.fits or not enabled or force:
        return result
    gib = 2**30
    hint = nearest_fit(cfg, spec, hw, s)
    raise ShardwiseError(
        f"{cfg.source}: predicted not to fit: strategy {s.name!r}, micro_batch {cfg.run.micro_batch}, "
        f"seq_len {seq_len(cfg)}, activation checkpointing {cfg.checkpointing.activation!r} needs "
        f"{plan.gpu.total / gib:.1f} GiB per GPU (model states {plan.gpu.model_states / gib:.1f}, "
        f"activations {(plan.gpu.activations + plan.gpu.logits) / gib:.1f}) of "
        f"{plan.usable_bytes / gib:.1f} GiB usable on {cfg.hardware.gpu}. "
        f"Nearest that fits: {hint}. Use --force to run anyway."
    )


def nearest_fit(cfg: TrainConfig, spec, hw, s: Strategy) -> str:
    """Fewest changes first: checkpointing, then smaller micro-batches (same global batch via
    accumulation), then other strategies (least offload first, the table's order)."""
    from shardwise.plan.memory import plan_memory

    mb, ga = cfg.run.micro_batch, cfg.run.grad_accum
    options: list[tuple[str, Strategy, dict]] = [
        ("--set checkpointing.activation=full", s, {"checkpointing": "full"})
    ]
    m = mb
    while m > 1:
        m //= 2
        k = mb // m
        for ck in ("none", "full"):
            options.append(
                (
                    f"--set run.micro_batch={m} --set run.grad_accum={ga * k}"
                    + (" --set checkpointing.activation=full" if ck == "full" else ""),
                    s,
                    {"micro_batch": m, "grad_accum": ga * k, "checkpointing": ck},
                )
            )
    for name in STRATEGY_NAMES:
        if name in (s.name, "fsdp-hybrid"):
            continue
        other = Strategy.from_name(name)
        for ck in ("none", "full"):
            options.append(
                (
                    f"--set strategy.name={name}"
                    + (" --set checkpointing.activation=full" if ck == "full" else ""),
                    other,
                    {"checkpointing": ck},
                )
            )
    for text, strat, over in options:
        try:
            p = plan_memory(spec, hw, train_spec(cfg, **over), strat)
        except ShardwiseError:
            continue
        if p.fits:
            return f"{text} ({p.gpu.total / 2**30:.1f} GiB)"
    return (
        "none of checkpointing, smaller micro-batches or other strategies (use more GPUs or a smaller model)"
    )


def preflight(cfg: TrainConfig, world_size: int, device: str, force: bool = False) -> MemoryCheck | None:
    """All user-facing checks; raises ShardwiseError naming the file/field/value."""
    check_model_source(cfg.model, cfg.source)
    check_data(cfg)
    strategy(cfg, world_size)
    return check_memory(cfg, world_size, device, force)
