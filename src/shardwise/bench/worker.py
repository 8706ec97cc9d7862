"""Two-process CPU/gloo measurement of per-rank model-state bytes for DDP, ZeRO-0..3 and FSDP2.

`measure_model_states(strategy)` spawns 2 processes; each builds the same tiny random
LlamaForCausalLM (fp32), wraps it, runs one full optimizer step, then forward+backward of
step 2, drops loss/activations and takes a census (`after_backward`), then steps again
and takes a second census (`after_step`). Results come back per rank as plain dicts.

DeepSpeed on CPU: DS_ACCELERATOR=cpu (set before deepspeed is imported), gloo, and
`torch_adam: true` so DeepSpeed builds no CPU-Adam extension. Buckets are set to
BUCKET elements because DeepSpeed's 5e8 defaults would allocate GBs per rank.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 2
SEQ, BATCH = 64, 2
BUCKET = 500_000  # elements; above the largest tensor (embedding 2048×128 = 262,144)

# The measured model: Ψ = 1,315,968 fp32 params (untied, MHA). ZeRO-3's default
# persistence threshold (1e5 elements) keeps every decoder-layer tensor (≤ 44,032) whole,
# so only embed_tokens and lm_head are partitioned there; "zero3-nopersist" sets it to 0.
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=344, vocab_size=2048, tie_word_embeddings=False,
    max_position_embeddings=256, attention_bias=False,
)

STRATEGIES = ("ddp", "zero0", "zero1", "zero2", "zero3", "zero3-nopersist", "fsdp")


def deepspeed_run_config(strategy_name: str, knobs: dict[str, Any], ga: int = 1) -> dict[str, Any]:
    """A measurement run's DeepSpeed config: fp32, torch AdamW, no clipping, and the
    `zero_optimization` block built by the same function as the trainer's and `plan --emit`'s
    (plan/emit_deepspeed.zero_section), from the planner's own knobs, so that what is measured
    is what is planned and run."""
    from shardwise.plan.emit_deepspeed import zero_section
    from shardwise.specs import DeepSpeedKnobs, Strategy

    strategy = Strategy.from_name(strategy_name, ds=DeepSpeedKnobs(**knobs))
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": ga,
        "train_batch_size": BATCH * ga * WORLD,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": zero_section(strategy, gather_16bit_on_save=False),
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def ds_config(stage: int, persistence_threshold: int = 100_000) -> dict[str, Any]:
    """The DeepSpeed config used for `stage` (recorded with the results)."""
    knobs: dict[str, Any] = {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if stage == 3:
        knobs.update(prefetch_bucket_size=BUCKET, param_persistence_threshold=persistence_threshold)
    return deepspeed_run_config(f"zero{stage}", knobs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY_LLAMA)
    cfg._attn_implementation = "sdpa"
    return cfg, LlamaForCausalLM(cfg).float()


def _batch(vocab: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return ids, ids.clone()


def _run_one(rank: int, strategy: str) -> dict[str, Any]:
    import torch

    from shardwise.bench.census import take_census

    # Tensors alive before this strategy starts (e.g. what an earlier ZeRO-3 engine in this
    # process left behind) are excluded; holding them here keeps their addresses from reuse.
    gc.collect()
    baseline = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    cfg, model = _build_model()
    ids, labels = _batch(cfg.vocab_size, rank)
    engine: Any = None
    if strategy.startswith("zero"):
        import deepspeed

        stage = int(strategy[4])
        conf = ds_config(stage, 0 if strategy.endswith("nopersist") else 100_000)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=conf)
        module = wrapped = engine.module

        def fwd_bwd() -> None:
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)

        def step() -> None:
            engine.step()
    else:
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # gradient_as_bucket_view: grads are views into DDP's buckets, as shardwise runs DDP
            module = model
            wrapped = engine = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=BUCKET * 4 / 2**20)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            module = wrapped = model
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.0)

        def fwd_bwd() -> None:
            loss = wrapped(input_ids=ids, labels=labels).loss
            loss.backward()

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # DeepSpeed's engine.step() also drops grads

    fwd_bwd()
    step()
    fwd_bwd()  # step 2: loss and activations die with fwd_bwd's frame
    after_backward = take_census(module, optimizer, engine, exclude=(ids, labels, *baseline))
    step()
    after_step = take_census(module, optimizer, engine, exclude=(ids, labels, *baseline))
    if hasattr(engine, "destroy"):
        engine.destroy()  # DeepSpeed: drop hooks so the next strategy starts clean
    return {
        "rank": rank,
        "after_backward": after_backward.bytes,
        "after_step": after_step.bytes,
        "top_after_backward": {k: after_backward.top(k) for k in after_backward.items},
    }


def _rank_main(rank: int, strategies: list[str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # One process pair runs every strategy in turn: start-up (imports, DeepSpeed's
        # comm-op build) dominates a run, and each strategy's objects are freed before the next.
        for strategy in strategies:
            result = _run_one(rank, strategy)
            Path(out_dir, f"{strategy}.rank{rank}.json").write_text(json.dumps(result))
            gc.collect()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_ranks(rank_main, names: list[str], timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """Run `rank_main(rank, names, out_dir)` in WORLD spawned CPU processes (gloo, 1 thread
    each); each rank writes `<name>.rank<r>.json`. Returns {name: per-rank results} for the
    names every rank finished; kills its own processes on timeout."""
    import torch.multiprocessing as mp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(rank_main, args=(names, out_dir), nprocs=WORLD, join=False,
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
            files = [Path(out_dir, f"{name}.rank{r}.json") for r in range(WORLD)]
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
