"""QLoRA with sharded parameters (FSDP2): the NF4 base linears are all-gathered and held unsharded
as stored, 4-bit data and scales, not dequantised to bf16 (torchao's NF4Tensor `fsdp_pre_all_gather`,
as torchtune shards it; FSDP-QLoRA's packed bitsandbytes storage). Expected figures derived here by
hand from Llama 3.1 8B's config (hidden 4096, 8 K/V heads of 128, intermediate 14336, 32 layers)
and the NF4 layout (0.5 byte a weight, an 8-bit absmax per 64, an fp32 scale per 256 blocks)."""

from __future__ import annotations

import pytest

from shardwise.plan.evaluate import evaluate
from shardwise.plan.planner import build_specs
from shardwise.specs import Strategy

H, KV, INTER, LAYERS = 4096, 1024, 14336, 32
LINEAR_PER_LAYER = H * (H + KV + KV + H) + 3 * H * INTER  # q, k, v, o; gate, up, down
NF4 = 0.5 + 1 / 64 + 4 / (64 * 256)


def _eval(qlora: bool, grad_accum: int = 1):
    m, hw, t = build_specs(model="llama-3.1-8b", gpu="a100-80g", gpus=8, seq_len=2048, micro_batch=2,
                           grad_accum=grad_accum, precision="bf16-mixed", lora_rank=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                           base_quant="nf4" if qlora else "none")
    s = Strategy.from_name("fsdp", fsdp={"reduce_every_micro_batch": True, "reshard_after_forward": "not-last"})
    return evaluate(m, hw, t, s)


def test_the_gathered_layers_hold_their_linears_in_nf4():
    """Two decoder layers are unsharded at a time (the one computing, the one prefetched): their
    linears take NF4 bytes where a LoRA base in bf16 takes 2."""
    lora, qlora = _eval(False), _eval(True)
    saved = (2 - NF4) * 2 * LINEAR_PER_LAYER
    assert lora.memory.gpu.gathered_params - qlora.memory.gpu.gathered_params == pytest.approx(saved, rel=1e-9)


@pytest.mark.parametrize("k", [1, 2])
def test_the_all_gathers_move_nf4(k):
    """Each micro-batch gathers every layer in forward and, resharded after forward (all but the
    last), again in backward: 31 of the 32 layers' linears twice, one once, at NF4 bytes."""
    lora, qlora = _eval(False, k), _eval(True, k)
    saved = (2 - NF4) * LINEAR_PER_LAYER * (LAYERS + (LAYERS - 1)) * k
    assert lora.comm.all_gather - qlora.comm.all_gather == pytest.approx(saved, rel=1e-9)
