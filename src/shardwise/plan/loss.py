"""Logits and loss memory per GPU, by cross-entropy implementation (pure, no torch)."""

from __future__ import annotations

from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec

# torchtune's CEWithChunkedOutputLoss(num_output_chunks=8), which its recipes pass to the model
# (`set_num_output_chunks`): pytorch/torchtune@1814feb torchtune/modules/loss/ce_chunked_output_loss.py
OUTPUT_CHUNKS = 8


def logits_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1, loss_parallel: bool = False) -> float:
    """Peak memory of logits and loss, by implementation (`train.cross_entropy`), `tp` the
    vocabulary shards:

    - standard (HF `ForCausalLMLoss`): the lm_head output (c·V per token, held by the caller)
      and, during log-softmax's backward, its saved fp32 output, the incoming gradient from
      the NLL loss and the outgoing one (4·V each): (c + 12)·V per token. (In forward, HF's fp32
      upcast, log-softmax's output and the logits make the smaller c + 8.) Traced:
      FSDPMemTracker on Llama-3.1-8B, seq 4096 (benchmarks/results/fsdp_trace.json). The
      trainer's engines drop the logits before backward, so for its standard path this is c·V
      per token conservative (measured 12·V: benchmarks/results/cross_entropy.json).
      Under torch's `loss_parallel` (DTensor TP: the trainer's and torchtitan's) one fused
      backward (torch/distributed/tensor/parallel/loss.py `_nll_loss_and_log_softmax_backward`)
      holds the saved log-softmax output, a zeros gradient, the sum of it and exp(output) and
      that times the incoming gradient at once: (c + 16)·V. Measured on CPU against both:
      tests/plan/test_loss_parallel_memory.py.
    - inplace (flash-attn's cross-entropy kernel, llm-foundry MPT's default `fused_crossentropy`):
      the c-byte logits are kept and overwritten by their gradient; fp32 per-row statistics only.
    - chunked (the trainer's, shardwise.train.model.loss: lm_head and the loss fused per `ce_chunk`
      tokens, every gradient computed in forward): one chunk's fp32 log-softmax and its fp32
      input (8·V per token; with Gemma's soft-cap the capped fp32 logits stay for the slope, so
      a 16-bit gradient comes on top: (8 + c)·V), and, held from the
      first chunk to the start of backward, lm_head's weight gradient in the compute dtype
      (c·V·H; none when lm_head is frozen, e.g. LoRA). Its input gradient replaces the lm_head
      input the standard path saves (the activations' final-norm term): not counted again.
      Measured on CPU against these terms: tests/train/test_chunked_ce.py.
    - fused (Liger's linear + cross-entropy kernel): one small row block at a time materialises
      the (c + 12)·V working set.
    - chunked-output (torchtune's CEWithChunkedOutputLoss, pytorch/torchtune@1814feb
      torchtune/modules/loss/ce_chunked_output_loss.py): the model's output projection runs on
      OUTPUT_CHUNKS chunks of the sequence and every chunk's c-byte logits are kept to the loss's
      backward. Eager, each chunk's log-softmax saves its fp32 output (4·V a token, every chunk)
      while the next chunk's fp32 upcast is in flight; compiled (`fused_kernels`: torchtune
      compiles `compute_cross_entropy`), the saved input is the c-byte logits themselves and each
      chunk's backward writes a c-byte gradient. With lm_head trained, autograd then accumulates
      its weight gradient over the chunks out of place, the sum, the next chunk's gradient and
      the result at once (3·c·V·H) beside the chunks' logit gradients. Measured on CPU, eager, both
      phases (tests/plan/test_chunked_output_loss.py); the compiled loss phase is derived."""
    v = model.vocab_size / tp  # vocab-parallel lm_head
    c = train.compute_bytes
    tokens = train.micro_batch * train.seq_len
    # Gemma 2/3 soft-cap the logits (cap · tanh(logits / cap)): tanh's output, in the compute
    # dtype, is saved for backward on top (measured on a tiny gemma2: +c·V per token)
    cap = c * v if model.final_logit_softcapping else 0.0
    if train.cross_entropy == "inplace":
        return tokens * (c * v + cap + 8)
    if train.cross_entropy == "chunked":
        held = c * v * model.hidden_size if head_trainable(train) else 0.0
        per_token = (8 + (c if model.final_logit_softcapping and c < 4 else 0)) * v
        return min(tokens, train.ce_chunk) * per_token + held
    if train.cross_entropy == "chunked-output":
        chunk = -(-tokens // OUTPUT_CHUNKS)
        if train.fused_kernels:
            loss = tokens * (c * v + cap) + chunk * c * v
        else:
            loss = tokens * ((c + 4) * v + cap) + (chunk * 4 * v if c < 4 else 0.0)
        if not head_trainable(train):
            return loss
        return max(loss, (tokens - chunk) * c * v + 3 * c * v * model.hidden_size)
    per_token = (c + (16 if loss_parallel and train.cross_entropy == "standard" else 12)) * v + cap
    if train.cross_entropy == "fused":
        tokens = min(tokens, 256)
    return tokens * per_token


def head_trainable(train: TrainSpec) -> bool:
    """lm_head gets a gradient: full fine-tuning, or LoRA with lm_head in modules_to_save."""
    return not train.lora_rank or "lm_head" in train.lora_modules_to_save


def loss_held_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1) -> float:
    """What one micro-batch's loss holds from its forward to its backward, beyond the peak of
    `logits_bytes` (which one micro-batch reaches at a time): under pipeline parallelism the last
    stage computes each micro-batch's loss as its forward ends (torch.distributed.pipelining's
    `_maybe_compute_loss`) and runs its backward later, as the schedule orders it
    (plan.pipeline), holding this meanwhile. Derived from the implementations, not measured:

    - chunked (shardwise.train.model.loss): every gradient is computed in forward and kept on the
      autograd node until backward: lm_head's weight gradient (c·V·H; none when lm_head is frozen)
      — its input gradient replaces the lm_head input the activations' final-norm term counts;
    - fused (Liger's kernel, computing the gradients in forward too): the same weight gradient;
    - standard: the logits (c·V per token, the stage's output) and log-softmax's saved fp32 output
      (4·V), with the soft-capped logits' tanh output where Gemma caps them; chunked-output the
      same, and compiled only the logits (its compiled chunk loss saves its input);
    - inplace: the c-byte logits, overwritten by their gradient, and per-row statistics."""
    v = model.vocab_size / tp
    c = train.compute_bytes
    tokens = train.micro_batch * train.seq_len
    cap = c * v if model.final_logit_softcapping else 0.0
    if train.cross_entropy in ("chunked", "fused"):
        return c * v * model.hidden_size if head_trainable(train) else 0.0
    if train.cross_entropy == "inplace":
        return tokens * (c * v + cap + 8)
    if train.cross_entropy == "chunked-output" and train.fused_kernels:  # the compiled loss saves its input only
        return tokens * (c * v + cap)
    return tokens * ((c + 4) * v + cap)
