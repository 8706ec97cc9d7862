"""Parallel layout validation and the `shardwise plan` command: output schema and refusals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app
from shardwise.config.strategy import STRATEGY_NAMES
from shardwise.errors import ShardwiseError
from shardwise.specs import ParallelLayout, Strategy

runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["plan", *args])


def test_layout_product_must_equal_world():
    with pytest.raises(ShardwiseError, match=r"dp_replicate 1 × dp_shard 3 × tp 2 × pp 1 = 6.*8 GPUs"):
        ParallelLayout(world_size=8, dp_shard=3, tp=2)


def test_layout_for_strategy():
    lay = ParallelLayout.for_strategy(Strategy.from_name("fsdp-hybrid"), world_size=32, gpus_per_node=8)
    assert (lay.dp_shard, lay.dp_replicate) == (8, 4)
    lay = ParallelLayout.for_strategy(Strategy.from_name("fsdp", tp=2, pp=2), world_size=16, gpus_per_node=8)
    assert (lay.dp_shard, lay.tp, lay.pp) == (4, 2, 2)
    lay = ParallelLayout.for_strategy(Strategy.from_name("zero1", tp=2, pp=2), world_size=16, gpus_per_node=8)
    assert (lay.dp_shard, lay.tp, lay.pp) == (4, 2, 2)


def test_pipeline_refuses_zero2_and_zero3():
    # DeepSpeed's PipelineEngine asserts ZeRO stage < 2; FSDP2 and ZeRO-0/1 combine with PP.
    for name in ("zero2", "zero3", "zero2+opt-offload", "zero3+full-offload"):
        with pytest.raises(ShardwiseError, match=r"cannot run with pipeline parallelism \(pp 2\)"):
            Strategy.from_name(name, pp=2)
    for name in ("ddp", "zero0", "zero1", "fsdp", "fsdp-hybrid"):
        assert Strategy.from_name(name, pp=2).pp == 2
    lay = ParallelLayout.for_strategy(Strategy.from_name("ddp"), world_size=4, gpus_per_node=4)
    assert (lay.dp_shard, lay.dp_replicate) == (1, 4)


def test_tp_pp_not_dividing_gpus():
    with pytest.raises(ShardwiseError, match=r"tp 3 × pp 1 = 3 does not divide the 8 GPUs"):
        ParallelLayout.for_strategy(Strategy.from_name("zero1", tp=3), world_size=8, gpus_per_node=8)


def test_heads_not_divisible_by_tp():
    m = catalog.get_model("qwen2.5-0.5b")  # 14 heads
    lay = ParallelLayout(world_size=8, tp=4, dp_shard=2)
    with pytest.raises(ShardwiseError, match=r"tp 4 does not divide the 14 attention heads"):
        lay.check_model(m)


def test_unknown_strategy_lists_valid():
    with pytest.raises(ShardwiseError) as e:
        Strategy.from_name("zero4")
    for name in ("zero3", "fsdp-grad-op", "zero3+full-offload"):
        assert name in str(e.value)


def test_default_plan_table():
    res = run()
    assert res.exit_code == 0, res.output
    assert "llama-2-7b" in res.output and "a100-80g" in res.output
    for name in STRATEGY_NAMES:
        assert name in res.output


def test_json_schema():
    res = run("--json", "--model", "llama-2-13b", "--gpus", "16")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["model"]["name"] == "llama-2-13b" and doc["model"]["params"] == catalog.get_model("llama-2-13b").params
    assert doc["hardware"]["gpus"] == 16 and doc["hardware"]["nodes"] == 2
    assert doc["train"]["seq_len"] == 2048
    names = [s["name"] for s in doc["strategies"]]
    assert names == list(STRATEGY_NAMES)
    for s in doc["strategies"]:
        assert {"name", "engine", "tp", "pp", "dp", "fits", "memory", "host_memory"} <= set(s)
        parts = {"params", "grads", "master_params", "optimizer_states", "step_buffers", "activations", "recompute",
                 "logits", "engine_buffers", "gathered_params", "held_grads", "grad_buffers", "cuda_context",
                 "nccl", "allocator_slack", "allocator_unreclaimable", "runtime_overhead", "allocated", "reserved",
                 "total", "required", "ref_params", "ref_forward", "not_at_peak"}
        assert parts == set(s["memory"])
        assert s["memory"]["total"] <= sum(v for k, v in s["memory"].items() if k not in ("total", "required"))
        assert s["memory"]["allocated"] <= s["memory"]["required"] <= s["memory"]["total"]
        assert "total" in s["host_memory"]
        assert s["tp"] * s["pp"] * s["dp"] == 16


def test_params_and_model_config(tmp_path):
    res = run("--json", "--params", "7e9", "-s", "zero2")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["model"]["params"] == catalog.get_model("llama-2-7b").params
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(catalog.get_model("mistral-7b").to_hf_dict()))
    res = run("--json", "--model-config", str(cfg), "-s", "fsdp")
    assert json.loads(res.output)["model"]["params"] == catalog.get_model("mistral-7b").params


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "llama-3.1-7b"], "unknown model 'llama-3.1-7b'"),
        (["--gpu", "a100"], "a100-80g"),
        (["--interconnect", "infiniband"], "ib-200"),
        (["--strategy", "zero4"], "zero3"),
        (["--gpus", "8", "--tp", "3"], "tp 3 × pp 1 = 3 does not divide the 8 GPUs"),
        (["--gpus", "8", "--tp", "2", "--pp", "8"], "exceeds the 8 GPUs"),
        (["--model", "qwen2.5-0.5b", "--tp", "4"], "does not divide the 14 attention heads"),
        (["--precision", "fp8"], "precision"),
        (["--gpus", "12", "--gpus-per-node", "8"], "not a multiple"),
    ],
)
def test_bad_input_is_refused_clearly(args, needle):
    res = run(*args)
    assert res.exit_code == 2
    assert needle in " ".join(res.output.split())


def test_malformed_model_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    res = run("--model-config", str(cfg))
    assert res.exit_code == 2
    assert "num_hidden_layers" in res.output


def test_planner_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, shardwise.cli.app, shardwise.plan; shardwise.plan.plan_memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
