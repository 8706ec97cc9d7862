"""Full-size FSDP2 memory without GPUs: trace one training step of a catalog model on a fake
process group with fake tensors, under torch's FSDPMemTracker (docs/reference.md "Full-size trace
without GPUs"). The tracker attributes every live byte to sharded/unsharded params, grads,
activations, temporaries, all-gather/reduce-scatter buffers and optimizer state; its peak is
what `plan_memory` predicts minus the runtime overhead (CUDA context, NCCL, fragmentation),
which a fake tensor cannot have.

The run goes through the trainer's own path: a TrainConfig, the run bridge (`run_spec`), the
mesh from its ParallelLayout (`build_mesh`, created outside FakeTensorMode), `build_model` and
`build_engine` (FSDP2Engine: `fully_shard` per layer + root, MixedPrecisionPolicy bf16/fp32),
and `engine.forward_backward`. The optimizer step is `engine.optimizer.step()`: the engine's
`step()` reads the clipped norm as a Python float, which a fake tensor cannot give. AdamW is
the for-loop one (CPU tensors; foreach/fused inflate fake peaks); one step warms up (creating
the optimizer state) before the tracker is entered, the next is measured.
"""

from __future__ import annotations

import time
from typing import Any


def trace_config(model_name: str, seq_len: int, micro_batch: int, checkpointing: str = "none",
                 strategy: str = "fsdp"):
    """The TrainConfig of a traced step (bf16-mixed AdamW, the trainer's defaults otherwise)."""
    from shardwise.config.schema import TrainConfig

    return TrainConfig.model_validate({
        "model": {"name": model_name, "attention": "sdpa"},
        "data": {"kind": "synthetic", "synthetic": {"seq_len": seq_len}},
        "strategy": {"name": strategy},
        "precision": "bf16-mixed",
        "checkpointing": {"activation": checkpointing},
        "run": {"micro_batch": micro_batch, "device": "cpu"},
        "hardware": {"gpu": "h100-sxm"},
    })


def trace_fsdp(model_name: str, world: int, seq_len: int, micro_batch: int,
               checkpointing: str = "none", strategy: str = "fsdp") -> dict[str, Any]:
    """Peak bytes per rank by FSDPMemTracker category for one bf16-mixed AdamW step, and the
    RunSpec it ran (so a caller plans exactly that run)."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise.run import run_spec
    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.engines.mesh import build_mesh
    from shardwise.train.model.build import build_model

    t0 = time.perf_counter()
    run = run_spec(trace_config(model_name, seq_len, micro_batch, checkpointing, strategy), world, "cpu",
                   environ={"LOCAL_WORLD_SIZE": str(min(world, 8))})
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = build_mesh(run.layout, "cpu")
        env = DistEnv(rank=0, world_size=world, device="cpu")
        # transformers looks for packed rows in the position ids; fake tensors have no values to
        # look at, so it would keep a packing mask and an explicit [B, 1, S, S] causal mask, which
        # sends SDPA down the path that repeats GQA's K/V heads (saved whole for backward: +2 GiB
        # for llama-3.1-8b at seq 4096). The traced rows are plain causal sequences: a real run
        # finds no packing, skips the mask and runs GQA inside SDPA. Say so to the fake run too.
        with FakeTensorMode(), mock.patch("transformers.masking_utils.find_packed_sequence_indices",
                                          lambda position_ids: None):
            model = build_model(run)
            model.train()
            engine = build_engine(model, run, env, mesh=mesh)

            def one_step():
                ids = torch.randint(0, run.model.vocab_size, (micro_batch, seq_len))
                engine.forward_backward({"input_ids": ids, "labels": ids}, loss_scale=1.0)
                engine.optimizer.step()
                engine.zero_grad()

            one_step()  # warm-up outside the tracker: optimizer state creation is not a step's peak
            tracker = FSDPMemTracker(engine.module, engine.optimizer)
            with tracker:
                one_step()
            snap = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    (dev_stats,) = snap.values()
    parts = {(k.value if hasattr(k, "value") else str(k)): int(v) for k, v in dev_stats.items()}
    return {"parts": parts, "total": parts.pop("Total"), "seconds": time.perf_counter() - t0, "run": run}
