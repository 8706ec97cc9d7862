"""torchtune's chunked-output cross-entropy (`--cross-entropy chunked-output`, plan/loss.py): the
model's output projection on 8 chunks of the sequence, every chunk's logits kept, the loss
upcast and computed a chunk at a time (CEWithChunkedOutputLoss, pytorch/torchtune@1814feb).

Written here as torchtune's recipe runs it (output chunks, the loss, `del logits`, backward) on
CPU, eager, under torch's MemTracker: the peak beyond the inputs is the planned logits term,
in both of its phases (the loss's saved fp32 log-softmax outputs; lm_head's weight gradient
accumulated over the chunks, out of place). The compiled loss phase is derived, not measured
here (compiling on CPU in a test is slow); torchtune's ladder checks it against its README.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.plan.loss import OUTPUT_CHUNKS, logits_bytes, loss_held_bytes
from shardwise.specs import ModelSpec, TrainSpec


def _model(hidden: int, vocab: int) -> ModelSpec:
    return ModelSpec.from_hf_dict({"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2}, name="head")


def _measured(batch: int, seq: int, hidden: int, vocab: int, dtype: torch.dtype, trainable: bool) -> int:
    """Peak live bytes of torchtune's output chunks + loss + backward, beyond the lm_head input,
    its weight, and the input's gradient (activation terms the planner books elsewhere)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True, generator=g)
    w = torch.nn.Parameter((torch.randn(vocab, hidden, generator=g) * 0.1).to(dtype), requires_grad=trainable)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    mt = MemTracker()
    mt.track_external(h, w)
    with mt:
        x = h * 1.0  # the final norm's output: lm_head's input, whose gradient flows back
        logits = [F.linear(chunk, w) for chunk in x.chunk(OUTPUT_CHUNKS, dim=1)]
        targets = [t.reshape(-1) for t in labels.chunk(OUTPUT_CHUNKS, dim=1)]
        loss = 0.0
        for chunk, t in zip(logits, targets, strict=True):
            loss = loss + F.cross_entropy(chunk.reshape(-1, vocab).float(), t, reduction="sum")
        del logits  # as torchtune's recipes do before backward
        loss.backward()
    peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    c = torch.finfo(dtype).bits // 8
    inputs = c * (h.numel() + w.numel())
    # x, and its gradient where lm_head trains (frozen, the loss phase peaks before any)
    return peak - inputs - c * h.numel() * (2 if trainable else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hidden", "trainable"), [(64, True), (64, False), (2048, True)],
                         ids=["loss-phase", "loss-phase-frozen-head", "head-phase"])
def test_measured_peak_is_the_planned_chunked_output_term(dtype, hidden, trainable) -> None:
    batch, seq, vocab = 2, 256, 2048
    measured = _measured(batch, seq, hidden, vocab, dtype, trainable)
    precision = "fp32" if dtype == torch.float32 else "bf16-pure"
    train = TrainSpec(seq_len=seq, micro_batch=batch, precision=precision, cross_entropy="chunked-output",
                      lora_rank=0 if trainable else 8)
    planned = logits_bytes(_model(hidden, vocab), train)
    # hand: c-byte logits and fp32 log-softmax outputs of every token, one chunk's upcast in
    # flight (bf16); or, with H = 2048, lm_head's gradient three times over beside 7/8 of the
    # logits' gradients
    c, tokens, chunk = (4 if dtype == torch.float32 else 2), batch * seq, batch * seq // OUTPUT_CHUNKS
    loss = tokens * (c + 4) * vocab + (4 * vocab * chunk if c < 4 else 0)
    head = (tokens - chunk) * c * vocab + 3 * c * vocab * hidden
    assert planned == (max(loss, head) if trainable else loss)
    assert measured == pytest.approx(planned, rel=0.02)


def test_compiled_chunk_loss_keeps_only_the_logits() -> None:
    """torchtune compiles `compute_cross_entropy` (fused_kernels): its saved input is the chunk's
    logits, so the loss phase is the logits plus one chunk's gradient; the held bytes under PP
    are the logits alone."""
    m = _model(3072, 128256)
    eager = TrainSpec(seq_len=4096, micro_batch=2, precision="bf16-pure", cross_entropy="chunked-output", lora_rank=8)
    compiled = eager.model_copy(update={"fused_kernels": True})
    tokens, v = 8192, 128256
    assert logits_bytes(m, compiled) == 2 * v * tokens + 2 * v * tokens // OUTPUT_CHUNKS
    assert logits_bytes(m, eager) == 6 * v * tokens + 4 * v * tokens // OUTPUT_CHUNKS
    assert loss_held_bytes(m, compiled) == 2 * v * tokens
    assert loss_held_bytes(m, eager) == 6 * v * tokens
