"""Ranks for tests/train/test_bf16_pure.py: the bench model (shardwise.bench.worker) built and
wrapped by the trainer's own path (TrainConfig -> run bridge -> build_model -> build_engine) on 2
gloo ranks, one optimizer step, and a census of what the engine holds on this rank: the bytes and
dtypes of its parameters (the local shard under FSDP2), of their gradients (after backward,
before the step) and of AdamW's states (after the step). AdamW's `step` counters (one fp32 scalar
per tensor, torch's choice whatever the parameters' dtype) are left out, as the plan leaves them.

A case is `<bench variant>:<precision>` (variants: shardwise.bench.worker.VARIANTS)."""

from __future__ import annotations

from worker_common import measure_ranks


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _census(tensors) -> dict:
    tensors = [_local(t) for t in tensors]
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors})}


def measure(rank: int, case: str) -> dict:
    import torch

    from shardwise.bench import worker
    from shardwise.run import run_spec
    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.model.build import build_model

    variant, precision = case.split(":")
    cfg = worker.bench_config(variant).model_copy(update={"precision": precision})
    run = run_spec(cfg, worker.WORLD, "cpu", environ={})
    engine = build_engine(build_model(run), run, DistEnv(rank=rank, world_size=worker.WORLD, local_rank=rank,
                                                        device="cpu"))
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, run.model.vocab_size, (worker.BATCH, worker.SEQ), generator=g)
    worker.micro_step(engine, {"input_ids": ids, "labels": ids.clone()}, last=True)
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    grads = _census([p.grad for p in trained if p.grad is not None])
    engine.step()
    engine.zero_grad()
    states = _census([t for opt in engine._optimizers() for st in opt.state.values()
                      for k, t in st.items() if k != "step"])
    out = {"engine": engine.name, "params": _census(list(engine.module.parameters())),
           "trained": _census(trained), "grads": grads, "optimizer_states": states}
    engine.close()
    return out


def rank_main(rank: int, names: list[str], out_dir: str) -> None:
    measure_ranks(rank, names, out_dir, measure)
