"""DeepSpeed's `overlap_comm` in the time model, as DeepSpeed runs it
(deepspeedai/DeepSpeed@edaa722, runtime/zero/stage_1_and_2.py and stage3.py):

- ZeRO-2 reduces gradient buckets in the backward hooks either way; with overlap_comm on a side
  stream (`reduction_stream`), without it on the compute stream (`current_stream()`): then the
  reduction adds to the step in full.
- ZeRO-1 reduces in the hooks only with overlap_comm (and only in the boundary micro-batch's
  backward); without it the engine reduces every gradient after backward (`reduce_gradients`).
- ZeRO-3 without overlap_comm runs its reduce-scatters and its parameter all-gathers on the
  default stream: nothing is prefetched behind compute.
- DeepSpeed's default is overlap_comm on for stage 3 only (runtime/zero/config.py
  `overlap_comm_valid`).

Byte counts are derived here from Llama-2-7B's Ψ; the time relations are the step's parts."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.config.strategy import DeepSpeedKnobs
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy, TrainSpec

M7 = catalog.get_model("llama-2-7b")
PSI = M7.params
HW16 = catalog.build_hardware(gpus=16, gpus_per_node=8)  # 2 nodes: the reduction crosses the network


def _time(name: str, k: int, overlap: bool | None):
    knobs = DeepSpeedKnobs() if overlap is None else DeepSpeedKnobs(overlap_comm=overlap)
    e = evaluate(M7, HW16, TrainSpec(grad_accum=k), Strategy.from_name(name, ds=knobs))
    return e.comm, e.time


@pytest.mark.parametrize("k", [1, 4])
def test_zero2_without_overlap_adds_the_reduction_to_the_step(k):
    on_comm, on = _time("zero2", k, True)
    off_comm, off = _time("zero2", k, False)
    # same traffic (bf16 all-reduce of every gradient each micro-batch, one all-gather of the
    # updated params) and the same GPU work; only what hides differs
    assert off_comm.all_reduce == on_comm.all_reduce == pytest.approx(2 * PSI * k)
    assert off.comm_s == on.comm_s and off.compute_s == on.compute_s
    # with overlap the backward hides part of the reduction; without it nothing is hidden
    hidden = on.comm_s - on.exposed_comm_s
    assert hidden > 0.5 * on.comm_s
    assert off.exposed_comm_s == pytest.approx(off.comm_s)
    # the step is longer by exactly the reduction time overlap had hidden
    assert off.step_s - on.step_s == pytest.approx(hidden)


def test_zero1_reduces_after_backward_without_overlap():
    for k in (1, 4):
        on_comm, on = _time("zero1", k, True)
        off_comm, off = _time("zero1", k, False)
        assert off_comm.all_reduce == on_comm.all_reduce == pytest.approx(2 * PSI)  # once per step
        assert off.exposed_comm_s == pytest.approx(off.comm_s)
        assert off.step_s - on.step_s == pytest.approx(on.comm_s - on.exposed_comm_s)
        assert off.step_s > on.step_s
    # with overlap, ZeRO-1 reduces in the boundary micro-batch's backward hooks only: the same
    # bytes hide behind a quarter of the backward at accumulation 4, so no more is hidden there
    _, on1 = _time("zero1", 1, True)
    _, on4 = _time("zero1", 4, True)
    assert on4.comm_s == on1.comm_s
    assert on4.exposed_comm_s >= on1.exposed_comm_s


def test_zero3_without_overlap_prefetches_nothing():
    _, on = _time("zero3", 1, True)
    _, off = _time("zero3", 1, False)
    assert on.exposed_comm_s < 0.5 * on.comm_s
    assert off.exposed_comm_s == pytest.approx(off.comm_s)
    assert off.step_s - on.step_s == pytest.approx(on.comm_s - on.exposed_comm_s)


@pytest.mark.parametrize("name, default", [("zero1", False), ("zero2", False), ("zero3", True)])
def test_default_is_deepspeeds(name, default):
    assert _time(name, 2, None)[1] == _time(name, 2, default)[1]


def test_zero0_is_not_changed_by_the_knob():
    assert _time("zero0", 1, True)[1] == _time("zero0", 1, False)[1]


@pytest.mark.parametrize("overlap", [None, True, False])
def test_zero0_all_reduces_after_backward_whatever_overlap_comm_says(overlap):
    """Stage 0: the engine all-reduces every bucket after backward returns (engine.py `backward` →
    `allreduce_gradients`), so all of it is on the critical path."""
    comm, t = _time("zero0", 4, overlap)
    assert comm.all_reduce > 0
    assert t.exposed_comm_s == pytest.approx(t.comm_s, rel=1e-12)
