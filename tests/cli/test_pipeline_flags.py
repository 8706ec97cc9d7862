"""`shardwise plan --pp-schedule / --pp-virtual-stages`: the schema's strategy.pp_schedule and
strategy.pp_virtual_stages as flags (help and default from the schema), planned into the table's
Strategy and the recommender's sweep, refused naming the flags where the schedule cannot run the
table's stages (specs.pipeline.schedule_refusal: the trainer's bridge asks the same)."""

from __future__ import annotations

import pytest
from test_plan_inputs import flat, plan, plan_json

SLOW_NET = ["--gpus", "16", "--gpus-per-node", "8", "--interconnect", "eth-10"]  # DP across 1 GB/s links


@pytest.mark.parametrize(("args", "needles"), [
    (["--pp-schedule", "zigzag"], ["--pp-schedule 'zigzag'", "gpipe, 1f1b, interleaved-1f1b"]),
    (["--pp-virtual-stages", "0"], ["--pp-virtual-stages 0", "at least 1"]),
    (["--pp-virtual-stages", "2"], ["--pp-virtual-stages 2", "interleaved 1F1B's"]),
    (["--pp-schedule", "interleaved-1f1b"], ["--pp-schedule interleaved-1f1b", "pp_virtual_stages ≥ 2"]),
    (["--pp-schedule", "gpipe", "--pp-virtual-stages", "2"], ["--pp-schedule gpipe --pp-virtual-stages 2"]),
    (["--pp", "1", "--pp-schedule", "gpipe"], ["--pp-schedule gpipe", "--pp is 1"]),
    (["--pp", "4", "--pp-schedule", "1f1b", "--grad-accum", "2"],
     ["--pp 4 --pp-schedule 1f1b with --grad-accum 2", "grad_accum 2 < pp 4"]),
    (["--pp", "4", "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "16", "--grad-accum", "8"],
     ["--pp-virtual-stages 16", "64 stages need a decoder layer each; the model has 32"]),
    (["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "2", "--grad-accum", "5"],
     ["--grad-accum 5", "a multiple of 2"]),
])  # fmt: skip
def test_bad_schedules_are_refused_naming_the_flags(args, needles):
    res = plan(*args)
    assert res.exit_code == 2, res.output
    text = flat(res.output)
    for needle in needles:
        assert needle in text


def test_the_help_is_the_schemas():
    text = flat(plan("--help").output)
    assert "--pp-schedule" in text and "(YAML strategy.pp_schedule; default 1f1b)" in text
    assert "--pp-virtual-stages" in text and "(YAML strategy.pp_virtual_stages; default 1)" in text


def test_a_pinned_schedule_is_the_tables_and_the_recommenders():
    doc = plan_json("--pp", "4", "--pp-schedule", "interleaved-1f1b", "--pp-virtual-stages", "2", "--grad-accum", "8")
    assert {s["pp"] for s in doc["strategies"]} == {4}
    r = doc["recommended_setting"]
    assert (r["pp"], r["pp_schedule"], r["pp_virtual_stages"], r["runnable"]) == (4, "interleaved-1f1b", 2, True)
    assert "pp4 interleaved-1f1b×2" in doc["reason"]


def test_without_pp_the_schedule_applies_to_the_recommenders_pipelines():
    r = plan_json(*SLOW_NET, "--pp-schedule", "gpipe")["recommended_setting"]
    assert r["pp"] > 1 and r["pp_schedule"] == "gpipe" and r["runnable"]
    assert plan_json(*SLOW_NET, "--pp-schedule", "gpipe")["strategies"][0]["pp"] == 1  # the table: pp 1
