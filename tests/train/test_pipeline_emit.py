"""From a plan to a run, for the 3D layouts the planner prices: the emitted shardwise.yaml trains
through `shardwise train` at toy size with the same strategy and schedule, its layout scaled down.

- The textbook 3D example, 64 H100s as TP 8 × PP 4 × DP 2 with FSDP2 inside each stage, as flags:
  `shardwise plan --model llama-3.1-70b --gpus 64 --gpu h100-sxm -s fsdp --tp 8 --pp 4 --emit DIR`.
- The same layout written for DeepSpeed (tests/data/from/ds_zero1_pipeline_tp.json: ZeRO-1 with
  `pipeline.stages` 4 and `tensor_parallel.tp_size` 4): `plan --from` plans it as DeepSpeed runs it
  (plan-only: DeepSpeed's pipeline engine), names the FSDP2 row at that layout, and `-s
  fsdp-grad-op --emit` writes it.
Each emitted file is then run on 8 CPU ranks with a 4-layer Llama (random init) on the bundled
SFT sample (its train_files placeholder set to the sample), scaled down to dp 2 × tp 2 × pp 2 where the plan has pipeline stages (its dp × tp otherwise),
keeping the emitted strategy, schedule and every other section. (`plan --model llama-3.1-70b --gpus 64
--gpu h100-sxm --emit DIR`'s own recommendation is fsdp at pp 1 today; tests/emit/test_emit_pipeline.py
loads it back to the same layout.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
DS_3D = REPO / "tests" / "data" / "from" / "ds_zero1_pipeline_tp.json"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
SEVENTY_B = ["--model", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-sxm"]


def cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=cwd, check=False)


def emitted(out: Path) -> dict:
    return yaml.safe_load((out / "shardwise.yaml").read_text())


def train_scaled_down(emit_dir: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """The emitted YAML, on 8 CPU ranks: a 4-layer Llama (random init from a config.json: room for
    2 stages × 2 virtual stages), the bundled SFT sample, tp/pp scaled down to 2, the schedule kept."""
    from pipeline_worker import CONFIGS

    import shardwise

    doc = emitted(emit_dir)
    st = doc["strategy"]
    pp, tp = (2 if st.get("pp", 1) > 1 else 1), (2 if st.get("tp", 1) > 1 else 1)
    model = tmp / "llama-4l"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIGS["pp-llama"]))
    tokenizer = Path(shardwise.__file__).parent / "assets" / "tokenizer"
    sets = ["model.name=null", f"model.path={model}", "model.random_init=true", f"data.tokenizer={tokenizer}",
            "data.sft.train_files=[]", "data.sft.max_length=64", "run.device=cpu", "precision=fp32", "run.steps=3",
            "run.compile=false", f"strategy.tp={tp}", f"strategy.pp={pp}", f"checkpointing.output_dir={tmp / 'run'}",
            "hardware.check_memory=false", "run.micro_batch=1", "run.grad_accum=4"]
    args = ["train", str(emit_dir / "shardwise.yaml"), "--nproc", "8"]
    for s in sets:
        args += ["--set", s]
    return cli(*args, cwd=tmp, timeout=600), doc


def _ran(proc: subprocess.CompletedProcess, tmp: Path) -> list[dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    return rows


def test_the_3d_example_as_flags_is_emitted_and_trains_scaled_down(tmp_path):
    plan = cli("plan", *SEVENTY_B, "-s", "fsdp", "--tp", "8", "--pp", "4", "--emit", str(tmp_path / "emit"),
               cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    st = emitted(tmp_path / "emit")["strategy"]
    assert (st["name"], st["tp"], st["pp"]) == ("fsdp", 8, 4)
    proc, _ = train_scaled_down(tmp_path / "emit", tmp_path)
    _ran(proc, tmp_path)
    assert f"fsdp tp 2 pp 2 ({st['pp_schedule']}" in proc.stdout + proc.stderr  # the emitted schedule


def test_the_3d_deepspeed_config_is_planned_as_deepspeed_runs_it_then_emitted_as_fsdp2_stages(tmp_path):
    refused = cli("plan", "--from", str(DS_3D), "--gpus", "64", "--gpu", "h100-sxm", "--emit", str(tmp_path / "x"),
                  cwd=tmp_path)
    assert refused.returncode == 2
    assert "zero1 tp4 pp4" in refused.stderr and "add -s fsdp-grad-op to emit that" in refused.stderr
    plan = cli("plan", "--from", str(DS_3D), "--gpus", "64", "--gpu", "h100-sxm", "-s", "fsdp-grad-op", "--emit",
               str(tmp_path / "emit"), cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    st = emitted(tmp_path / "emit")["strategy"]
    assert (st["name"], st["tp"], st["pp"]) == ("fsdp-grad-op", 4, 4)
    proc, _ = train_scaled_down(tmp_path / "emit", tmp_path)
    _ran(proc, tmp_path)
    assert "fsdp-grad-op tp 2 pp 2" in proc.stdout + proc.stderr
