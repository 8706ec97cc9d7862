"""`checkpointing: auto` in the planner (shardwise.plan.recompute): each row runs no recomputation
where its plan without it fits, else full, unless only the host's peak is short and recomputation
cannot lower it. Checked against the same rows planned with the value set by hand."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.plan.evaluate import evaluate
from shardwise.specs import HardwareSpec, Strategy, TrainSpec
from shardwise.specs.hardware import GIB

L70 = catalog.get_model("llama-2-70b")


def _three(train: TrainSpec, hw: HardwareSpec, name: str):
    s = Strategy.from_name(name)
    return [evaluate(L70, hw, train.model_copy(update={"checkpointing": c}), s) for c in ("auto", "none", "full")]


def test_a_row_that_fits_without_recomputation_runs_none():
    hw = catalog.build_hardware("a100-80g", 64, gpus_per_node=8)
    auto, none, _ = _three(TrainSpec(seq_len=512, micro_batch=1, grad_accum=8), hw, "fsdp")
    assert none.fits and auto.train.checkpointing == "none" and not auto.recompute.moot
    assert auto.memory.gpu.total == none.memory.gpu.total and auto.time.step_s == none.time.step_s
    assert f"fits without recomputation, {none.memory.gpu.required / GIB:.1f} GiB of" in auto.recompute.reason


def test_a_row_short_of_gpu_memory_runs_full():
    hw = catalog.build_hardware("a100-80g", 64, gpus_per_node=8)
    auto, none, full = _three(TrainSpec(seq_len=2048, micro_batch=4, grad_accum=8), hw, "fsdp")
    assert not none.fits and full.fits
    assert auto.train.checkpointing == "full" and auto.fits
    assert auto.memory.gpu.total == full.memory.gpu.total and auto.time.step_s == full.time.step_s
    assert f"would need {none.memory.gpu.required / GIB:.1f} GiB of" in auto.recompute.reason


@pytest.mark.parametrize("offload", [False, True])
def test_a_row_short_only_of_host_memory_recomputes_only_where_that_lowers_the_host(offload):
    """ZeRO-3 with everything offloaded, 70B on one node of 300 GB: the GPU holds the step, the
    host does not hold the offloaded states. Recomputation cannot lower that, unless the saved
    activations are offloaded too (then full keeps only each layer's input on the host)."""
    hw = catalog.build_hardware("a100-80g", 8, host_memory_bytes=300e9)
    train = TrainSpec(seq_len=512, micro_batch=1, activation_offload=offload)
    auto, none, full = _three(train, hw, "zero3+full-offload")
    assert none.memory.gpu.required <= none.memory.usable_bytes
    assert none.memory.host.peak > none.memory.host_capacity_bytes and not full.fits
    lowers = full.memory.host.peak < none.memory.host.peak
    assert lowers == offload
    assert auto.train.checkpointing == ("full" if offload else "none") and auto.recompute.moot == (not offload)
    assert f"{none.memory.host.peak / GIB:.1f} GiB of" in auto.recompute.reason
