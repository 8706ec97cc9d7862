"""`shardwise plan --emit` of pipeline rows: a runnable PP row (FSDP2 stages) is written through the
bridge's inverse with strategy.pp, pp_schedule and pp_virtual_stages, loads back to the same
Strategy and layout, gets no accelerate files (accelerate runs neither the trainer's TP nor its
stages) and launch scripts that name the layout; a DeepSpeed pipeline stays plan-only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from shardwise.catalog import build_hardware, get_model
from shardwise.cli.app import app
from shardwise.config.load import load_config
from shardwise.emit import emit_configs
from shardwise.errors import ShardwiseError
from shardwise.run import run_spec
from shardwise.specs import ParallelLayout, Strategy, TrainSpec

ROOT = Path(__file__).resolve().parents[2]
FILLED = ["model.path=", "data.sft.train_files=[train.jsonl]"]  # the placeholders, as a user fills them


def _loaded(out: Path, world: int):
    return run_spec(load_config(out / "shardwise.yaml", FILLED), world, "cuda", environ={})


def test_a_pipeline_row_is_emitted_and_reads_back(tmp_path):
    hw = build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8)
    s = Strategy.from_name("fsdp", tp=2, pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    train = TrainSpec(seq_len=2048, micro_batch=1, grad_accum=8, checkpointing="full")
    paths = {p.name for p in emit_configs(get_model("llama-2-7b"), hw, train, s, tmp_path)}
    assert paths == {"shardwise.yaml", "launch_torchrun.sh", "slurm.sbatch", "README.md"}
    strat = yaml.safe_load((tmp_path / "shardwise.yaml").read_text())["strategy"]
    assert {k: strat[k] for k in ("tp", "pp", "pp_schedule", "pp_virtual_stages")} == {
        "tp": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}
    run = _loaded(tmp_path, hw.world_size)
    assert run.strategy == s and run.layout == ParallelLayout.for_strategy(s, 16, 8)
    planned = "# Planned: fsdp tp 2 × pp 2 (interleaved-1f1b, 2 stages a rank) × dp 4 on 2 node(s)"
    assert planned in (tmp_path / "launch_torchrun.sh").read_text()
    assert "pp 2 (interleaved-1f1b, 2 stages a rank) × dp 4" in (tmp_path / "slurm.sbatch").read_text()
    assert ("Layout: tensor-parallel 2, pipeline-parallel 2 (interleaved-1f1b schedule over the 8 micro-batches "
            "of a step, 2 stages a rank), data-parallel 4") in (tmp_path / "README.md").read_text()


def test_a_deepspeed_pipeline_stays_plan_only(tmp_path):
    out = tmp_path / "emit"
    for args, tool in ((["--emit-strategy", "zero1", "--pp", "2", "--grad-accum", "4"], "DeepSpeed's pipeline engine"),
                       (["--emit-strategy", "zero1", "--pp", "2", "--tp", "2", "--grad-accum", "4"],
                        "Megatron-DeepSpeed")):
        res = CliRunner().invoke(app, ["plan", *args, "--emit", str(out)])
        assert res.exit_code == 2 and "plan-only" in res.output and tool in " ".join(res.output.split())
        assert not out.exists()
    with pytest.raises(ShardwiseError, match="plan-only, run it with Megatron-DeepSpeed"):
        emit_configs(get_model("llama-2-7b"), build_hardware(gpus=16), TrainSpec(grad_accum=4),
                     Strategy.from_name("zero1", tp=2, pp=2), tmp_path / "x")


def test_emit_of_the_70b_recommendation_on_64_h100s(tmp_path):
    """`shardwise plan --model llama-3.1-70b --gpus 64 --gpu h100-sxm --emit DIR`, as a user runs it:
    what it recommends is what shardwise.yaml carries, strategy and layout (with a pipeline: its
    pp, schedule and stages a rank), and the file loads back to that Strategy and ParallelLayout."""
    out = tmp_path / "emit"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "160"}
    res = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--model", "llama-3.1-70b", "--gpus", "64",
                          "--gpu", "h100-sxm", "--emit", str(out), "--json"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    r = doc["recommended_setting"]
    assert r["runnable"] and r["tool"] == "shardwise train"
    assert {k: doc["emitted_setting"][k] for k in ("strategy", "tp", "pp", "pp_schedule", "pp_virtual_stages")} == {
        k: r[k] for k in ("strategy", "tp", "pp", "pp_schedule", "pp_virtual_stages")}
    strat = yaml.safe_load((out / "shardwise.yaml").read_text())["strategy"]
    assert strat["name"] == r["strategy"] and strat.get("tp", 1) == r["tp"] and strat.get("pp", 1) == r["pp"]
    if r["pp"] > 1:
        assert (strat["pp_schedule"], strat["pp_virtual_stages"]) == (r["pp_schedule"], r["pp_virtual_stages"])
    run = _loaded(out, 64)
    want = Strategy.from_name(r["strategy"], tp=r["tp"], pp=r["pp"],
                              **({"pp_schedule": r["pp_schedule"], "pp_virtual_stages": r["pp_virtual_stages"]}
                                 if r["pp"] > 1 else {}))
    assert (run.strategy.name, run.strategy.tp, run.strategy.pp, run.strategy.pp_schedule,
            run.strategy.pp_virtual_stages) == (want.name, want.tp, want.pp, want.pp_schedule, want.pp_virtual_stages)
    assert run.layout == ParallelLayout.for_strategy(want, 64, 8)
    row = next(s for s in doc["strategies"] if s["name"] == r["strategy"]) if r["tp"] == r["pp"] == 1 else None
    assert row is None or (row["dp"], row["dp_shard"]) == (run.layout.dp, run.layout.dp_shard)
    assert (run.train.micro_batch, run.train.grad_accum, run.train.checkpointing) == (
        r["micro_batch"], r["grad_accum"], r["checkpointing"])
