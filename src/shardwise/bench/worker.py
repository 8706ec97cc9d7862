"""Two-process CPU/gloo measurement of per-rank model-state bytes for DDP, ZeRO-0..3 and FSDP2,
through the trainer's own engines.

`measure_model_states(variants)` spawns 2 processes; each describes the run as a TrainConfig
(`bench_run`: the bench model of the catalog, fp32, AdamW, no clipping), passes it through the
run bridge (`shardwise.run.run_spec`) and `build_engine`, exactly as `shardwise train` does, runs
one full optimizer step, then forward+backward of step 2, drops loss/activations and takes a
census (`after_backward`), then steps again and takes a second census (`after_step`). So a
change to an engine (FSDP2 mixed precision, DeepSpeed's config) is what gets measured.

A variant is a strategy name, optionally with knobs of its engine that differ (VARIANTS:
DeepSpeed's for zero*, FSDP2's for fsdp*).
Buckets are BUCKET elements (DeepSpeed's 5e8 defaults would allocate GBs per rank on CPU).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from shardwise import strict_json

WORLD = 2
SEQ, BATCH = 64, 2
BUCKET = 500_000  # elements; above the largest tensor (embedding 2048×128 = 262,144)
BENCH_MODEL = "tiny-llama-bench"  # catalog: Ψ = 1,315,968 fp32 params (untied, MHA)
BIG_BUCKET = 2_000_000  # elements: above Ψ, so one bucket holds every gradient (8 MB fp32 on CPU)

# ZeRO-3's default persistence threshold (1e5 elements) keeps every decoder-layer tensor
# (≤ 44,032) whole, so only embed_tokens and lm_head are partitioned there; "zero3-nopersist"
# sets it to 0. "-nomrba": use_multi_rank_bucket_allreduce=false (reduce to the owner rank);
# "-allzero": every stage-3 live/reuse/persistence/prefetch knob at 0.
_ALL_ZERO = {"prefetch_bucket_size": 0, "max_live_parameters": 0, "max_reuse_distance": 0,
             "param_persistence_threshold": 0}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}), "zero0": ("zero0", {}), "zero1": ("zero1", {}), "zero2": ("zero2", {}),
    "zero3": ("zero3", {}), "fsdp": ("fsdp", {}), "fsdp-grad-op": ("fsdp-grad-op", {}),
    "zero1-nomrba": ("zero1", {"use_multi_rank_bucket_allreduce": False}),
    "zero2-nomrba": ("zero2", {"use_multi_rank_bucket_allreduce": False}),
    "zero3-nopersist": ("zero3", {"param_persistence_threshold": 0}),
    # "-bigbucket": reduce and all-gather buckets above Ψ (the demo's DeepSpeed defaults, 5e8 ≥ Ψ)
    "zero1-bigbucket": ("zero1", {"reduce_bucket_size": BIG_BUCKET, "allgather_bucket_size": BIG_BUCKET}),
    "zero2-bigbucket": ("zero2", {"reduce_bucket_size": BIG_BUCKET, "allgather_bucket_size": BIG_BUCKET}),
    # "-wd": AdamW weight decay 0.1, so the trainer's two optimizer groups (DeepSpeed partitions each)
    "zero1-wd": ("zero1", {}), "zero2-wd": ("zero2", {}),
    "zero3-allzero": ("zero3", _ALL_ZERO),
    # stock fully_shard, as accelerate, HF Trainer and torchtune run it: every decoder layer
    # resharded after forward, gradients reduce-scattered every micro-batch (sync left on)
    "fsdp-stock": ("fsdp", {"reshard_after_forward": "all", "reduce_every_micro_batch": True}),
    # the embedding and the head as units of their own, every layer resharded (accelerate 1.16's
    # FSDP2 layout; shardwise.bench.comm_worker's "trainer-carved" wrapping)
    "fsdp-carved": ("fsdp", {"reshard_after_forward": "layers", "wrap_embeddings": True}),
    # tensor + sequence parallelism over both ranks (`strategy.tp: 2`, TP alone: one data rank)
    "fsdp-tp2": ("fsdp", {}),
    # ZeRO × TP through DeepSpeed's AutoTP over both ranks (one data rank)
    "zero1-tp2": ("zero1", {}), "zero2-tp2": ("zero2", {}),
}
# LoRA variants: rank LORA_RANK on every decoder linear (`<strategy>-lora`), fp32 or, with
# `-bf16`, bf16-mixed (the frozen base in bf16, adapters fp32).
LORA_RANK = 8
for _s in ("ddp", "zero2", "zero3", "fsdp"):
    VARIANTS[f"{_s}-lora"] = VARIANTS[f"{_s}-lora-bf16"] = (_s, {})
for _s in ("ddp", "zero2"):  # QLoRA: NF4 base (bitsandbytes), bf16 compute
    VARIANTS[f"{_s}-qlora-bf16"] = (_s, {})
STRATEGIES = ("ddp", "zero0", "zero1", "zero2", "zero3", "zero3-nopersist", "fsdp", "zero1-bigbucket", "zero2-bigbucket", "zero1-wd", "zero2-wd",
              *(v for v in VARIANTS if "lora" in v))


def tiny_llama() -> dict[str, Any]:
    """The bench model as transformers config keywords (from the catalog, like the trainer)."""
    from shardwise.catalog import get_model

    d = dict(get_model(BENCH_MODEL).to_hf_dict())
    d.pop("model_type")
    return d


TINY_LLAMA: dict[str, Any] = tiny_llama()


def bench_config(variant: str, ga: int = 1):
    """The TrainConfig of a measurement run (also recorded with the results)."""
    from shardwise.config.schema import TrainConfig

    strategy, knobs = VARIANTS[variant]
    fsdp = knobs if strategy.startswith("fsdp") else {}
    ds = {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET, "prefetch_bucket_size": BUCKET} | (
        {} if fsdp else knobs)
    if strategy.startswith("fsdp"):  # measured with the unsharded grads held (benchmarks/results), not
        fsdp = {"reduce_every_micro_batch": False} | fsdp  # what "auto" decides for this run
    return TrainConfig.model_validate({
        "name": f"bench-{variant}-ga{ga}",
        "model": {"name": BENCH_MODEL, "attention": "sdpa"},
        "data": {"kind": "synthetic", "synthetic": {"samples": BATCH * ga * WORLD, "seq_len": SEQ}},
        # DeepSpeed's default reduce dtype (the param dtype: fp32 here) and DDP buckets as small
        # as DeepSpeed's, so every engine reduces in several buckets
        "strategy": {"name": strategy, "tp": 2 if variant.endswith("-tp2") else 1,
                     "deepspeed": ds | {"communication_data_type": "auto"}, "fsdp": fsdp,
                     "ddp": {"bucket_cap_mb": BUCKET * 4 / 2**20}},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1 if variant.endswith("-wd") else 0.0, "max_grad_norm": 0.0},
        "precision": "bf16-mixed" if variant.endswith("-bf16") else "fp32",
        "run": {"micro_batch": BATCH, "grad_accum": ga, "device": "cpu", "seed": 0, "nproc": WORLD},
        "logging": {"progress": False, "trackers": []},
        "lora": {"rank": LORA_RANK, "target_modules": "all-linear",
                 "quantization": "nf4" if "-qlora" in variant else "none"} if "lora" in variant else None,
    })


def bench_run(variant: str, ga: int = 1):
    """The RunSpec a measurement runs: its TrainConfig through the run bridge."""
    from shardwise.run import run_spec

    return run_spec(bench_config(variant, ga), WORLD, "cpu", environ={})


def ds_config(variant: str, ga: int = 1) -> dict[str, Any]:
    """The DeepSpeed JSON a ZeRO variant's engine receives (recorded with the results)."""
    from shardwise.run import deepspeed_config

    return deepspeed_config(bench_run(variant, ga))


