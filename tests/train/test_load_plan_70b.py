"""The 70B load without GPUs: llama-2-70b built on the meta device as the trainer builds it from a
checkpoint (shardwise.train.model.weights.meta_model), sharded by FSDP2 on a fake process group of 8 and
64 ranks; rank 0's shard bytes (what `weights.materialize` allocates and reads) equal the part the
planner books for the load (shardwise.plan.load, `resident` on a CPU-resident run), and
`shardwise plan --json` reports the load phase per rank and per node."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.config.schema import TrainConfig
from shardwise.plan.load import load_phase
from shardwise.run import run_spec


def _config(path: str, lora: bool) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"path": path},
        "data": {"kind": "synthetic", "synthetic": {"samples": 8, "seq_len": 8, "seed": 7}},
        "strategy": {"name": "fsdp"},
        "precision": "bf16-mixed",
        "run": {"steps": 1, "micro_batch": 1, "grad_accum": 1, "device": "cpu", "compile": False},
        "logging": {"progress": False, "tensorboard": False},
        "lora": {"rank": 16, "alpha": 32, "target_modules": "all-linear"} if lora else None,
    })


@pytest.fixture(scope="module")
def llama70b_dir(tmp_path_factory):
    from transformers import AutoConfig

    from shardwise.catalog import get_model

    d = tmp_path_factory.mktemp("llama-2-70b")
    AutoConfig.for_model(**get_model("llama-2-70b").to_hf_dict()).save_pretrained(d)
    return d


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rank0_shard_bytes_are_the_planned_part(llama70b_dir, world, lora):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise.train.engines.fsdp import shard_model
    from shardwise.train.engines.mesh import build_mesh
    from shardwise.train.model.build import attention_implementation
    from shardwise.train.model.lora import apply_lora
    from shardwise.train.model.weights import defer, meta_model

    run = run_spec(_config(str(llama70b_dir), lora), world, "cpu", environ={"LOCAL_WORLD_SIZE": "8"})
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        model = meta_model(run, attention_implementation(run))
        if lora:
            model = apply_lora(model, run)  # adapters initialised on CPU, moved to meta by defer
        defer(model, run)
        sharded = shard_model(model, run, build_mesh(run.layout, "cpu"), torch.device("cpu"))
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in sharded.parameters())
    finally:
        dist.destroy_process_group()
    planned = load_phase(run.model, run.train, run.engine_strategy, run.layout, 8, device="cpu")
    assert planned.path == "sharded"
    # FSDP2 pads each tensor's rows to a multiple of the world: rank 0 holds ceil(rows / N) rows
    assert abs(local / planned.resident - 1) < 0.01, (local, planned.resident)
    full_fp32 = 4 * run.model.params
    assert local < full_fp32 / world * 1.01  # never the whole model per rank
    if not lora:
        assert abs(local - full_fp32 / world) / (full_fp32 / world) < 0.01


@pytest.mark.parametrize("gpus", [8, 64])
def test_plan_json_shows_the_load_per_rank_and_node(gpus):
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    res = CliRunner().invoke(app, ["plan", "--model", "llama-2-70b", "--gpus", str(gpus), "--gpus-per-node", "8",
                                   "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    rows = {r["name"]: r for r in doc["strategies"]}
    fsdp = rows["fsdp"]["host_memory"]["load"]
    assert fsdp["path"] == "sharded" and fsdp["ranks_per_node"] == 8
    assert fsdp["per_node"] == pytest.approx(8 * fsdp["per_rank"])
    # on GPUs the shards land on the device: the host holds the read window and the process,
    # a fraction of the 280 GB fp32 copy per rank the whole-model build needed
    assert fsdp["per_rank"] < 0.02 * 4 * 69e9
    zero3 = rows["zero3"]["host_memory"]["load"]
    assert zero3["path"] == "zero3" and zero3["per_rank"] < 0.02 * 4 * 69e9
