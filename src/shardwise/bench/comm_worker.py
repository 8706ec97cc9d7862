"""Two-process CPU/gloo count of the bytes each rank hands to collectives per optimizer step,
through the trainer's own engines.

`measure_comm(cases)` spawns 2 processes; each builds the bench run of shardwise.bench.worker
(the catalog's tiny-llama-bench, fp32, untied, MHA; Ψ = 1,315,968) through the run bridge and
`build_engine`, runs 4 optimizer steps of GA micro-batches each, as the training loop does
(`sync_grads(last)` + `forward_backward`, then `step`), under a `CommCounter` (collectives over
a one-rank group left out: they move nothing), and keeps the
counts of steps 3 and 4 only, averaged per step. Steps 1-2 hold one-off traffic that is set-up,
not steady state: DDP rebuilds its buckets at the start of step 2 (broadcasting int32 bucket
indices from rank 0), ZeRO-3 records its trace in step 1 and checks it in step 2. Their bytes
are kept as `warmup_bytes` for inspection.

A case is "<variant>@ga<N>", variant one of VARIANTS (shardwise.bench.worker.VARIANTS: a
strategy name, plus -nomrba / -allzero for DeepSpeed knobs). DeepSpeed runs its own
accumulation inside the engine (step() after every micro-batch updates only at the boundary).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise import strict_json
from shardwise.bench.worker import (
    BATCH,
    BUCKET,
    SEQ,
    TINY_LLAMA,
    WORLD,
    bench_config,
    bench_run,
    ds_config,
    micro_step,
    optimizer_step,
    spawn_ranks,
    start_engine,
)

STEPS = 4
MEASURED_STEPS = 2  # the last two; see the module docstring for what the first two hold
VARIANTS = ("ddp", "zero0", "zero1", "zero1-nomrba", "zero2", "zero2-nomrba", "zero3", "zero3-allzero",
            "fsdp", "fsdp-grad-op", "fsdp-stock",
            # LoRA (shardwise.bench.worker: rank 8 on every decoder linear): adapter grads only
            "ddp-lora", "zero2-lora", "zero3-lora", "fsdp-lora", "zero3-lora-bf16", "fsdp-lora-bf16")
GAS = (1, 2)
# Tensor + sequence parallel cases (tests/accuracy/test_measured_tp_comm.py): their collectives are of
# activations, so they are held to the planner's total volume, not to test_measured_comm's kinds.
TP_VARIANTS = ("fsdp-tp2", "zero1-tp2", "zero2-tp2")


def case_name(variant: str, ga: int) -> str:
    return f"{variant}@ga{ga}"


def parse_case(case: str) -> tuple[str, int]:
    variant, ga = case.split("@ga")
    if variant not in VARIANTS + TP_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; measured: {', '.join(VARIANTS)}")
    return variant, int(ga)


ALL_CASES: tuple[str, ...] = tuple(case_name(v, g) for v in VARIANTS for g in GAS)


def _run_case(rank: int, case: str) -> dict[str, Any]:
    from shardwise.bench.comm import CommCounter

    variant, ga = parse_case(case)
    engine, batch = start_engine(variant, rank, ga)
    counter = CommCounter(keep_log=True, one_rank_groups=False)  # those move nothing (module docstring)
    per_step: list[dict[str, Any]] = []
    with counter:
        for _step in range(STEPS):
            counter.reset(keep_log=True)
            for m in range(ga):
                micro_step(engine, batch, last=m == ga - 1)
            optimizer_step(engine)
            per_step.append(counter.counts.as_dict() | {"log": counter.counts.log})
    engine.close()  # drop DeepSpeed's hooks so the next case starts clean
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

    import torch
    import torch.distributed as dist

    from shardwise import quiet

    torch.set_num_threads(1)
    quiet.apply()  # the trainer's warning policy; `--verbose` / SHARDWISE_VERBOSE=1 shows every warning
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # One process pair runs every case: start-up (imports, DeepSpeed's comm set-up) dominates.
        for case in cases:
            try:
                result = _run_case(rank, case)
            except Exception as e:
                result = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
            Path(out_dir, f"{case}.rank{rank}.json").write_text(strict_json.dumps(result))
            gc.collect()
            gc.freeze()  # what is left (imports, earlier cases) out of the next case's collections
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_comm(cases: list[str] | tuple[str, ...] = ALL_CASES,
                 timeout_s: float = 300.0) -> dict[str, list[dict[str, Any]]]:
    """Run each case on 2 CPU processes; return {case: per-rank results by rank}."""
    for c in cases:
        parse_case(c)
    return spawn_ranks(_rank_main, list(cases), timeout_s)


@dataclass(frozen=True)
class Wrapping:
    """A `fully_shard` layout, as users write it: reshard_after_forward of the decoder layers, of
    the last one and of the root (None: left to torch, which keeps a root gathered); where the
    embedding and the head are units of their own, theirs (None: left in the root) and whether
    the final norm joins lm_head in the head unit."""

    layers: bool
    last: bool
    root: bool | None
    embedding: bool | None = None
    head: bool | None = None
    head_norm: bool = True


# Raw `fully_shard` layouts, wrapped here as users write it (no shardwise engine), for
# `measure_fsdp_wrapping`. "stock": True for every unit, the root included (torchtune's
# `shard_model`; torch's FSDP2 examples); "trainer": the layout train/engines/fsdp.py runs by
# default (the last layer and the root kept gathered); "torchtune-carved": torchtune's full
# fine-tuning configs (`custom_sharded_layers: ['tok_embeddings', 'output']`, True everywhere;
# pytorch/torchtune@1814feb recipes/configs/llama3_1/70B_full.yaml); "accelerate": accelerate
# 1.16's `fsdp2_prepare_model` with fsdp_reshard_after_forward true (the embedding with the
# flag, [final norm, lm_head] with False, the root left None); "torchtitan": every layer but the
# last and the root resharded (pytorch/torchtitan@9dec370 parallelize_llama.py apply_fsdp at pp 1).
# "trainer-carved" and "trainer-root" are not raw: the trainer's own `shard_model` on
# shardwise.bench.worker's "fsdp-carved" run, and on its "fsdp" run with `fsdp.reshard_root` true.
WRAPPINGS: dict[str, Wrapping | tuple[str, dict[str, Any]]] = {
    "stock": Wrapping(True, True, True),
    "trainer": Wrapping(True, False, False),
    "torchtune-carved": Wrapping(True, True, True, embedding=True, head=True, head_norm=False),
    "accelerate": Wrapping(True, True, None, embedding=True, head=False),
    "torchtitan": Wrapping(True, False, True),
    "trainer-carved": ("fsdp-carved", {}),
    "trainer-root": ("fsdp", {"reshard_root": True}),
}


def _wrap(model: Any, how: Wrapping) -> None:
    from torch.distributed.fsdp import fully_shard

    layers = model.model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=how.last if i == len(layers) - 1 else how.layers)
    if how.embedding is not None:
        fully_shard(model.model.embed_tokens, reshard_after_forward=how.embedding)
        head = [model.model.norm, model.lm_head] if how.head_norm else model.lm_head
        fully_shard(head, reshard_after_forward=how.head)
    fully_shard(model, **({} if how.root is None else {"reshard_after_forward": how.root}))


def trainer_wrapping_run(variant: str, fsdp: dict[str, Any]):
    """The RunSpec of a trainer wrapping: `variant`'s bench config with `fsdp` knobs over its own."""
    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec

    doc = bench_config(variant, 1).model_dump(mode="json", exclude_unset=True)
    doc["strategy"]["fsdp"] = doc["strategy"].get("fsdp", {}) | fsdp
    return run_spec(TrainConfig.model_validate(doc), WORLD, "cpu", environ={})


