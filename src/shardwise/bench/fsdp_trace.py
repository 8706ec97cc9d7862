"""Full-size FSDP2 memory without GPUs: trace one training step of a catalog model on a fake
process group with fake tensors, under torch's FSDPMemTracker (REFERENCE.md: "Full-size trace
without GPUs"). The tracker attributes every live byte to sharded/unsharded params, grads,
activations, temporaries, all-gather/reduce-scatter buffers and optimizer state; its peak is
what `plan_memory` predicts minus the runtime overhead (CUDA context, NCCL, fragmentation),
which a fake tensor cannot have.

Notes: the device mesh is created outside FakeTensorMode; AdamW runs with foreach=False
(foreach/fused inflate fake peaks); one step warms up (creating the optimizer state) before
the tracker is entered, the next is measured.
"""

from __future__ import annotations

import time
from typing import Any


def trace_fsdp(model_name: str, world: int, seq_len: int, micro_batch: int,
               checkpointing: str = "none", reshard_after_forward: bool = True) -> dict[str, Any]:
    """Peak bytes per rank by FSDPMemTracker category for one bf16-mixed AdamW step."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise import catalog

    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))
        spec = catalog.get_model(model_name)
        cfg = transformers.AutoConfig.for_model(**spec.to_hf_dict())
        cfg._attn_implementation = "sdpa"
        with FakeTensorMode():
            model = transformers.AutoModelForCausalLM.from_config(cfg)
            if checkpointing == "full":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
            fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

            def one_step():
                ids = torch.randint(0, spec.vocab_size, (micro_batch, seq_len))
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, spec.vocab_size), ids.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()

            one_step()  # warm-up outside the tracker: optimizer state creation is not a step's peak
            tracker = FSDPMemTracker(model, opt)
            with tracker:
                one_step()
            snap = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    (dev_stats,) = snap.values()
    parts = {(k.value if hasattr(k, "value") else str(k)): int(v) for k, v in dev_stats.items()}
    return {"parts": parts, "total": parts.pop("Total"), "seconds": time.perf_counter() - t0}
