"""The planner prices the packed attention that runs (TrainSpec.packed_attention).

Expected bytes are derived by hand from the collator and transformers' SDPA path, not copied
from the code: the dense mask is the additive [B, 1, S, S] in the compute dtype (B·S²·c), and
with a mask transformers repeats GQA's k and v to every head for SDPA, which saves the copies
(c·2(q − kv) per token per layer); one SDPA call per document saves its output beside the
concatenation o_proj reads (c·o per token per layer). The document-aware kernels (flex,
flash-attn's varlen) book no mask and cost what causal SDPA costs.
"""

from __future__ import annotations

import pytest

from shardwise.catalog import build_hardware, get_model
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy, TrainSpec

HW = build_hardware(gpu="h100-sxm", gpus=8, gpus_per_node=8)
FSDP = Strategy.from_name("fsdp")


def plan(model: str, packed: str, seq: int = 2048, micro: int = 2, **kw):
    train = TrainSpec(seq_len=seq, micro_batch=micro, packed_attention=packed, **kw)
    return evaluate(get_model(model), HW, train, FSDP)


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3.1-8b"])
def test_document_aware_kernels_cost_what_causal_sdpa_costs(model):
    base = plan(model, "none")
    for packed in ("flex", "flash_varlen"):
        e = plan(model, packed)
        assert (e.memory.gpu, e.time) == (base.memory.gpu, base.time)


def test_dense_books_the_mask_bytes():
    """MHA (llama-2-7b: no repeat): exactly the mask, B·S²·c = 2 · 2048² · 2 bytes = 16 MiB."""
    flex, dense = plan("llama-2-7b", "flex"), plan("llama-2-7b", "dense")
    assert dense.memory.gpu.activations - flex.memory.gpu.activations == 2 * 2048 ** 2 * 2 == 16 * 2 ** 20
    fp32 = plan("llama-2-7b", "dense", precision="fp32").memory.gpu.activations
    assert fp32 - plan("llama-2-7b", "flex", precision="fp32").memory.gpu.activations == 2 * 2048 ** 2 * 4
    # under full checkpointing the mask still lives through the step (an input every layer reads)
    ckpt = [plan("llama-2-7b", p, checkpointing="full").memory.gpu.activations for p in ("flex", "dense")]
    assert ckpt[1] - ckpt[0] == 16 * 2 ** 20


def test_dense_with_gqa_saves_the_repeated_k_and_v():
    """llama-3.1-8b: q 4096, kv 1024, 32 layers, 2 × 2048 tokens, bf16."""
    m = get_model("llama-3.1-8b")
    extra = plan("llama-3.1-8b", "dense").memory.gpu.activations - plan("llama-3.1-8b", "flex").memory.gpu.activations
    tokens = 2 * 2048
    assert extra == 2 * 2048 ** 2 * 2 + m.num_layers * tokens * 2 * 2 * (m.q_dim - m.kv_dim)


def test_one_sdpa_call_per_document_saves_the_concatenated_output():
    m = get_model("llama-3.1-8b")
    extra = (plan("llama-3.1-8b", "sdpa_varlen").memory.gpu.activations
             - plan("llama-3.1-8b", "flex").memory.gpu.activations)
    assert extra == m.num_layers * 2 * 2048 * 2 * m.o_dim


def test_dense_computes_the_full_square_and_reads_the_mask():
    flex, dense = plan("llama-2-7b", "flex"), plan("llama-2-7b", "dense")
    assert dense.time.attention_s == pytest.approx(2 * flex.time.attention_s)
    m = get_model("llama-2-7b")
    # the mask read once per head in forward and in SDPA's backward, every layer
    reads = m.num_layers * m.num_heads * 2 * 2048 * 2048 * 2 * 2
    bytes_s = HW.gpu.hbm_bytes_per_s * HW.gpu.hbm_efficiency
    assert dense.time.memory_bound_s - flex.time.memory_bound_s == pytest.approx(reads / bytes_s)
    assert dense.time.tokens_per_s_per_gpu < flex.time.tokens_per_s_per_gpu


def test_the_dense_cost_grows_as_the_square_of_the_row():
    """Trends: doubling S quadruples the mask (per micro-batch) and more than doubles the
    tokens/s lost to it; flex loses nothing at any length."""
    def gap(seq):
        d, f = plan("llama-2-7b", "dense", seq=seq, micro=1), plan("llama-2-7b", "flex", seq=seq, micro=1)
        return d.memory.gpu.activations - f.memory.gpu.activations, 1 - d.time.tokens_per_s_per_gpu / \
            f.time.tokens_per_s_per_gpu

    (m1, t1), (m2, t2) = gap(2048), gap(4096)
    assert m2 == 4 * m1
    assert t2 > t1 > 0