def start_engine(variant: str, rank: int, ga: int = 1):
    """(engine, micro-batch) for a variant on this rank: the trainer's build path."""
    import torch

    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.model.build import build_model

    run = bench_run(variant, ga)
    model = build_model(run)
    g = torch.Generator().manual_seed(1000 + rank // run.layout.tp)  # a TP group reads one batch
    ids = torch.randint(0, run.model.vocab_size, (BATCH, SEQ), generator=g)
    env = DistEnv(rank=rank, world_size=WORLD, local_rank=rank, device="cpu")
    return build_engine(model, run, env), {"input_ids": ids, "labels": ids.clone()}


def micro_step(engine, batch, last: bool) -> None:
    """One micro-batch as the training loop runs it (sync only on the step's last one)."""
    with engine.sync_grads(last):
        engine.forward_backward(batch, loss_scale=1.0 / batch["labels"].numel())


def optimizer_step(engine) -> None:
    engine.step()
    engine.zero_grad()


def _run_one(rank: int, variant: str) -> dict[str, Any]:
    import torch

    from shardwise.bench.census import take_census

    # Tensors alive before this variant starts (e.g. what an earlier ZeRO-3 engine in this
    # process left behind) are excluded; holding them here keeps their addresses from reuse.
    gc.collect()
    baseline = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    # What exists now (the imports, earlier variants' leftovers) goes to the permanent generation:
    # the census's collections and sweeps then walk this variant's objects only, not every import's.
    gc.freeze()
    engine, batch = start_engine(variant, rank)
    exclude = (*batch.values(), *baseline)
    micro_step(engine, batch, last=True)
    optimizer_step(engine)
    micro_step(engine, batch, last=True)  # step 2: loss and activations die with the call
    after_backward = take_census(engine.module, engine.optimizer, engine, exclude=exclude)
    optimizer_step(engine)
    after_step = take_census(engine.module, engine.optimizer, engine, exclude=exclude)
    engine.close()  # DeepSpeed: drop hooks so the next variant starts clean
    return {
        "rank": rank,
        "after_backward": after_backward.bytes,
        "after_step": after_step.bytes,
        "top_after_backward": {k: after_backward.top(k) for k in after_backward.items},
    }


def _rank_main(rank: int, strategies: list[str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    import torch
    import torch.distributed as dist

    from shardwise import quiet

    torch.set_num_threads(1)
    quiet.apply()  # the trainer's warning policy; `--verbose` / SHARDWISE_VERBOSE=1 shows every warning
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # One process pair runs every strategy in turn: start-up (imports, DeepSpeed's
        # comm-op build) dominates a run, and each strategy's objects are freed before the next.
        for strategy in strategies:
            result = _run_one(rank, strategy)
            Path(out_dir, f"{strategy}.rank{rank}.json").write_text(strict_json.dumps(result))
            gc.collect()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_then_exit(rank: int, rank_main, *args) -> None:
    """A spawned rank: `rank_main(rank, *args)`, then the end without interpreter shutdown that
    gloo needs (shardwise.train.launch.rank.run_rank_script; exit 0, or 1 after a traceback)."""
    from shardwise.train.launch.rank import run_rank_script

    run_rank_script(lambda: rank_main(rank, *args))


def spawn_ranks(rank_main, names: list[str], timeout_s: float, world: int = WORLD,
                extra: tuple = ()) -> dict[str, list[dict[str, Any]]]:
    """Run `rank_main(rank, names, out_dir, *extra)` in `world` spawned CPU processes (gloo, 1
    thread each); each rank writes `<name>.rank<r>.json`. Returns {name: per-rank results} for
    the names every rank finished; kills its own processes on timeout."""
    import torch.multiprocessing as mp

    from shardwise.train.launch.rank import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_rank_then_exit, args=(rank_main, names, out_dir, *extra), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{names}: workers did not finish within {timeout_s:.0f}s")
        finally:
            for p in ctx.processes:  # only the processes this call started
                if p.is_alive():
                    p.kill()
        out: dict[str, list[dict[str, Any]]] = {}
        for name in names:
            files = [Path(out_dir, f"{name}.rank{r}.json") for r in range(world)]
            if all(f.exists() for f in files):
                out[name] = [json.loads(f.read_text()) for f in files]
        return out


def measure_model_states(strategies: list[str] | tuple[str, ...],
                         timeout_s: float = 300.0) -> dict[str, list[dict[str, Any]]]:
    """Run each strategy on 2 CPU processes; return {strategy: per-rank results by rank}."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; measured: {', '.join(STRATEGIES)}")
    out = spawn_ranks(_rank_main, list(strategies), timeout_s)
    missing = [s for s in strategies if s not in out]
    if missing:
        raise RuntimeError(f"workers wrote no result for {missing}")
    return out


def model_params() -> int:
    """Ψ of TINY_LLAMA, counted from a meta-device build (not from the planner)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    return sum(p.numel() for p in m.parameters())
