"""benchmarks/packed_attention.py and its committed result: attention per step at
seq 2048 on CPU for the dense mask and the default mask-free path. The committed file has both
paths for both document mixes, its bundled-data row is the one the data packs today, and the
script still writes that structure (run here at seq 128, without FlexAttention's compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "packed_attention.py"
RESULT = ROOT / "benchmarks" / "results" / "packed_attention.json"
ATTENTION = {"dense", "sdpa_varlen", "causal"}
FLEX = {"flex_forward", "dense_forward", "sdpa_varlen_forward"}


def structure(doc: dict) -> dict:
    return {"top": sorted(doc), "config": sorted(doc["config"]), "cases": [
        (c["documents"], sorted(c), sorted(set(c["attention"]) - FLEX), sorted(c["model_step"])) for c in doc["cases"]]}


def test_committed_result_times_both_paths_at_seq_2048():
    doc = json.loads(RESULT.read_text())
    assert doc["script"] == "benchmarks/packed_attention.py" and doc["config"]["seq"] == 2048 and doc["config"]["flex"]
    assert [c["documents"] for c in doc["cases"]] == ["bundled sample data", "4 documents of S/4"]
    for c in doc["cases"]:
        att, step = c["attention"], c["model_step"]
        assert sum(c["lengths"]) == 2048 and len(c["lengths"]) >= 4  # several documents in the row
        assert c["sum_n2_over_s2"] == pytest.approx(sum(n * n for n in c["lengths"]) / 2048 ** 2)
        assert set(att) == ATTENTION | FLEX and set(step) == {"dense", "sdpa_varlen"}
        assert c["speedup_attention"] == pytest.approx(att["dense"]["median_s"] / att["sdpa_varlen"]["median_s"])
        assert c["speedup_step"] == pytest.approx(step["dense"]["median_s"] / step["sdpa_varlen"]["median_s"])
        # what the result says: the mask-free path is faster, and the full square costs more than causal
        assert att["sdpa_varlen"]["median_s"] < att["causal"]["median_s"] < att["dense"]["median_s"]
        assert step["sdpa_varlen"]["median_s"] < step["dense"]["median_s"]


def test_committed_bundled_row_is_what_the_data_packs_today():
    sys.path.insert(0, str(SCRIPT.parent))
    import packed_attention as bench

    doc = json.loads(RESULT.read_text())
    assert doc["cases"][0]["lengths"] == bench._full(bench._bundled_lengths(2048), 2048)


def test_the_script_writes_that_structure(tmp_path):
    out = tmp_path / "pa.json"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seq", "128", "--reps", "1", "--no-flex", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh, committed = json.loads(out.read_text()), json.loads(RESULT.read_text())
    assert structure(fresh) == structure(committed)
    assert not FLEX & set(fresh["cases"][0]["attention"])
