"""Checks that run once, before any rank starts: model source, data files, tokenizer, the
strategy against the world size, and the planner's memory check (refuse what will not fit).

Everything here is torch-free and fast, so a bad config fails in a second with one message
instead of N ranks each printing a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec, run_spec, train_spec
from shardwise.specs import STRATEGY_NAMES, Strategy
from shardwise.specs.hardware import GIB
from shardwise.train.config import TrainConfig
from shardwise.train.model import check_model_source


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


def check_memory(run: RunSpec, force: bool = False) -> MemoryCheck:
    """The planner's verdict for this run (the same specs the engines build); refuses a
    non-fitting plan with the nearest one that fits."""
    from shardwise.plan.memory import plan_memory

    cfg = run.config
    enabled = cfg.hardware.check_memory if cfg.hardware.check_memory is not None else run.device == "cuda"
    plan = plan_memory(run.model, run.hardware, run.train, run.strategy)
    result = MemoryCheck(plan.gpu.total, plan.capacity_bytes, plan.fits, cfg.hardware.gpu)
    if plan.fits or not enabled or force:
        return result
    hint = nearest_fit(run)
    raise ShardwiseError(
        f"{cfg.source}: predicted not to fit: strategy {run.strategy.name!r}, micro_batch {cfg.run.micro_batch}, "
        f"seq_len {run.train.seq_len}, activation checkpointing {cfg.checkpointing.activation!r} needs "
        f"{plan.gpu.total / GIB:.1f} GiB per GPU (model states {plan.gpu.model_states / GIB:.1f}, "
        f"activations {(plan.gpu.activations + plan.gpu.logits) / GIB:.1f}) of "
        f"{plan.usable_bytes / GIB:.1f} GiB usable on {cfg.hardware.gpu}. "
        f"Nearest that fits: {hint}. Use --force to run anyway."
    )


def nearest_fit(run: RunSpec) -> str:
    """Fewest changes first: checkpointing, then smaller micro-batches (same global batch via
    accumulation), then other strategies (least offload first, the table's order) with the
    same engine knobs."""
    from shardwise.plan.memory import plan_memory

    cfg, s = run.config, run.strategy
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
        other = Strategy.from_name(name, ds=s.ds, fsdp=s.fsdp, ddp=s.ddp)
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
            p = plan_memory(run.model, run.hardware, train_spec(cfg, **over), strat)
        except ShardwiseError:
            continue
        if p.fits:
            return f"{text} ({p.gpu.total / GIB:.1f} GiB)"
    return (
        "none of checkpointing, smaller micro-batches or other strategies (use more GPUs or a smaller model)"
    )


def preflight(cfg: TrainConfig, world_size: int, device: str, force: bool = False) -> tuple[RunSpec, MemoryCheck]:
    """All user-facing checks; raises ShardwiseError naming the file/field/value. Returns the
    run's specs (what every rank builds) and the planner's memory verdict."""
    check_model_source(cfg.model, cfg.source)
    check_data(cfg)
    run = run_spec(cfg, world_size, device)
    return run, check_memory(run, force)
