"""Facts the planner and the trainer once restated in several places, now named once on the spec
they belong to: mixed precision, DDP's autocast, passes over a layer, lm_head's
size, the fused-AdamW rule. Expected values are stated by hand, from the definitions."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.config.schema import OptimizerSection
from shardwise.specs import TrainSpec


@pytest.mark.parametrize(("precision", "mixed"), [
    ("bf16-mixed", True), ("fp16-mixed", True), ("bf16-pure", False), ("fp32", False)])
def test_mixed_precision_is_16_bit_compute_over_fp32_weights(precision: str, mixed: bool) -> None:
    assert TrainSpec(precision=precision).mixed_precision is mixed


@pytest.mark.parametrize(("engine", "precision", "lora", "casts"), [
    ("ddp", "bf16-mixed", 0, True),
    ("ddp", "fp16-mixed", 0, True),
    ("ddp", "bf16-mixed", 8, False),  # a LoRA base is stored in the compute dtype
    ("ddp", "fp32", 0, False),
    ("ddp", "bf16-pure", 0, False),
    ("fsdp2", "bf16-mixed", 0, False),  # FSDP2 casts in its all-gather, not under autocast
    ("deepspeed", "bf16-mixed", 0, False),  # DeepSpeed keeps the module in the compute dtype
])
def test_only_ddp_in_mixed_precision_autocasts(engine: str, precision: str, lora: int, casts: bool) -> None:
    assert TrainSpec(precision=precision, lora_rank=lora).autocasts(engine) is casts


@pytest.mark.parametrize(("checkpointing", "passes"), [("none", 2), ("selective", 2), ("full", 3)])
def test_layer_passes_forward_backward_and_full_recompute(checkpointing: str, passes: int) -> None:
    assert TrainSpec(checkpointing=checkpointing).layer_passes == passes


def test_lm_head_is_hidden_by_vocab() -> None:
    # Llama-2-7B: hidden 4096, vocab 32000 -> 4096 * 32000 = 131,072,000 weights
    assert catalog.get_model("llama-2-7b").lm_head_params == 131_072_000


@pytest.mark.parametrize(("fused", "device", "runs_fused"), [
    (None, "cuda", True), (None, "cpu", False), (True, "cpu", True), (False, "cuda", False)])
def test_fused_adamw_where_asked_else_on_cuda(fused: bool | None, device: str, runs_fused: bool) -> None:
    assert OptimizerSection(fused=fused).fused_on(device) is runs_fused
