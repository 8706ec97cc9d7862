"""`shardwise train examples/demo.yaml --set strategy.pp=2` end to end on 2 CPU ranks, as a user
runs it: it trains the losses the same command trains without stages (fsdp on 2 data ranks, the
same global batch), evaluates, checkpoints, resumes, and its final export loads with
`from_pretrained`. Refusals come before any rank starts, with the field named and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.yaml"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
STEPS = 6


def train(out: Path, *sets: str, timeout: int = 300, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.cli", "train", str(DEMO), "--set", f"run.steps={STEPS}",
            "--set", f"checkpointing.output_dir={out}", "--set", "precision=fp32", "--set", "optimizer.eps=1e-5"]
    for s in sets:
        argv += ["--set", s]
    argv += list(extra)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=out.parent, check=False)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-cli")
    # the demo's 2 ranks as 2 data ranks (micro-batch 4 × 2) and as 2 stages (micro-batch 8 on one data rank)
    ref = train(root / "fsdp")
    pp = train(root / "pp2", "strategy.pp=2", "run.micro_batch=8", "checkpointing.save_every_steps=3")
    return root, ref, pp


def test_pipeline_run_through_the_cli_matches_the_data_parallel_one(runs):
    root, ref, pp = runs
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    assert pp.returncode == 0, pp.stdout[-2000:] + pp.stderr[-2000:]
    assert "fsdp pp 2 (1f1b) on 2 rank(s)" in pp.stdout + pp.stderr
    a, b = losses(root / "pp2"), losses(root / "fsdp")
    assert len(a) == STEPS and max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)) <= 1e-5, (a, b)
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(root / "pp2" / "model", dtype=torch.float32).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(root / "fsdp" / "model", dtype=torch.float32).state_dict()
    worst = max(float((ours[k] - theirs[k]).norm() / theirs[k].norm()) for k in theirs if theirs[k].norm() > 0)
    assert worst <= 1e-5


def test_resume_latest_continues_a_pipeline_run(runs):
    root, _, pp = runs
    assert pp.returncode == 0
    again = train(root / "pp2", "strategy.pp=2", "run.micro_batch=8", f"run.steps={STEPS + 2}",
                  extra=("--resume", "latest"))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert len(losses(root / "pp2")) == STEPS + 2


@pytest.mark.parametrize("sets, needle", [
    (["strategy.pp=2", "strategy.name=zero2"], "strategy 'zero2' cannot run with pipeline parallelism"),
    (["strategy.pp=2", "run.grad_accum=1"], "grad_accum 1 < pp 2"),
    (["strategy.pp=2", "strategy.pp_schedule=interleaved-1f1b", "strategy.pp_virtual_stages=2"],
     "need a decoder layer each"),
])
def test_refused_before_any_rank_starts(tmp_path, sets, needle):
    proc = train(tmp_path / "out", *sets, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_bench_refuses_a_pipeline_layout_naming_the_field(tmp_path):
    argv = [sys.executable, "-m", "shardwise.cli", "bench", str(DEMO), "--set", "strategy.pp=2", "--set",
            "run.micro_batch=8", "--steps", "3", "--out", str(tmp_path / "bench")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "strategy.pp 2" in proc.stderr and "Traceback" not in proc.stderr
