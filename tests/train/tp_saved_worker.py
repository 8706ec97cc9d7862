"""One rank of the TP saved-for-backward measurement (tests/train/test_tp_saved.py): the bench's
tiny shapes (shardwise.bench.saved) built as the single-process activation test builds them,
split over all ranks by the trainer's TP plan (`<shape>:<prec>`: DTensor, FSDP2's) or by
DeepSpeed's AutoTP inside `deepspeed.initialize` (`<shape>:<prec>:autotp`: ZeRO-1 × TP, the
trainer's `tensor_parallel` block), then the saved-for-backward bytes of one forward on this rank
(storage-deduped, DTensors by their local shard). Rank 0 writes `<shape>-<prec>[-autotp].json`."""

from __future__ import annotations

import json

import torch
from worker_common import start_worker

from shardwise.train.launch.rank import run_rank_script

LAYERS = 2


def autotp(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    """`model` with its decoder linears split by DeepSpeed's AutoTP (ZeRO-1, every rank one TP group)."""
    import deepspeed

    from shardwise.run.deepspeed import autotp_section

    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": tp, "zero_optimization": {"stage": 1},
              "tensor_parallel": autotp_section(tp)}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    return engine.module


def main() -> None:
    runs, env, out = start_worker("shape:precision")
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.bench import saved
    from shardwise.train.model.tensor_parallel import parallelize

    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))
    for item in runs:
        shape, prec, *scheme = item.split(":")
        model = saved.build_model(shape, LAYERS, prec, "sdpa", "none")
        model = autotp(model, env.world_size) if scheme == ["autotp"] else parallelize(model, mesh)
        batch = saved.make_batch(saved.SHAPES[shape]["vocab_size"])
        got = saved.saved_activation_bytes(model, batch, precision=prec)
        if env.is_main:
            name = "-".join([shape, prec, *scheme])
            params = sum(getattr(q, "_local_tensor", q).numel() for q in model.parameters())  # this rank's
            (out / f"{name}.json").write_text(json.dumps({"saved": got, "params": params, "world": env.world_size}))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
