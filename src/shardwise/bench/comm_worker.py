"""Two-process CPU/gloo count of the bytes each rank hands to collectives per optimizer step.

`measure_comm(cases)` spawns 2 processes; each builds the tiny LlamaForCausalLM of
shardwise.bench.worker (fp32, untied, MHA; Ψ = 1,315,968), wraps it as the case says,
runs 4 optimizer steps of GA micro-batches each under a `CommCounter`, and keeps the counts
of steps 3 and 4 only, averaged per step. Steps 1-2 hold one-off traffic that is set-up, not
steady state: DDP rebuilds its buckets at the start of step 2 (broadcasting int32 bucket
indices from rank 0), ZeRO-3 records its trace in step 1 and checks it in step 2. Their bytes
are kept as `warmup_bytes` for inspection.

A case is "<variant>@ga<N>", variant one of VARIANTS:
  ddp                 torch DDP, gradient_as_bucket_view, no_sync on non-final micro-batches
  zero0..zero3        DeepSpeed defaults except buckets (BUCKET elements, as the memory worker)
  zero1-nomrba,       use_multi_rank_bucket_allreduce = false (reduce to the owner rank)
  zero2-nomrba
  zero3-allzero       stage3_max_live_parameters = max_reuse_distance = param_persistence_threshold
                      = prefetch_bucket_size = 0 (every tensor partitioned, re-gathered in backward)
  fsdp, fsdp-grad-op  FSDP2 fully_shard per decoder layer (reshard_after_forward True / False),
                      then the root with reshard_after_forward=False (as shardwise's trainer);
                      set_requires_gradient_sync(False) on non-final micro-batches
DeepSpeed runs its own accumulation: engine.backward + engine.step every micro-batch.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

from shardwise.bench.worker import (
    BATCH,
    BUCKET,
    SEQ,
    TINY_LLAMA,
    WORLD,
    _batch,
    _build_model,
    deepspeed_run_config,
    spawn_ranks,
)

STEPS = 4
MEASURED_STEPS = 2  # the last two; see the module docstring for what the first two hold
VARIANTS = ("ddp", "zero0", "zero1", "zero1-nomrba", "zero2", "zero2-nomrba", "zero3", "zero3-allzero",
            "fsdp", "fsdp-grad-op")
GAS = (1, 2)


def case_name(variant: str, ga: int) -> str:
    return f"{variant}@ga{ga}"


def parse_case(case: str) -> tuple[str, int]:
    variant, ga = case.split("@ga")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; measured: {', '.join(VARIANTS)}")
    return variant, int(ga)


ALL_CASES: tuple[str, ...] = tuple(case_name(v, g) for v in VARIANTS for g in GAS)


def strategy_of(variant: str) -> str:
    """shardwise strategy name a variant runs (the -nomrba/-allzero suffixes are DeepSpeed knobs)."""
    return variant.removesuffix("-nomrba").removesuffix("-allzero")


def ds_knobs(variant: str) -> dict[str, Any]:
    """The DeepSpeed knobs of a variant, named as shardwise.specs.DeepSpeedKnobs fields."""
    knobs: dict[str, Any] = {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                             "use_multi_rank_bucket_allreduce": not variant.endswith("-nomrba")}
    if variant.startswith("zero3"):
        if variant.endswith("-allzero"):
            knobs.update(prefetch_bucket_size=0, max_live_parameters=0, max_reuse_distance=0,
                         param_persistence_threshold=0)
        else:  # DeepSpeed's defaults, except the prefetch bucket (capped like the others)
            knobs.update(prefetch_bucket_size=BUCKET, max_live_parameters=1_000_000_000,
                         max_reuse_distance=1_000_000_000, param_persistence_threshold=100_000)
    return knobs


def ds_config(variant: str, ga: int) -> dict[str, Any]:
    """The DeepSpeed config a variant runs with (recorded with the results)."""
    return deepspeed_run_config(strategy_of(variant), ds_knobs(variant), ga)


def _run_case(rank: int, case: str) -> dict[str, Any]:
    import contextlib

    import torch

    from shardwise.bench.comm import CommCounter

    variant, ga = parse_case(case)
    cfg, model = _build_model()
    ids, labels = _batch(cfg.vocab_size, rank)
    engine: Any = None
    if variant.startswith("zero"):
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(variant, ga))

        def micro(last: bool) -> None:
            engine.backward(engine(input_ids=ids, labels=labels).loss)
            engine.step()  # DeepSpeed steps the optimizer only at its accumulation boundary
    else:
        if variant == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            wrapped = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=BUCKET * 4 / 2**20)

            def no_sync(last: bool) -> Any:
                return contextlib.nullcontext() if last else wrapped.no_sync()
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=variant == "fsdp")
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            wrapped = model

            def no_sync(last: bool) -> Any:
                wrapped.set_requires_gradient_sync(last)
                return contextlib.nullcontext()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

        def micro(last: bool) -> None:
            with no_sync(last):
                (wrapped(input_ids=ids, labels=labels).loss / ga).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    counter = CommCounter(keep_log=True)
    per_step: list[dict[str, Any]] = []
    with counter:
        for _step in range(STEPS):
            counter.reset(keep_log=True)
            for m in range(ga):
                micro(last=m == ga - 1)
            per_step.append(counter.counts.as_dict() | {"log": counter.counts.log})
    if hasattr(engine, "destroy"):
        engine.destroy()  # drop DeepSpeed's hooks so the next case starts clean
    measured = per_step[STEPS - MEASURED_STEPS:]
    kinds = sorted({k for s in measured for k in s["bytes"]})
    return {
        "rank": rank,
        "bytes_per_step": {k: sum(s["bytes"].get(k, 0) for s in measured) / MEASURED_STEPS for k in kinds},
        "calls_per_step": {k: sum(s["calls"].get(k, 0) for s in measured) / MEASURED_STEPS for k in kinds},
        "dtypes": {k: sorted({d for s in measured for d in s["dtypes"].get(k, [])}) for k in kinds},
        "warmup_bytes": [s["bytes"] for s in per_step[:STEPS - MEASURED_STEPS]],
        # every collective of the last measured step: (op, kind, bytes), in issue order
        "log_last_step": per_step[-1]["log"],
    }


def _rank_main(rank: int, cases: list[str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # One process pair runs every case: start-up (imports, DeepSpeed's comm set-up) dominates.
        for case in cases:
            try:
                result = _run_case(rank, case)
            except Exception as e:
                result = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
            Path(out_dir, f"{case}.rank{rank}.json").write_text(json.dumps(result))
            gc.collect()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_comm(cases: list[str] | tuple[str, ...] = ALL_CASES,
                 timeout_s: float = 300.0) -> dict[str, list[dict[str, Any]]]:
    """Run each case on 2 CPU processes; return {case: per-rank results by rank}."""
    for c in cases:
        parse_case(c)
    return spawn_ranks(_rank_main, list(cases), timeout_s)


def param_sizes() -> dict[str, int]:
    """numel of every parameter of TINY_LLAMA, from a meta-device build (not from the planner)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    return {n: p.numel() for n, p in m.named_parameters()}


__all__ = ["ALL_CASES", "BATCH", "BUCKET", "GAS", "MEASURED_STEPS", "SEQ", "STEPS", "TINY_LLAMA", "VARIANTS",
           "WORLD", "case_name", "ds_config", "ds_knobs", "measure_comm", "param_sizes", "parse_case",
           "strategy_of"]
