"""Per-kernel costs the planner's step time is built from (pure functions, no torch): the GEMM
soft roofline, one decoder layer's linears, the memory-bound bytes of a layer's elementwise
work, the loss over the vocabulary and lm_head's GEMMs by cross-entropy implementation, and
the optimizer update's bytes. `plan/timing.py` scales and sums them into a step, with the
fitted constants (docs/accuracy.md).
"""

from __future__ import annotations

import math

from shardwise.plan.activations import seq_shards
from shardwise.plan.experts import expert_gemms
from shardwise.plan.loss import head_trainable
from shardwise.plan.optimizer import LOW_BIT_STATE_BYTES, LOW_BIT_WORK_BYTES
from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec

OPTIMIZER_BYTES = {"fused": 28, "foreach": 80, "forloop": 80}  # fp32 AdamW, per parameter
# Attention through a dense packing mask (`packed_attention: dense`): SDPA cannot skip the blocks
# above the diagonal (no is_causal with a mask), so it computes the full S² square, twice the
# causal FLOPs of flops.attention_flops_per_token (measured on CPU at seq 2048, forward + backward:
# 1.7× causal SDPA, whose causal skip is block-granular; benchmarks/results/packed_attention.json).
DENSE_SQUARE = 2.0


def gemm_time(tokens: float, k: float, n: float, flops_s: float, bytes_s: float, c: int) -> float:
    """One [tokens × k] · [k × n] GEMM: a soft roofline of its math at the sustained rate and
    its operands' traffic (the 2-norm of the two times: equal to the larger far from the ridge,
    √2 of it at the ridge, where narrow GEMMs such as GQA's k/v projections or a 896-wide
    model's sit)."""
    return math.hypot(2 * tokens * k * n / flops_s, c * (tokens * k + k * n + tokens * n) / bytes_s)


def layer_gemms(model: ModelSpec, tp: int, ep: int = 1, etp: int | None = None) -> list[tuple[float, float, float]]:
    """(k, n, share of tokens) of one decoder layer's linears (Llama-block widths; the total is
    rescaled to the layer's exact parameter count in `compute_time`); under expert parallelism
    `ep`, a rank's num_experts/ep experts split over `etp` ranks (plan/experts.py expert_gemms)."""
    h, q, kv = model.hidden_size, model.q_dim / tp, model.kv_dim / tp
    i = model.intermediate_size / tp
    if model.is_gpt:  # fused QKV, output projection, 4h MLP (fc1, fc2)
        return [(h, q + 2 * kv, 1.0), (q, h, 1.0), (h, i, 1.0), (i, h, 1.0)]
    out = [(h, q, 1.0), (h, kv, 1.0), (h, kv, 1.0), (q, h, 1.0)]
    if model.is_moe:
        out.append((h, model.num_experts, 1.0))  # router
        out += expert_gemms(model, tp, ep, etp)  # each expert sees k/E of the tokens (k·ep/E of a rank's under EP)
    else:
        out += [(h, i, 1.0), (h, i, 1.0), (i, h, 1.0)]
    return out


def packing_bytes(model: ModelSpec, train: TrainSpec, tp: int, eager: bool, replay: float) -> float:
    """Memory-bound bytes of one layer and micro-batch that packed documents add. dense: the
    broadcast [B, 1, S, S] mask is read once per head (the kernels tile by batch and head), in
    forward (eager's add, SDPA), in SDPA's backward and in a replayed forward (`replay` 1 under
    full checkpointing). sdpa_varlen: the per-document outputs concatenated, written and read in
    forward, the gradient sliced back in backward (4·c·o per token). The other kernels: none."""
    c, tokens = train.compute_bytes, train.micro_batch * train.seq_len
    if train.packed_attention == "dense":
        reads = (1 if eager else 2) + replay
        return model.num_heads / tp * tokens * train.seq_len * c * reads
    if train.packed_attention == "sdpa_varlen":
        return tokens * 4 * c * model.o_dim / tp
    return 0.0


def elementwise_bytes(model: ModelSpec, train: TrainSpec, autocast: bool, tp: int) -> float:
    """Memory-bound bytes per token of one layer's forward outside GEMMs and attention: two
    RMSNorms with their fp32 upcast (HF `LlamaRMSNorm`: cast, pow, mean, rsqrt, mul, cast back,
    weight), two residual adds, RoPE on q and k, SiLU and the gate product, the attention
    output's reshape (GPT blocks: LayerNorm kernels, GeLU, no RoPE). Residual stream in fp32
    under autocast. Backward moves about twice the forward's bytes. A fused RMSNorm
    (`TrainSpec.norm_fused`: torchtitan's fused_rmsnorm, Liger, apex, torch.compile) reads its
    input and writes its output once, as GPT's LayerNorm kernel does (the per-row rstd and the
    weight are negligible per token).

    Under TP the head- and intermediate-wide work (RoPE, activation, reshape) is split; the
    hidden-wide work (norms, residual adds, the casts of the norms' outputs) is split only under
    sequence parallelism, where each rank holds s/tp of the tokens of those tensors: the same
    split `activations.seq_shards` gives their saved bytes."""
    c = train.compute_bytes
    r = 4 if autocast else c
    h, q, kv, i = model.hidden_size, model.q_dim / tp, model.kv_dim / tp, model.intermediate_size / tp
    sp = seq_shards(train, tp)
    if model.is_moe:
        i *= model.experts_per_token
    if model.is_gpt:  # LayerNorm (one fused kernel), no RoPE, GeLU, fused QKV fed once
        norms = 2 * h * (r + c)
        residual = 2 * 3 * r * h + (2 * (4 + c) * h if autocast else 0)
        return (norms + residual) / sp + 2 * c * i + 2 * c * q
    norms = 2 * h * (r + c) if train.norm_fused else 2 * h * (r + 28 + 3 * c)
    residual = 2 * 3 * r * h
    if autocast:  # each linear fed by a norm casts its fp32 input: q, k, v, gate, up
        residual += 5 * (4 + c) * h
    rope = 11 * c * (q + kv)
    # SiLU (read gate, write act) and the product (read act and up, write it): 5·c·I; one fused
    # kernel (`fused_mlp`, dense MLPs) reads gate and up and writes the product: 3·c·I
    act = (3 if train.fused_mlp and not model.is_moe else 5) * c * i
    reshape = 2 * c * q
    return (norms + residual) / sp + rope + act + reshape


