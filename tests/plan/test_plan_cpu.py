"""`shardwise plan --device cpu`: each strategy's host memory per rank and per node of a run on
CPU ranks, the figure `shardwise train` checks before it starts them and prints beside the
measured peak (shardwise.plan.host_cpu). A shardwise YAML with run.device: cpu plans it so."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.specs.hardware import GIB

ROOT = Path(__file__).resolve().parents[2]


def plan(*args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(app, ["plan", *args, "--json"])
    return r.exit_code, json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}


def test_the_demo_yaml_plans_its_cpu_ranks_as_the_trainer_does():
    from shardwise.config.load import load_config
    from shardwise.run.bridge import run_spec
    from shardwise.train.host_memory import planned_cpu

    code, doc = plan(str(ROOT / "examples" / "demo.yaml"), "--host-memory-gb", "64")
    assert code == 0 and doc["device"] == "cpu", doc
    [row] = doc["strategies"]
    want = planned_cpu(run_spec(load_config(ROOT / "examples" / "demo.yaml"), 2, "cpu"))
    assert row["name"] == "fsdp" and row["host"]["peak"] == want.peak and row["fits"]
    host = row["host"]
    assert host["per_node"] == 2 * host["peak"] + host["launcher"]
    assert host["training"] == host["process"] + host["allocated"] + host["heap_slack"]
    assert doc["from"]["file"].endswith("demo.yaml")


def test_sharding_strategies_hold_less_per_rank_and_a_small_host_fits_none():
    """Full fine-tuning of a 0.5B model on 4 CPU ranks: ddp keeps 16 bytes a parameter on every
    rank, fsdp and zero3 a quarter of them; with 4 GB for the node nothing fits (exit 3)."""
    args = ["--device", "cpu", "-m", "qwen2.5-0.5b", "--gpus", "4", "--seq-len", "256", "-s", "ddp", "-s", "fsdp",
            "-s", "zero3"]
    code, doc = plan(*args, "--host-memory-gb", "512")
    assert code == 0
    peaks = {r["name"]: r["host"]["allocated"] for r in doc["strategies"]}
    params = 494_032_768  # Qwen2.5-0.5B (tied embeddings)
    assert peaks["ddp"] >= 16 * params and peaks["fsdp"] < peaks["ddp"] / 2 and peaks["zero3"] < peaks["ddp"] / 2
    code, doc = plan(*args, "--host-memory-gb", "4")
    assert code == 3 and not any(r["fits"] for r in doc["strategies"])
    assert doc["host_available_source"] == "--host-memory-gb" and doc["host_available_bytes"] == 4e9


def test_a_local_checkpoint_plans_its_load_from_its_own_files(tmp_path):
    """The load phase reads the checkpoint's largest safetensors file, as the trainer will."""
    from transformers import LlamaConfig

    d = tmp_path / "ckpt"
    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1000).save_pretrained(d)
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(3 * GIB)  # sparse: only its size is read
    code, doc = plan("--device", "cpu", "--model-config", str(d), "--gpus", "2", "-s", "ddp",
                     "--host-memory-gb", "64")
    assert code == 0, doc
    load = doc["strategies"][0]["host"]["load"]
    assert load["path"] == "sharded" and load["read"] >= 3 * GIB
    assert any("largest 3.00 GiB" in n for n in doc["notes"])


def test_a_table_names_its_terms_and_emit_is_refused_on_cpu(tmp_path):
    r = CliRunner().invoke(app, ["plan", "--device", "cpu", "-m", "tiny-llama", "--gpus", "2", "-s", "fsdp",
                                 "--host-memory-gb", "64"], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    assert "tiny-llama" in r.output and "2 CPU rank(s)" in r.output and "heap" in r.output
    bad = CliRunner().invoke(app, ["plan", "--device", "cpu", "--emit", str(tmp_path / "e")])
    assert bad.exit_code != 0 and "--emit writes GPU launch configs" in bad.output
    bad = CliRunner().invoke(app, ["plan", "--device", "tpu"])
    assert bad.exit_code != 0 and "--device 'tpu': expected cuda or cpu" in bad.output
