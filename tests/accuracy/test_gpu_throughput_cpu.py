"""benchmarks/gpu_throughput.py at tiny size on CPU: every H200 case's strategy, activation
setting and model family runs through the trainer and learns (correctness only: CPU speed says
nothing about a GPU, and speed targets live in the benchmark's own results)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).parents[2]


def test_every_case_runs_and_learns_on_cpu(tmp_path):
    out = tmp_path / "gt.json"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["cases"]
    cases = json.loads((ROOT / "benchmarks" / "measurements" / "h200-trainer-cases.json").read_text())["cases"]
    assert [r["name"] for r in rows] == [c["name"] for c in cases]
    ran = [r for r in rows if "skipped" not in r]
    assert {r["strategy"] for r in ran} >= {"ddp", "fsdp", "zero2", "zero3"}
    assert {r["engine"] for r in ran} == {"ddp", "fsdp2", "deepspeed"}  # --cpu keeps fsdp on fully_shard
    for r in rows:
        assert ("skipped" in r) == ("offload" in next(c["strategy"] for c in cases if c["name"] == r["name"]))
    for r in ran:  # the engine that ran: FSDP2 on one rank may run as DDP (strategy.fsdp.single_rank)
        assert r["engine"] == r["now"]["engine"] in ({"ddp", "fsdp2"} if r["strategy"].startswith("fsdp") else
                                                     {"ddp"} if r["strategy"] == "ddp" else {"deepspeed"})
        losses = r["now"]["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (r["name"], losses)
        assert r["now"]["tokens_per_s"] > 0
