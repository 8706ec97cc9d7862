"""Published training runs (benchmarks/published/*.yaml): well-formed, traceable, and every
expressible run evaluates. Accuracy bands are not asserted here (the time model is being
calibrated against these numbers; benchmarks/accuracy.py reports them)."""

from __future__ import annotations

import datetime
import math
from pathlib import Path

import pytest
import yaml
from bench_scripts import load

from shardwise.specs import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "benchmarks" / "published"


def _load_accuracy():
    return load("accuracy")


accuracy = _load_accuracy()
RUNS = accuracy.load_runs(PUBLISHED)
FILES = sorted(PUBLISHED.glob("*.yaml"))


def test_there_are_sources_and_runs():
    assert len(FILES) >= 5
    compared = [r for r in RUNS if not r.get("skip")]
    assert len(compared) >= 25


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_source_block(path):
    doc = yaml.safe_load(path.read_text())
    assert set(doc) == {"source", "runs"}
    src = doc["source"]
    for k in accuracy.SOURCE_KEYS:
        assert k in src, f"{path.name}: source lacks {k}"
    assert src["id"] == path.stem, "one file per source, named by its id"
    assert src["url"].startswith("https://")
    assert datetime.date.fromisoformat(str(src["retrieved"])) >= datetime.date(2026, 12, 1)  # when collected
    if "repo" in src:
        assert len(src["commit"]) == 40 and src.get("path")
    for extra in src.get("also", []):
        assert extra["url"].startswith("https://")
    names = [r["name"] for r in doc["runs"]]
    assert len(names) == len(set(names)), f"{path.name}: duplicate run names"


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r['_source']['id']}:{r['name']}")
def test_run_schema(run):
    assert accuracy.schema_errors(run) == []
    pub = run["published"]
    assert isinstance(pub["trained"], bool)
    assert run["quote"].strip()
    if run.get("skip"):
        return
    for k in ("gpus", "seq_len", "micro_batch"):
        assert isinstance(run[k], int) and run[k] > 0
    assert run.get("tp", 1) * run.get("pp", 1) <= run["gpus"]
    if "global_batch" in run:
        dp = run["gpus"] // (run.get("tp", 1) * run.get("pp", 1) * run.get("cp", 1))  # a CP group shares its rows
        assert run["global_batch"] == dp * run["micro_batch"] * run.get("grad_accum", 1)
    for k in ("tokens_per_s_per_gpu", "mfu", "hfu", "tflops_per_gpu", "peak_memory_gib"):
        if k in pub:
            assert isinstance(pub[k], (int, float)) and pub[k] > 0 and math.isfinite(pub[k])
    for k in ("mfu", "hfu"):
        if k in pub:
            assert pub[k] < 1, "utilisation is a fraction"
    if pub["trained"] is False:
        assert "tokens_per_s_per_gpu" not in pub
    for k in pub.get("derived", {}):
        assert k in pub, f"derived {k} has no value"
    if isinstance(run["model"], dict):
        # a config of its own family (llama-style, mpt, gpt2 field names): the planner reads it
        # the way transformers does, and names any field it lacks
        assert "model_type" in run["model"] and "vocab_size" in run["model"]
        spec = ModelSpec.from_hf_dict(dict(run["model"]), source=run["name"])
        assert spec.params > 0


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r['_source']['id']}:{r['name']}")
def test_compare_runs(run):
    out = accuracy.compare(run)
    assert out["name"] == run["name"]
    if run.get("skip"):
        assert out["skipped"] == run["skip"]
        return
    assert "error" not in out, out.get("error")
    assert out["predicted_tokens_per_s_per_gpu"] > 0
    assert 0 < out["predicted_mfu"] < 1
    assert 0 < out["predicted_allocated_gib"] <= out["predicted_reserved_gib"] <= out["predicted_total_gib"]
    if "peak_memory_gib" in run["published"]:
        assert math.isfinite(out["memory_rel_err"])
    if "tokens_per_s_per_gpu" in run["published"]:
        assert math.isfinite(out["tokens_rel_err"])
    if run.get("fits_unknown"):  # the memory depends on a setting the source does not publish
        assert out["false_oom"] is False and out["missed_oom"] is False and out["fits_unknown"]
    else:
        assert out["false_oom"] == ((not out["fits"]) and run["published"]["trained"])


def test_report_is_consistent(tmp_path):
    report = accuracy.run_all(PUBLISHED)
    s = report["summary"]
    assert s["runs"] == len(RUNS)
    assert s["compared"] + s["skipped"] + s["errors"] == s["runs"]
    assert s["errors"] == 0
    md = accuracy.to_markdown(report)
    for sid, block in report["by_source"].items():
        assert block["url"] in md and sid in md
    assert accuracy.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "accuracy_published.json").exists()
    assert (tmp_path / "accuracy_published.md").read_text() == md


def test_no_false_oom_on_a_run_that_trained():
    """Every published run that trained, and whose memory the planner can express, is planned to
    fit the device's memory (docs/accuracy.md "Fits")."""
    results = [accuracy.compare(r) for r in RUNS if not r.get("skip")]
    false_oom = [r["name"] for r in results if r["false_oom"]]
    assert not false_oom, false_oom
    judged = [r for r in results if r["trained"] and not r.get("fits_unknown")]
    assert len(judged) >= 200  # the claim covers the collection, not a handful