def _trainer_wrap(model: Any, variant: str, fsdp: dict[str, Any]) -> None:
    import torch

    from shardwise.train.engines.fsdp import shard_model
    from shardwise.train.engines.mesh import build_mesh

    run = trainer_wrapping_run(variant, fsdp)
    shard_model(model, run, build_mesh(run.layout, "cpu"), torch.device("cpu"))


def _wrapping_case(name: str) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.bench.comm import CommCounter

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))  # fp32, untied: the bench model
    how = WRAPPINGS[name]
    if isinstance(how, tuple):
        _trainer_wrap(model, *how)
    else:
        _wrap(model, how)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    counts = []
    for _ in range(2):  # the second forward + backward is the one compared (the first runs lazy init)
        with CommCounter(keep_log=True, one_rank_groups=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        counts.append(counter.counts.as_dict() | {"log": counter.counts.log})
        model.zero_grad(set_to_none=True)
    return {"first": counts[0], "second": counts[1]}


def _wrapping_rank_main(rank: int, names: list[str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    import torch
    import torch.distributed as dist

    from shardwise import quiet

    torch.set_num_threads(1)
    quiet.apply()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for name in names:
            try:
                result = {"rank": rank} | _wrapping_case(name)
            except Exception as e:
                result = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
            Path(out_dir, f"{name}.rank{rank}.json").write_text(strict_json.dumps(result))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_fsdp_wrapping(names: list[str] | tuple[str, ...] = tuple(WRAPPINGS),
                          timeout_s: float = 240.0) -> dict[str, list[dict[str, Any]]]:
    """Bytes per collective kind of one forward + backward (the second; the first's too) of the
    bench model wrapped with raw `fully_shard` as WRAPPINGS says, on 2 CPU/gloo ranks."""
    unknown = [n for n in names if n not in WRAPPINGS]
    if unknown:
        raise ValueError(f"unknown wrappings {unknown}; known: {', '.join(WRAPPINGS)}")
    return spawn_ranks(_wrapping_rank_main, list(names), timeout_s)


def param_sizes() -> dict[str, int]:
    """numel of every parameter of TINY_LLAMA, from a meta-device build (not from the planner)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    return {n: p.numel() for n, p in m.named_parameters()}


__all__ = ["ALL_CASES", "BATCH", "BUCKET", "GAS", "MEASURED_STEPS", "SEQ", "STEPS", "TINY_LLAMA", "TP_VARIANTS", "VARIANTS",
           "WORLD", "WRAPPINGS", "Wrapping", "bench_config", "bench_run", "case_name", "ds_config", "measure_comm",
           "measure_fsdp_wrapping", "param_sizes", "parse_case"]
