"""Ranks for tests/train/test_activation_offload.py: the bench model (shardwise.bench.worker) under
FSDP2 on 2 gloo ranks with `checkpointing.offload`, one micro-batch per checkpointing mode (none,
full), recording what the offloader moved off the device: the peak of bytes it held on the host
at once during the micro-batch (what would otherwise have stayed on the device at the end of
forward), the bytes it moved, and what it still held after backward."""

from __future__ import annotations

from worker_common import measure_ranks


def measure(rank: int, activation: str) -> dict[str, int]:
    import torch

    from shardwise.bench import worker
    from shardwise.run import run_spec
    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.model import activation_offload
    from shardwise.train.model.build import build_model

    cfg = worker.bench_config("fsdp")
    cfg = cfg.model_copy(update={"checkpointing": cfg.checkpointing.model_copy(
        update={"offload": True, "activation": activation})})
    run = run_spec(cfg, worker.WORLD, "cpu", environ={})
    engine = build_engine(build_model(run), run, DistEnv(rank=rank, world_size=worker.WORLD, local_rank=rank,
                                                        device="cpu"))
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, run.model.vocab_size, (worker.BATCH, worker.SEQ), generator=g)
    worker.micro_step(engine, {"input_ids": ids, "labels": ids.clone()}, last=True)
    stats = activation_offload.stats(engine.module)
    engine.step()
    engine.zero_grad()
    engine.close()
    return {"peak": stats.last_peak_bytes, "moved": stats.last_bytes, "after_backward": stats.host_bytes}


def rank_main(rank: int, names: list[str], out_dir: str) -> None:
    measure_ranks(rank, names, out_dir, measure)
