"""`shardwise bench` and `shardwise calibrate` under an outer launcher (torchrun, 2 CPU ranks):
each process is a rank (nothing is spawned), the results are gathered over the process group,
rank 0 writes the outputs. A two-point sweep shares one process group across the points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from test_bench_cli import CONFIG, PARTS, TOL_STATES

pytestmark = pytest.mark.distributed
SRC = str(Path(__file__).parents[2] / "src")


def _torchrun(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SHARDWISE_LAUNCHED"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "shardwise.cli.app", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_under_torchrun_acts_as_the_ranks(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    out = tmp_path / "out"
    r = _torchrun("bench", str(cfg), "--steps", "3", "--out", str(out), "--set", "run.timeout_s=60",
                  "--sweep", "strategy.name=ddp,zero3", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("predicted vs measured") == 1  # rank 0 prints the table, rank 1 nothing
    doc = json.loads((out / "bench.json").read_text())
    assert doc["launcher"] == "torchrun"
    assert [p["strategy"] for p in doc["points"]] == ["ddp", "zero3"]
    for p in doc["points"]:
        assert p["world_size"] == 2 and sorted(p["memory_by_phase"]) == ["rank0", "rank1"]
        for term in (*PARTS, "model_states"):
            v = p["model_states"][term]
            if v["measured"]:
                assert abs(v["rel_error"]) <= TOL_STATES, (p["label"], term, v)
        assert p["time"]["terms"]["step"]["measured"] > 0
        assert p["time"]["terms"]["exposed_comm"]["measured"] > 0
        assert sorted(p["memory_timeline"]["ranks"]) == ["rank0", "rank1"]
    # no spawned ranks: each launched process wrote its own result where spawn's ranks do
    assert sorted(f.name for f in (out / "runs").glob("*/bench/rank*.json")) == ["rank0.json"] * 2 + ["rank1.json"] * 2
    assert (out / "report.md").is_file() and (out / "time.png").is_file()


def test_calibrate_under_torchrun_measures_across_the_launched_ranks(tmp_path):
    out = tmp_path / "profile.json"
    r = _torchrun("calibrate", "--quick", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    c = doc["raw"]["collectives"]
    assert c["world"] == 2 and c["local_world"] == 2 and set(c["levels"]) == {"intra"}  # one node of 2
    assert doc["intra"]["bus_bytes_per_s"] > 0 and "inter" not in doc
