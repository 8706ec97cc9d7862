"""benchmarks/zero3_gathered.py's rule for what DeepSpeed ZeRO-3 (decoder layers as leaves) holds
gathered at the end of forward, against the per-hook trace it measured on CPU
(benchmarks/results/zero3_gathered.json): exact in elements on every rank and step after the
first, and the first step (no trace yet: each module released after its forward) never holds
more than its largest module."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import zero3_gathered as z  # noqa: E402

CASES = json.loads((ROOT / "benchmarks" / "results" / "zero3_gathered.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['model']}-{c['mode']}-{','.join(c['sets']) or 'defaults'}")
def test_rule_matches_the_measured_trace(case):
    ri, knobs = case["rule_inputs"], case["knobs"]
    later = z.leaf_rule(**ri, max_reuse_distance=knobs["max_reuse_distance"], first_step=False)
    first = z.leaf_rule(**ri, max_reuse_distance=knobs["max_reuse_distance"], first_step=True)
    for rank in case["ranks"].values():
        for step, s in rank["steps"].items():
            if step == "1":
                assert s["trace"] == "RECORD" and s["max_gathered"] <= first
            else:
                assert s["trace"] == "COMPLETE"
                assert s["end_of_forward_gathered"] == pytest.approx(later, rel=1e-3)


def test_reuse_distance_not_max_live_bounds_it():
    by = {tuple(c["sets"]): c for c in CASES if c["model"] == "llama-1.36b"}
    base = by[()]["rule"]["later_steps"]
    assert by[("strategy.deepspeed.max_live_parameters=100000000",)]["rule"]["later_steps"] == base
    assert by[("strategy.deepspeed.max_reuse_distance=500000000",)]["rule"]["later_steps"] < base / 1.8
