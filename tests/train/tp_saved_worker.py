"""One rank of the TP saved-for-backward measurement (tests/train/test_tp_saved.py): the bench's
tiny shapes (shardwise.bench.saved) built as the single-process activation test builds them,
the trainer's TP plan applied over all ranks, then the saved-for-backward bytes of one forward on
this rank (storage-deduped, DTensors by their local shard). Rank 0 writes `<shape>-<prec>.json`."""

from __future__ import annotations

import json

import torch
from worker_common import start_worker

from shardwise.train.launch import run_rank_script

LAYERS = 2


def main() -> None:
    runs, env, out = start_worker("shape:precision")
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.bench import saved
    from shardwise.train.tensor_parallel import parallelize

    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))
    for item in runs:
        shape, prec = item.split(":")
        model = parallelize(saved.build_model(shape, LAYERS, prec, "sdpa", "none"), mesh)
        batch = saved.make_batch(saved.SHAPES[shape]["vocab_size"])
        got = saved.saved_activation_bytes(model, batch, precision=prec)
        if env.is_main:
            (out / f"{shape}-{prec}.json").write_text(json.dumps({"saved": got, "world": env.world_size}))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
