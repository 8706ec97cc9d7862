"""`fsdp.reduce_every_micro_batch` auto | true | false (shardwise.plan.grad_sync): one decision,
read by memory, communication and time alike; the trainer's side is tests/train/test_grad_sync.py."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.config.strategy import FSDPKnobs
from shardwise.errors import ShardwiseError
from shardwise.plan.comm import plan_comm
from shardwise.plan.evaluate import evaluate, fsdp_grad_sync, memory_as_run, resolved
from shardwise.plan.memory import plan_memory
from shardwise.specs import Strategy, TrainSpec

M7, M70 = catalog.get_model("llama-2-7b"), catalog.get_model("llama-2-70b")


def fsdp(**knobs) -> Strategy:
    return Strategy.from_name("fsdp", fsdp=FSDPKnobs(**knobs))


def test_auto_is_the_default_and_takes_the_words():
    assert FSDPKnobs().reduce_every_micro_batch == "auto"
    assert FSDPKnobs(reduce_every_micro_batch="true").reduce_every_micro_batch is True
    with pytest.raises(ShardwiseError):
        FSDPKnobs(reduce_every_micro_batch="sometimes")


def test_no_choice_without_accumulation_or_fsdp2():
    hw = catalog.build_hardware(gpus=8)
    assert fsdp_grad_sync(M7, hw, TrainSpec(grad_accum=1), fsdp()) is None
    assert fsdp_grad_sync(M7, hw, TrainSpec(grad_accum=4), Strategy.from_name("zero3")) is None
    assert plan_memory(M7, hw, TrainSpec(grad_accum=1), fsdp()).grad_sync is None


def test_held_grads_that_do_not_fit_are_reduced_every_micro_batch_in_memory_comm_and_time():
    hw = catalog.build_hardware(gpus=64, gpu="a100-80g")
    train = TrainSpec(grad_accum=8)
    auto, held = (evaluate(M70, hw, train, s) for s in (fsdp(), fsdp(reduce_every_micro_batch=False)))
    sync = auto.memory.grad_sync
    assert sync.auto and not sync.hold and "would not fit" in sync.reason
    assert sync.held_bytes == pytest.approx(4 * M70.params)  # fp32 reduce_dtype, every parameter
    assert auto.memory.gpu.held_grads == 0 and held.memory.gpu.held_grads == pytest.approx(4 * M70.params)
    # the one decision reaches comm and time: grad_accum reduce-scatters of the fp32 grads per step
    assert auto.comm.reduce_scatter == pytest.approx(8 * held.comm.reduce_scatter)
    every = evaluate(M70, hw, train, fsdp(reduce_every_micro_batch=True))
    assert auto.comm == every.comm and auto.time == every.time and auto.memory.gpu == every.memory.gpu
    # comm planned on its own takes the knob resolved (it refuses an unresolved "auto")
    assert plan_comm(M70, hw, train, resolved(M70, hw, train, fsdp())) == every.comm
    with pytest.raises(ValueError, match="'auto' is decided first"):
        plan_comm(M70, hw, train, fsdp())
    assert auto.strategy.fsdp.reduce_every_micro_batch == "auto"  # the row keeps the knob as given


def test_set_values_are_recorded_not_decided():
    hw = catalog.build_hardware(gpus=64, gpu="a100-80g")
    sync = plan_memory(M70, hw, TrainSpec(grad_accum=8), fsdp(reduce_every_micro_batch=False)).grad_sync
    assert sync.hold and not sync.auto and sync.reduce_scatters_per_step == 1


def test_pipeline_schedules_hold_the_grads():
    """torch's schedule turns gradient sync off on all but the last micro-batch itself
    (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`)."""
    hw = catalog.build_hardware(gpus=8)
    sync = memory_as_run(M7, hw, TrainSpec(grad_accum=8), Strategy.from_name("fsdp", pp=2)).grad_sync
    assert sync.hold and sync.auto and "pipeline schedule" in sync.reason


def test_pipeline_schedules_hold_the_grads_even_when_set_true():
    """The schedule's own no-sync wins over `reduce_every_micro_batch: true`: planned held, as torch
    runs it (one reduce-scatter a step, the unsharded grads held), and said so."""
    hw = catalog.build_hardware(gpus=8)
    s = Strategy.from_name("fsdp", pp=2, fsdp=FSDPKnobs(reduce_every_micro_batch=True))
    set_true = evaluate(M7, hw, TrainSpec(grad_accum=8), s)
    held = evaluate(M7, hw, TrainSpec(grad_accum=8), Strategy.from_name("fsdp", pp=2, fsdp=FSDPKnobs(
        reduce_every_micro_batch=False)))
    sync = set_true.memory.grad_sync
    assert sync.hold and not sync.auto and "pipeline schedule" in sync.reason and "true" in sync.reason
    assert set_true.memory.gpu.held_grads == held.memory.gpu.held_grads > 0
    assert set_true.comm.reduce_scatter == held.comm.reduce_scatter
    assert set_true.time.step_s == held.time.step_s
    # the trainer's record (RunSpec.grad_sync asks fsdp_grad_sync) says the same
    assert fsdp_grad_sync(M7, hw, TrainSpec(grad_accum=8), s).reason == sync.reason
