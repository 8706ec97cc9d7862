"""The 40% rule: a measured step whose exposed communication is over 40% names the strategy the
planner expects to fix it. Expectations are computed here from the planner, not copied."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.bench.advice import COMM_BOUND_SHARE, comm_bound
from shardwise.bench.bench_report import comm_bound_lines
from shardwise.config.strategy import STRATEGY_NAMES
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy, TrainSpec

M = catalog.get_model("llama-2-7b")
# two nodes over 10 GbE: ZeRO-3's gathers cross the slow link every step
HW = catalog.build_hardware(gpu="a100-80g", gpus=16, gpus_per_node=8, inter="eth-10")
TRAIN = TrainSpec(micro_batch=1, grad_accum=1)


def _expected_fix(strategy: Strategy) -> Strategy:
    """The planner's answer, by hand: every strategy `shardwise train` runs, with the run's knobs,
    the fitting one with the least predicted exposed communication (ties: more tokens/s)."""
    best = None
    for name in STRATEGY_NAMES:
        try:
            s = Strategy.from_name(name, ds=strategy.ds, fsdp=strategy.fsdp, ddp=strategy.ddp)
        except ShardwiseError:
            continue
        if not s.trainable:
            continue
        e = evaluate(M, HW, TRAIN, s)
        key = (e.time.exposed_comm_s, -e.time.tokens_per_s_per_gpu)
        if e.fits and (best is None or key < best[0]):
            best = (key, e)
    assert best is not None
    return best[1]


def test_over_the_limit_names_the_planners_fix():
    s = Strategy.from_name("zero3")
    step = 1.0
    verdict = comm_bound(0.6 * step, step, M, HW, TRAIN, s)
    expected = _expected_fix(s)
    assert verdict["bound"] and verdict["measured_share"] == pytest.approx(0.6)
    assert verdict["threshold"] == COMM_BOUND_SHARE == 0.40
    fix = verdict["fix"]
    assert fix["strategy"] == expected.strategy.name
    assert fix["exposed_comm_s"] == pytest.approx(expected.time.exposed_comm_s)
    assert fix["tokens_per_s_per_gpu"] == pytest.approx(expected.time.tokens_per_s_per_gpu)
    assert fix["fits"] is True
    now = evaluate(M, HW, TRAIN, s).time
    assert verdict["current_predicted"]["exposed_comm_s"] == pytest.approx(now.exposed_comm_s)
    assert fix["exposed_comm_s"] <= now.exposed_comm_s
    assert "60%" in verdict["message"] and expected.strategy.name in verdict["message"]


def test_under_the_limit_says_nothing():
    verdict = comm_bound(0.3, 1.0, M, HW, TRAIN, Strategy.from_name("zero3"))
    assert verdict["bound"] is False and "fix" not in verdict and "message" not in verdict
    assert comm_bound(0.4, 1.0, M, HW, TRAIN, Strategy.from_name("zero3"))["bound"] is False  # "more than"
    assert comm_bound(None, None, M, HW, TRAIN, Strategy.from_name("zero3"))["bound"] is False


def test_report_says_so_and_names_the_strategy():
    verdict = comm_bound(0.5, 1.0, M, HW, TRAIN, Strategy.from_name("fsdp"))
    point = {"comm_bound": verdict, "time": {"comparable": True}}
    text = "\n".join(comm_bound_lines(point))
    assert "Communication-bound" in text and verdict["fix"]["strategy"] in text and "50%" in text
    assert comm_bound_lines({"comm_bound": {"bound": False}, "time": {}}) == []
