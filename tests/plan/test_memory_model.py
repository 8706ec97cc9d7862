"""Hand-derived checks of the memory model: the ZeRO paper's figures and monotonic trends
(torch-free; DeepSpeed's own estimators are in test_deepspeed_estimators.py). Expected values are computed here from the papers'
formulas, never copied from the planner's output."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.config.strategy import STRATEGY_NAMES
from shardwise.plan.memory import paper_model_states, plan_memory
from shardwise.specs import Strategy, TrainSpec

GB = 1e9


@pytest.mark.parametrize(
    "name, expected_gb",
    [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)],
)
def test_zero_paper_check(name, expected_gb):
    # ZeRO paper §5 / Figure 1: Ψ = 7.5B, N = 64, K = 12.
    got = paper_model_states(7.5e9, 64, Strategy.from_name(name)).model_states
    assert round(got / GB, 1) == expected_gb


def test_paper_accounting_formulas_on_catalog_model():
    m = catalog.get_model("llama-2-13b")
    hw = catalog.build_hardware(gpus=16, gpus_per_node=8)
    psi, n = m.params, 16
    expect = {
        "ddp": (2 + 2 + 12) * psi,
        "zero1": 2 * psi + 2 * psi + 12 * psi / n,
        "zero2": 2 * psi + (2 + 12) * psi / n,
        "zero3": 16 * psi / n,
        "fsdp": 16 * psi / n,
    }
    for name, bytes_ in expect.items():
        plan = plan_memory(m, hw, TrainSpec(), Strategy.from_name(name), accounting="paper")
        assert plan.gpu.model_states == pytest.approx(bytes_, rel=1e-12)


# ---- trends -------------------------------------------------------------------------------

MODELS = ["llama-2-7b", "llama-3.1-70b", "mixtral-8x7b", "qwen2.5-0.5b", "qwen2.5-72b"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("accounting", ["engine", "paper"])
def test_higher_stage_never_more_model_states(model, accounting):
    m = catalog.get_model(model)
    hw = catalog.build_hardware(gpus=16, gpus_per_node=8)
    for ga in (1, 4):
        train = TrainSpec(grad_accum=ga)
        states = [
            plan_memory(m, hw, train, Strategy.from_name(f"zero{k}"), accounting=accounting).gpu.model_states
            for k in range(4)
        ]
        assert states == sorted(states, reverse=True), states


@pytest.mark.parametrize("name", [n for n in STRATEGY_NAMES if n not in ("ddp", "zero0")])
def test_more_gpus_never_more_sharded_state(name):
    m = catalog.get_model("llama-2-13b")
    last = None
    for gpus in (2, 4, 8, 16, 32, 64):
        hw = catalog.build_hardware(gpus=gpus, gpus_per_node=min(gpus, 8))
        g = plan_memory(m, hw, TrainSpec(), Strategy.from_name(name)).gpu
        sharded = g.model_states + g.step_buffers
        if last is not None:
            assert sharded <= last
        last = sharded


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_checkpointing_never_more_activations(model, attention):
    m = catalog.get_model(model)
    hw = catalog.build_hardware()
    for seq in (512, 4096):
        acts = {
            ck: plan_memory(m, hw, TrainSpec(seq_len=seq, checkpointing=ck, attention=attention),
                            Strategy.from_name("fsdp")).gpu.activations
            for ck in ("none", "selective", "full")
        }
        assert acts["none"] >= acts["selective"] >= acts["full"]


def test_activations_scale_linearly_with_micro_batch_and_shrink_with_tp():
    m = catalog.get_model("llama-2-70b")
    hw = catalog.build_hardware()
    a1 = plan_memory(m, hw, TrainSpec(micro_batch=1), Strategy.from_name("zero3")).gpu.activations
    a4 = plan_memory(m, hw, TrainSpec(micro_batch=4), Strategy.from_name("zero3")).gpu.activations
    assert a4 == pytest.approx(4 * a1)
    t2 = plan_memory(m, hw, TrainSpec(), Strategy.from_name("zero3", tp=2)).gpu.activations
    assert t2 < a1


def test_offload_moves_states_to_host():
    m = catalog.get_model("llama-2-70b")
    hw = catalog.build_hardware()
    on = plan_memory(m, hw, TrainSpec(), Strategy.from_name("zero3"))
    off = plan_memory(m, hw, TrainSpec(), Strategy.from_name("zero3+opt-offload"))
    full = plan_memory(m, hw, TrainSpec(), Strategy.from_name("zero3+full-offload"))
    assert off.gpu.total < on.gpu.total and full.gpu.total < off.gpu.total
    # what leaves the GPU lands on the host: fp32 master + Adam (12 bytes) + fp32 grads (4) per param per GPU
    assert off.host.total == pytest.approx(16 * m.params / 8 * 8)


def test_lora_needs_far_less_than_full():
    m = catalog.get_model("llama-2-7b")
    hw = catalog.build_hardware(gpus=1)
    full = plan_memory(m, hw, TrainSpec(), Strategy.from_name("ddp")).gpu
    lora = plan_memory(m, hw, TrainSpec(lora_rank=16), Strategy.from_name("ddp")).gpu
    assert lora.model_states < full.model_states / 5
    # base weights frozen in bf16: 2 bytes per parameter at least
    assert lora.params >= 2 * m.params


def test_chunked_cross_entropy_cuts_logits():
    m = catalog.get_model("llama-3.1-8b")
    hw = catalog.build_hardware()
    std = plan_memory(m, hw, TrainSpec(seq_len=8192, micro_batch=2), Strategy.from_name("fsdp")).gpu.logits
    chunk = plan_memory(m, hw, TrainSpec(seq_len=8192, micro_batch=2, cross_entropy="chunked"),
                        Strategy.from_name("fsdp")).gpu.logits
    # b·s·V = 2·8192·128256 tokens×vocab: the fp32 log-softmax alone is 4 bytes each
    assert std >= 4 * 2 * 8192 * 128256
    assert chunk < std / 10


def test_fits_uses_margin():
    m = catalog.get_model("llama-2-7b")
    big = plan_memory(m, catalog.build_hardware(gpu="a100-80g"), TrainSpec(), Strategy.from_name("ddp"))
    assert not big.fits and big.gpu.total > 0.95 * 80e9
    small = plan_memory(m, catalog.build_hardware(gpu="h200"), TrainSpec(), Strategy.from_name("fsdp"))
    assert small.fits
