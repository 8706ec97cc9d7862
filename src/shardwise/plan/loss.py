"""Logits and loss memory per GPU, by cross-entropy implementation (pure, no torch)."""

from __future__ import annotations

from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec


def logits_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1) -> float:
    """Peak memory of logits and loss, per token: the lm_head output (c·V, held by the caller)
    and, during log-softmax's backward, its saved fp32 output, the incoming gradient from the
    NLL loss and the outgoing one (4·V each). (In forward, HF's fp32 upcast, log-softmax's
    output and the logits make the smaller c + 8.) Traced: FSDPMemTracker on Llama-3.1-8B,
    seq 4096 (benchmarks/results/fsdp_trace.json). Chunked/fused cross-entropy materialises
    one chunk of tokens at a time."""
    v = model.vocab_size / tp  # vocab-parallel lm_head
    per_token = (train.compute_bytes + 12) * v
    tokens = train.micro_batch * train.seq_len
    if train.cross_entropy == "chunked":
        tokens = min(tokens, train.ce_chunk)
    elif train.cross_entropy == "fused":
        tokens = min(tokens, 256)  # fused linear-CE kernels (Liger) work in small row blocks
    return tokens * per_token
