"""Activation and logit memory per GPU: bytes saved for backward, derived for the real HF block.

Korthikanti et al. 2022 (Table 2) give sbh(34 + 5as/h) for a GPT block with dropout and a
4h GeLU MLP. The Llama/Qwen/Mistral block differs (RMSNorm, SwiGLU, RoPE, no dropout), so we
derive each saved tensor of `transformers`' decoder layer instead (docs/planner.md has the
walk-through) and check the sum by measuring saved-for-backward bytes
(tests/test_measured_memory.py). c = bytes of the compute dtype, x = s·b tokens.
"""

from __future__ import annotations

from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec


def rmsnorm_saved(c: int, h: int, consumers: int = 1, autocast: bool = False) -> float:
    """Per token: HF LlamaRMSNorm upcasts to fp32 (saved by pow/mul: 4h), saves the normalised
    tensor for the weight's grad (c·h) and its output is saved by the next linear (c·h), plus
    the fp32 rsqrt(variance). Under torch.autocast (fp32 module, DDP) the residual stream is
    fp32: the input (4h) and the normalised tensor (4h) are fp32, and each of the `consumers`
    linears (q/k/v: 3, gate/up: 2) saves its own bf16 cast of the output (autocast caches
    casts of weights, not of activations; measured: 67.75·sbh per tiny-Llama layer)."""
    if autocast:
        return 8 * h + c * h * consumers + 4
    return (4 + 2 * c) * h + 4


def _norms(model: ModelSpec, train: TrainSpec, autocast: bool) -> float:
    """Both norms of a layer: input_layernorm feeds q/k/v, post_attention_layernorm gate/up."""
    c, h = train.compute_bytes, model.hidden_size
    return rmsnorm_saved(c, h, 3, autocast) + rmsnorm_saved(c, h, 2, autocast)


def attention_saved(model: ModelSpec, train: TrainSpec, tp: int) -> float:
    """Per token, one layer's attention block (q/k/v/o projections and the core), TP-sharded."""
    c, s = train.compute_bytes, train.seq_len
    q, kv, heads = model.q_dim / tp, model.kv_dim / tp, model.num_heads / tp
    core = 0.0
    if train.checkpointing != "selective":
        # SDPA/flash save q, k, v (GQA native when unmasked), output, and fp32 logsumexp per head.
        core = c * (q + 2 * kv) + c * q + 4 * heads
        if train.attention == "eager":
            # k, v repeated to all heads (repeat_kv copies), softmax in fp32 saved (4·a·s per token)
            # and its cast back to c (unless fp32) saved by the value matmul; no logsumexp.
            core = c * 3 * q + 4 * heads * s + (c * heads * s if c != 4 else 0)
    # o_proj saves its input. With SDPA/flash the kernel's output is already laid out
    # [b, s, heads, d], so HF's transpose(1, 2).contiguous() is free and o_proj's input is the
    # storage SDPA saved (measured: one copy). Eager's matmul output needs a real copy.
    return core + (c * q if train.attention == "eager" or train.checkpointing == "selective" else 0)


def mlp_saved(model: ModelSpec, train: TrainSpec, tp: int) -> float:
    """Per token: SwiGLU saves gate (for SiLU), silu(gate) and up (for the product) and the
    product (for down_proj): 4·c·I. MoE: each token visits k experts, plus the router."""
    c, i = train.compute_bytes, model.intermediate_size / tp
    if not model.is_moe:
        return 4 * c * i
    k, e = model.experts_per_token, model.num_experts
    return k * (4 * c * i + c * model.hidden_size) + 4 * 2 * e  # routed copies + fp32 router softmax


def layer_saved_per_token(model: ModelSpec, train: TrainSpec, tp: int = 1, autocast: bool = False) -> float:
    """Bytes saved per token by one decoder layer without checkpointing (TP without sequence
    parallelism: norms and residuals are replicated, attention and MLP internals split).
    Attention and MLP save the same under autocast: their linears already produce bf16."""
    return _norms(model, train, autocast) + attention_saved(model, train, tp) + mlp_saved(model, train, tp)


def activation_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1, pp: int = 1,
                     autocast: bool = False) -> float:
    """Saved-for-backward bytes per GPU at the end of forward (the activation peak).
    `autocast`: an fp32 module under torch.autocast (DDP mixed precision) instead of a module
    in the compute dtype (DeepSpeed bf16/fp16, FSDP2 param_dtype)."""
    tokens = train.micro_batch * train.seq_len
    layers = -(-model.num_layers // pp)  # worst pipeline stage
    per_layer = layer_saved_per_token(model, train, tp, autocast)
    c, h = train.compute_bytes, model.hidden_size
    if train.checkpointing == "full":
        # Only each layer's input is kept (Korthikanti et al. §4.1: 2sbh per layer in 16-bit;
        # the fp32 residual stream under autocast); the layer recomputed in backward is
        # `recompute_bytes`.
        body = layers * (4 if autocast else c) * h
    else:
        body = layers * per_layer
    final_norm = rmsnorm_saved(c, h, 1, autocast)  # its output feeds lm_head
    # 1F1B keeps up to pp micro-batches in flight on the first stage (Megatron's 1F1B schedule).
    in_flight = pp if pp > 1 else 1
    return tokens * (body + final_norm) * in_flight


def recompute_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1, autocast: bool = False) -> float:
    """With checkpointing, backward recomputes one layer at a time: its full saved set is live
    on top of the kept checkpoints (full) or its attention core is (selective)."""
    tokens = train.micro_batch * train.seq_len
    if train.checkpointing == "full":
        # The recomputed layer's input is the kept checkpoint (same storage), and by the time
        # backward reaches the last layer the final norm's saved tensors are already freed
        # (measured: benchmarks/results/measured_activations.json, peak_with_recompute).
        full = layer_saved_per_token(model, train.model_copy(update={"checkpointing": "none"}), tp, autocast)
        kept = (4 if autocast else train.compute_bytes) * model.hidden_size
        return tokens * max(0.0, full - kept - rmsnorm_saved(train.compute_bytes, model.hidden_size, 1, autocast))
    if train.checkpointing == "selective":
        full = attention_saved(model, train.model_copy(update={"checkpointing": "none"}), tp)
        return tokens * (full - attention_saved(model, train, tp))
    return 0.0