def loss_bytes_per_token(model: ModelSpec, train: TrainSpec, tp: int = 1) -> float:
    """Memory-bound bytes per token of the loss over the vocabulary (after lm_head's GEMM).
    standard (HF `ForCausalLMLoss`): the fp32 upcast, log-softmax (two reads, one write), NLL's
    gradient, log-softmax backward, the cast back; chunked (the trainer's, shardwise.train.model.loss):
    per chunk the upcast, log-softmax, and exp(log-softmax) written once in the compute dtype
    as the gradient (no NLL gradient, no log-softmax backward; fp32: exp in place), plus the
    row masks on the h-sized tensors. Gemma's soft-cap: standard runs HF's div, tanh and multiply
    in the compute dtype and their backward (13·c·V); chunked runs them in place in the compute
    dtype, then exp in place, the square and one fused multiply-add for the slope ((6c + 24)·V
    more). Fused linear + cross-entropy (Liger) computes the softmax in place on small row
    blocks; the in-place kernel (flash-attn) reads the 16-bit logits and overwrites them with
    their gradient."""
    v, c = model.vocab_size / tp, train.compute_bytes
    if train.cross_entropy == "fused":
        return (8 + 2 * c) * v
    if train.cross_entropy == "inplace" or (train.cross_entropy == "chunked-output" and train.fused_kernels):
        # read the logits twice (max/sum, then loss), write the gradient: flash-attn's kernel, and
        # torchtune's compiled chunk loss (its upcast and softmax fused into those passes)
        return 3 * c * v
    if train.cross_entropy == "chunked":
        upcast = c + 4 if c < 4 else 0
        softcap = (6 * c + 24) * v if model.final_logit_softcapping else 0.0
        return (upcast + 12 + 4 + c) * v + softcap + 4 * c * model.hidden_size
    upcast = 2 * (c + 4) if c < 4 else 0  # .float() and its backward cast
    softcap = 13 * c * v if model.final_logit_softcapping else 0.0
    return (28 + upcast) * v + softcap


def update_bytes(train: TrainSpec) -> float:
    """Bytes per parameter the optimizer's update kernel moves (AdamW: OPTIMIZER_BYTES by kernel).
    Block-quantized AdamW (one fused kernel per tensor: bitsandbytes' CUDA kernel, torchao's
    compiled step) reads and writes the weight, reads the gradient, and reads and writes its
    quantized states, and spends its quantization work (`LOW_BIT_WORK_BYTES`, as bytes)."""
    if train.optimizer in LOW_BIT_STATE_BYTES:
        return 3 * train.master_bytes + 2 * LOW_BIT_STATE_BYTES[train.optimizer] + LOW_BIT_WORK_BYTES[train.optimizer]
    b = OPTIMIZER_BYTES[train.optimizer_impl] * train.master_bytes / 4  # scaled from fp32 by the state dtype
    return b * 0.5 if train.optimizer == "sgd" else b


def ce_chunks(train: TrainSpec) -> int:
    """Chunks of the trainer's chunked cross-entropy per micro-batch (0 for the others)."""
    return -(-train.tokens_per_micro_batch // train.ce_chunk) if train.cross_entropy == "chunked" else 0


def head_gemm_time(model: ModelSpec, train: TrainSpec, tp: int, flops_s: float, bytes_s: float) -> float:
    """lm_head's GEMMs of one micro-batch: forward, input gradient and (when lm_head trains)
    weight gradient. Chunked (shardwise.train.model.loss): the same three per chunk of `ce_chunk`
    tokens, each reading the [V, H] weight again, and the weight gradient accumulating in place
    (every chunk after the first also reads the accumulator: c·V·H more bytes). At 1024 tokens
    these GEMMs stay compute-bound (~chunk/c FLOP per byte), so the soft roofline charges the
    extra traffic little."""
    c, h, v = train.compute_bytes, model.hidden_size, model.vocab_size / tp
    trains = head_trainable(train)
    tokens = train.tokens_per_micro_batch
    if train.cross_entropy != "chunked":
        return (3 if trains else 2) * gemm_time(tokens, h, v, flops_s, bytes_s, c)

    def chunk(m: int, accumulate: bool) -> float:
        t = 2 * gemm_time(m, h, v, flops_s, bytes_s, c)
        if trains:
            t += math.hypot(2 * m * h * v / flops_s, c * (m * (h + v) + (2 if accumulate else 1) * h * v) / bytes_s)
        return t

    full, rest = divmod(tokens, train.ce_chunk)
    if not full:
        return chunk(rest, False)
    return chunk(train.ce_chunk, False) + (full - 1) * chunk(train.ce_chunk, True) + (chunk(rest, True) if rest else 0.0)
