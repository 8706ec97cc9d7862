"""Logits and loss memory per GPU, by cross-entropy implementation (pure, no torch)."""

from __future__ import annotations

from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec


def logits_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1) -> float:
    """Peak memory of logits and loss, by implementation (`train.cross_entropy`):

    - standard (HF `ForCausalLMLoss`): the lm_head output (c·V per token, held by the caller)
      and, during log-softmax's backward, its saved fp32 output, the incoming gradient from
      the NLL loss and the outgoing one (4·V each): (c + 12)·V per token. (In forward, HF's fp32
      upcast, log-softmax's output and the logits make the smaller c + 8.) Traced:
      FSDPMemTracker on Llama-3.1-8B, seq 4096 (benchmarks/results/fsdp_trace.json).
    - inplace (flash-attn's cross-entropy kernel, llm-foundry MPT's default `fused_crossentropy`):
      the c-byte logits are kept and overwritten by their gradient; fp32 per-row statistics only.
    - chunked / fused (linear + cross-entropy): one chunk of tokens at a time materialises the
      (c + 12)·V working set (fused kernels, e.g. Liger's, work in small row blocks)."""
    v = model.vocab_size / tp  # vocab-parallel lm_head
    c = train.compute_bytes
    tokens = train.micro_batch * train.seq_len
    # Gemma 2/3 soft-cap the logits (cap · tanh(logits / cap)): tanh's output, in the compute
    # dtype, is saved for backward on top (measured on a tiny gemma2: +c·V per token)
    cap = c * v if model.final_logit_softcapping else 0.0
    if train.cross_entropy == "inplace":
        return tokens * (c * v + cap + 8)
    per_token = (c + 12) * v + cap
    if train.cross_entropy == "chunked":
        tokens = min(tokens, train.ce_chunk)
    elif train.cross_entropy == "fused":
        tokens = min(tokens, 256)
    return tokens * per_token
