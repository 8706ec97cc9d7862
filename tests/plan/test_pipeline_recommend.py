"""The recommender with the trainer's pipeline: FSDP2 stages are ranked like any runnable row,
model- and run-dependent refusals (specs.pipeline.trainer_pp_gap) make a PP row plan-only with the
reason, the sweep tries interleaved 1F1B where torch's schedule runs it (or keeps to a pinned
schedule), a plan-only pinned layout names the runnable configuration at that layout, and a pinned
layout keeps the global batch of the flags given at it."""

from __future__ import annotations

import pytest

from shardwise.catalog import build_hardware, get_model
from shardwise.config.strategy import StrategyKnobs
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import evaluate
from shardwise.plan.recommend import _complexity, recommend, runnable, sweep, trainer_gaps
from shardwise.specs import Strategy, TrainSpec

M7 = get_model("llama-2-7b")
HW16 = build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8)
BASE = TrainSpec(micro_batch=2, grad_accum=2, checkpointing="full")


def test_fsdp2_stages_are_runnable_rows_and_deepspeed_ones_are_not():
    evals = sweep(M7, HW16, BASE, pps=(2,), tps=(1,), micro_batches=(1,), checkpointing=("full",))
    by = {(e.strategy.name, e.strategy.pp_schedule): e for e in evals}
    assert runnable(by[("fsdp", "1f1b")]) and runnable(by[("fsdp-grad-op", "interleaved-1f1b")])
    assert not runnable(by[("zero1", "1f1b")]) and not runnable(by[("ddp", "1f1b")])
    assert trainer_gaps(by[("zero1", "1f1b")].strategy, by[("zero1", "1f1b")].train, M7) == [
        "pipeline parallelism (pp 2) with zero1"]


def test_the_sweep_tries_interleaved_for_fsdp2_stages_where_it_runs():
    evals = sweep(M7, HW16, BASE, pps=(4,), tps=(1,), checkpointing=("full",))
    schedules = {(e.strategy.engine, e.strategy.pp_schedule, e.strategy.pp_virtual_stages) for e in evals}
    assert ("fsdp2", "interleaved-1f1b", 2) in schedules and ("fsdp2", "1f1b", 1) in schedules
    assert {s for s in schedules if s[0] != "fsdp2"} == {("deepspeed", "1f1b", 1), ("ddp", "1f1b", 1)}
    # where the schedule cannot run it, no interleaved candidate: 4 decoder layers hold 4 stages,
    # not pp 4 × 2 stages a rank
    small = get_model("tiny-llama-bench")
    hw8 = build_hardware(gpu="h100-sxm", gpus=8)
    assert {e.strategy.pp_schedule for e in sweep(small, hw8, BASE, pps=(4,), strategies=["fsdp"])} == {"1f1b"}
    assert "interleaved-1f1b" in {e.strategy.pp_schedule for e in sweep(small, hw8, BASE, pps=(2,),
                                                                          strategies=["fsdp"])}
    pinned = sweep(M7, HW16, BASE, pps=(4,), tps=(1,), checkpointing=("full",),
                   knobs=StrategyKnobs(pp_schedule="gpipe"))
    assert {e.strategy.pp_schedule for e in pinned} == {"gpipe"}


def test_interleaving_is_the_less_simple_on_a_near_tie():
    s1 = Strategy.from_name("fsdp", pp=2)
    s2 = Strategy.from_name("fsdp", pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    e1, e2 = (evaluate(M7, HW16, BASE.model_copy(update={"grad_accum": 4}), s) for s in (s1, s2))
    assert _complexity(e1) < _complexity(e2)


def test_a_tied_model_keeps_its_pipeline_rows_plan_only_with_the_reason():
    m = get_model("qwen2.5-0.5b")
    rec = recommend(m, HW16, BASE, pps=(2,), strategies=["fsdp"], base_layout=(1, 2))
    assert not rec.runnable and rec.tool == "torchtitan"
    assert any("ties lm_head to the input embedding" in g for g in rec.setting()["needs"])
    assert rec.equivalent is None  # nothing runs a tied model in stages
    assert "Plan-only" in rec.reason


def test_a_pinned_deepspeed_pipeline_names_the_runnable_one_at_its_layout():
    rec = recommend(M7, HW16, BASE, pps=(2,), tps=(2,), strategies=["zero1"], base_layout=(2, 2))
    assert not rec.runnable and rec.tool == "Megatron-DeepSpeed"
    eq = rec.equivalent
    assert eq is not None and runnable(eq) and eq.strategy.engine == "fsdp2"
    assert (eq.memory.layout.tp, eq.memory.layout.pp) == (2, 2)
    assert rec.setting()["runnable_equivalent"]["strategy"] == eq.strategy.name
    assert f"shardwise train runs the same layout as {eq.strategy.name} tp2 pp2" in rec.reason


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_pinned_layout_keeps_the_global_batch_given_at_it(tp, pp):
    rec = recommend(M7, HW16, BASE, tps=(tp,), pps=(pp,), strategies=["fsdp"], base_layout=(tp, pp))
    b = rec.best
    dp = HW16.world_size // (tp * pp)
    assert b.train.micro_batch * b.train.grad_accum * b.memory.layout.dp == BASE.micro_batch * BASE.grad_accum * dp


def test_a_schedule_pinned_in_the_knobs_applies_to_pipeline_rows_only():
    k = StrategyKnobs(pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    assert Strategy.with_knobs("fsdp", k).pp_schedule == "1f1b"  # pp 1: no stages to schedule
    s = Strategy.with_knobs("fsdp", k, pp=2)
    assert (s.pp_schedule, s.pp_virtual_stages) == ("interleaved-1f1b", 2)
    for bad in ({"pp_virtual_stages": 2}, {"pp_schedule": "interleaved-1f1b"}, {"pp_schedule": "1f1b",
                                                                              "pp_virtual_stages": 3}):
        with pytest.raises(ShardwiseError, match="interleaved"):
            StrategyKnobs(**bad)
