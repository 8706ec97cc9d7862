"""Activation memory per GPU: bytes saved for backward, derived for the real HF decoder blocks.

Korthikanti et al. 2022 (Table 2) give sbh(34 + 5as/h) for a GPT block with dropout and a
4h GeLU MLP. The transformers blocks differ (RMSNorm, SwiGLU/GeGLU, RoPE, no dropout, q/k
norms, sandwich or post norms, fused projections, MLA, routed experts), so we derive each
saved tensor of `transformers`' decoder layer per family (docs/planner.md has the walk-through)
and check the sums by measuring saved-for-backward bytes (tests/accuracy/test_measured_memory.py,
shardwise.bench.saved.SHAPES: a tiny config of every family). c = bytes of the compute dtype,
x = s·b tokens; everything below is per token.

Families read on the meta device (`family="hf"`) are planned with the Llama block (pre-norm
RMSNorm, q/k/v/o, SwiGLU, routed experts as in Mixtral) at their config's widths: their
inventory is exact, their activations are this approximation (checked on Granite).

GPT-style blocks (mpt, gpt2: the block of Korthikanti et al. without dropout) are derived the
same way from transformers' MptBlock / GPT2Block: LayerNorm saves its input and the per-row
mean and rstd (`layernorm_saved`), the fused QKV projection's output is what the attention core
keeps of q, k and v, the MLP saves fc1's output for the activation and the activation's output
for fc2 (`GPT_ACT_SAVED`). Dropout is not modelled (the trainer and llm-foundry's MPT runs use
none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardwise.plan.lora import dropout_saved_per_token
from shardwise.plan.pipeline import PipelineRank, in_flight_peak, pipeline_ranks, rank_actions
from shardwise.plan.selective import mm_order
from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec

# Norms that keep the normalised tensor in fp32 for the weight's grad: Gemma's
# `(x.float() * (1 + w.float())).type_as(x)` (gemma/modeling_gemma.py GemmaRMSNorm) and OLMo 2's
# `(w * x).to(dtype)` (olmo2/modeling_olmo2.py Olmo2RMSNorm). Llama's `w * x.to(dtype)` keeps it in c.
_FP32_NORM = ("gemma", "gemma2", "gemma3_text", "olmo2")
_SANDWICH = ("gemma2", "gemma3_text")
# GPT-style MLP: I-wide tensors saved by the activation and by fc2 (its input, the activation's
# output) per token, measured on transformers' ACT2FN modules (fp32 and bf16 alike): exact GeLU
# and the C tanh GeLU save their input (fc1's output) and fc2 their output (2); ReLU, tanh and
# sigmoid save their output, which is fc2's input (1); the Python compositions save their
# intermediates (gelu_new: input, tanh, 0.5·x and 1 + tanh, then the output: 5). Keys:
# specs.families.GPT_ACTIVATIONS (tests/plan/test_families_activations.py measures each).
GPT_ACT_SAVED = {"gelu": 2, "gelu_pytorch_tanh": 2, "gelu_new": 5, "gelu_fast": 8, "gelu_python": 4,
                 "gelu_accurate": 5, "gelu_10": 3, "quick_gelu": 3, "relu": 1, "silu": 2, "mish": 2, "tanh": 1,
                 "sigmoid": 1}
# activations whose one saved tensor is their output, which fc2 reads too (GPT_ACT_SAVED 1)
_SAVES_OUTPUT = ("relu", "tanh", "sigmoid")


def rmsnorm_saved(c: int, h: float, consumers: int = 1, autocast: bool = False, fp32_normed: bool = False,
                  rows: float = 1) -> float:
    """One RMSNorm over width h (`rows` normalised rows per token). HF upcasts to fp32 (saved by
    pow/mul: 4h), keeps the fp32 rsqrt(variance) per row and the normalised tensor for the
    weight's grad (c·h in Llama's layout, 4h when `fp32_normed`); its output is saved once by
    the next linear(s) (c·h) when `consumers` > 0. Under torch.autocast (fp32 module, DDP) the
    residual stream is fp32: input and normalised tensor are fp32 (8h) and each of the
    `consumers` linears (q/k/v: 3, gate/up: 2) saves its own bf16 cast of the output
    (autocast caches casts of weights, not of activations; measured: 67.75·sbh per tiny-Llama
    layer)."""
    if autocast:
        return 8 * h + c * h * consumers + 4 * rows
    return (4 + (4 if fp32_normed else c)) * h + 4 * rows + (c * h if consumers else 0)


def layernorm_saved(c: int, h: float, consumers: int = 1, autocast: bool = False) -> float:
    """One torch LayerNorm over width h (`native_layer_norm`, weight and bias or not): its input
    (c·h; the fp32 residual stream under autocast, where layer_norm runs in fp32) and the fp32
    mean and rstd per row (8: CUDA keeps them in fp32; CPU keeps them in the input dtype, 4
    bytes fewer in bf16, measured); its output is saved once by the next linear (c·h; under
    autocast the bf16 cast each of the `consumers` linears makes of the fp32 output)."""
    if autocast:
        return 4 * h + 8 + c * h * consumers
    return c * h + 8 + (c * h if consumers else 0)


def _norm(model: ModelSpec, train: TrainSpec, consumers: int, autocast: bool) -> float:
    if model.is_gpt:
        return layernorm_saved(train.compute_bytes, model.hidden_size, min(consumers, 1), autocast)
    if train.norm_fused and not autocast:
        # one fused kernel (torchtitan's fused_rmsnorm, Liger, torch.compile): its input and the
        # fp32 rstd per row are saved, not HF's fp32 upcast chain; the output as before
        c, h = train.compute_bytes, model.hidden_size
        return c * h + 4 + (c * h if consumers else 0)
    return rmsnorm_saved(train.compute_bytes, model.hidden_size, consumers, autocast,
                         fp32_normed=model.family in _FP32_NORM)


def seq_shards(train: TrainSpec, tp: int) -> int:
    """How many ways the norm/residual tensors are split: tp under sequence parallelism
    (Korthikanti et al. 2022 §4.2.2: sbh(34 + 5as/h)/t instead of sbh(10 + 24/t + 5as/(ht)))."""
    return tp if tp > 1 and train.sequence_parallel else 1


def input_linears(model: ModelSpec) -> tuple[int, int]:
    """Linears reading the attention block's input and the MLP block's input of a dense layer:
    q, k, v and gate, up in Llama's layout (3, 2); Phi-3's fused qkv_proj and gate_up_proj (1, 1);
    MLA's q_a and kv_a (2, 2); GPT's fused QKV and fc1 (1, 1). Under TP these are the column-parallel
    linears (plan.comm: AutoTP all-reduces each one's input gradient)."""
    if model.is_gpt or model.family == "phi3":
        return 1, 1
    return (2, 2) if model.is_mla else (3, 2)


def _norms(model: ModelSpec, train: TrainSpec, autocast: bool, moe: bool = False, tp: int = 1) -> float:
    """A layer's hidden-width norms and, for post-norm-only OLMo 2, the residual-stream inputs
    its projections save instead; replicated under TP, split by sequence parallelism. Linears
    reading a norm's output under autocast: q/k/v 3 (Phi-3's qkv_proj 1, MLA's q_a/kv_a 2),
    gate/up 2 (Phi-3's gate_up_proj 1; MoE: router 1, shared expert gate/up 2, its gate 1)."""
    c, h, f = train.compute_bytes, model.hidden_size, model.family
    qkv, mlp = input_linears(model)
    if moe:  # the router's linear (DeepSeek's upcasts instead), the shared expert's gate/up and gate
        shared = model.shared_expert_intermediate_size > 0
        mlp = (f != "deepseek_v3") + 2 * shared + (f == "qwen2_moe" and shared)
    if model.is_gpt:  # norm 1 read by the fused qkv projection, norm 2 by fc1
        out = 2 * _norm(model, train, 1, autocast)
    elif f in _SANDWICH:  # input, post_attention (no linear reads it), pre_feedforward, post_feedforward
        out = (_norm(model, train, qkv, autocast) + _norm(model, train, 0, autocast)
               + _norm(model, train, mlp, autocast) + _norm(model, train, 0, autocast))
    elif f == "olmo2":  # post_attention, post_feedforward; q/k/v and gate/up read the residual itself
        residual = c * h * (qkv + mlp) if autocast else 2 * c * h
        out = 2 * _norm(model, train, 0, autocast) + residual
    else:
        out = _norm(model, train, qkv, autocast) + _norm(model, train, mlp, autocast)
    fp8 = train.linear_saved_input_bytes
    if fp8 is not None and not autocast:
        # Transformer Engine's qkv and fc1 keep their input (the norm's output, which nothing
        # else saves) in fp8; an MoE layer's is read by the router and the experts' dispatch
        out -= (1 if moe else 2) * (c - fp8) * h
    return out / seq_shards(train, tp)


def mask_bytes(train: TrainSpec) -> float:
    """The dense packing mask of one micro-batch (`packed_attention: dense`): the collator's
    additive [B, 1, S, S] in the compute dtype, an input every layer's attention keeps (no copy)
    from the first layer's forward to its backward. The document-aware kernels need none."""
    if train.packed_attention != "dense":
        return 0.0
    return train.micro_batch * train.seq_len ** 2 * train.compute_bytes


def attention_kind(model: ModelSpec, train: TrainSpec) -> str:
    """The attention the HF model runs: Gemma2 has no SDPA path in transformers
    (Gemma2PreTrainedModel._supports_sdpa = False, for its logit softcapping): sdpa runs eager.
    MPT has none either (transformers' MptAttention is eager only and `from_config(...,
    attn_implementation="sdpa")` raises), but its published runs are llm-foundry's flash/triton
    kernels: for mpt, sdpa/flash plan that fused core (`attention_saved`) and eager plans what
    transformers' MptForCausalLM runs."""
    if model.family == "gemma2" and train.attention == "sdpa":
        return "eager"
    return train.attention


def _qk_norms(model: ModelSpec, train: TrainSpec, tp: int) -> float:
    """Qwen3/Gemma3 RMSNorm over head_dim on q and k (heads split by TP); OLMo 2's over the full
    q and kv widths (transformers gathers them under TP: replicated). Nothing else: RoPE's
    products save only cos/sin, shared by every layer."""
    c, f = train.compute_bytes, model.family
    if f in ("qwen3", "qwen3_moe", "gemma3_text"):
        q, kv = model.q_dim / tp, model.kv_dim / tp
        rows = (model.num_heads + model.num_kv_heads) / tp
        return rmsnorm_saved(c, q + kv, 0, fp32_normed=f in _FP32_NORM, rows=rows)
    if f == "olmo2":
        return rmsnorm_saved(c, model.q_dim, 0, fp32_normed=True) + rmsnorm_saved(c, model.kv_dim, 0, fp32_normed=True)
    return 0.0


def _mla_low_rank(model: ModelSpec, train: TrainSpec) -> float:
    """DeepSeek MLA's compressed path (deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention):
    q_a_layernorm and kv_a_layernorm (RMSNorm, their outputs read by q_b_proj / kv_b_proj).
    Replicated under TP (the low-rank projections are not split)."""
    c = train.compute_bytes
    out = rmsnorm_saved(c, model.kv_lora_rank, 1)
    if model.q_lora_rank:
        out += rmsnorm_saved(c, model.q_lora_rank, 1)
    return out


def attention_saved(model: ModelSpec, train: TrainSpec, tp: int, autocast: bool = False) -> float:
    """Per token, one layer's attention block (projections, q/k norms, the core), TP-sharded,
    without checkpointing. `autocast` matters only for GPT-2's eager softmax.

    GPT-style blocks (mpt, gpt2) keep the Llama derivation with the fused projection: under
    sdpa/flash the kernel saves q, k and v — transposed views of the one QKV output, so that
    storage, c·(q + 2·kv) — its output (which the output projection reads without a copy: q is
    a transposed view, so the kernel lays its output out [b, s, heads, d]) and the fp32
    logsumexp: measured on GPT-2's SDPA path. MPT's flash variant (llm-foundry's attn_impl
    flash/triton; transformers' MPT has no SDPA path) is this same fused core in place of the
    eager one measured on transformers' MptAttention: no s² scores."""
    c, s = train.compute_bytes, train.seq_len
    heads = model.num_heads / tp
    q, kv, o = model.q_dim / tp, model.kv_dim / tp, model.o_dim / tp
    kind = attention_kind(model, train)
    # What the core saves as its value: a view of the projection output it was sliced from
    # keeps that whole storage: MLA's kv_b_proj output [k_nope | v] (heads·(qk_nope + v_head_dim)),
    # Phi-3's qkv_proj output (q + 2·kv); elsewhere v itself.
    v_store = kv
    if model.is_mla:
        v_store = heads * (model.qk_nope_head_dim + model.v_head_dim)
    elif model.family == "phi3":
        v_store = q + 2 * kv
    if kind == "eager":
        # q, k and v repeated to all heads (repeat_kv copies), softmax in fp32 saved (4·a·s
        # per token) and its cast back to c (unless fp32) saved by the value matmul; Gemma2's
        # logit softcapping saves tanh's output (c·a·s); no logsumexp.
        # GPT-style: q, k, v are views of the fused projection's output, and the 4-D matmuls copy
        # each (3·c·h); MPT upcasts the scores (`softmax(scores.float())`, and its fp32 ALiBi
        # bias makes them fp32 anyway) like Llama; GPT-2 takes the softmax in the compute dtype
        # (c·a·s), in fp32 plus the cast under autocast (softmax is on autocast's fp32 list).
        v_rep = heads * model.v_head_dim if model.is_mla else q
        core = c * (2 * q + v_rep) + 4 * heads * s + (c * heads * s if c != 4 else 0)
        if model.family == "gemma2":
            core += c * heads * s
        if model.family == "gpt2" and not autocast:
            core = c * (2 * q + v_rep) + c * heads * s
    else:
        # SDPA/flash save q, k, v (GQA native when unmasked), output, and fp32 logsumexp per head.
        k_store = q if model.is_mla else kv  # MLA expands k to every head
        if train.packed_attention == "dense" and kv < q and not model.is_mla:
            # with a mask transformers repeats GQA's k and v to every head for SDPA (use_gqa_in_sdpa
            # holds only without one): the repeated copies are saved (measured: tiny Qwen2, +c·2(q − kv))
            k_store = v_store = q
        core = c * (q + k_store + v_store) + c * o + 4 * heads
        if train.packed_attention == "sdpa_varlen":
            # one SDPA call per document: each keeps its own output, and o_proj reads their
            # concatenation, a second copy (measured: +c·o on tiny Llama and Qwen2, fp32 and bf16)
            core += c * o
    # o_proj saves its input. With SDPA/flash the kernel's output is already laid out
    # [b, s, heads, d] when q is a transposed view of its projection, so HF's
    # transpose(1, 2).contiguous() is free and o_proj's input is the storage SDPA saved
    # (measured: one copy). Phi-3 (q sliced from qkv_proj) and MLA (q concatenated from its
    # nope/rope parts) hand SDPA a [b, heads, s, d] query: measured on CPU, o_proj then saves
    # a copy. Eager's matmul output always needs one.
    copy = kind == "eager" or model.family == "phi3" or model.is_mla
    out = core + (c * o if copy else 0) + _qk_norms(model, train, tp)
    fp8 = train.linear_saved_input_bytes
    if fp8 is not None:  # Transformer Engine's o_proj keeps an fp8 cast: beside the core's output, or for its copy
        out += fp8 * o - (c * o if copy else 0)
    if model.is_mla:
        out += _mla_low_rank(model, train)
    return out


def _router(model: ModelSpec, train: TrainSpec) -> float:
    """The router of one MoE layer (its linear reads the norm output, booked with the norm).
    Qwen2/3-MoE: softmax in fp32 (4E) and top-k indices (8k). Mixtral adds the in-place top-k
    renormalisation (the fp32 top-k values and their sum). DeepSeek-V3: the fp32 upcast of the
    input (4h), sigmoid scores (4E), group top-2 and group top-k indices, the bool expert
    mask, top-k indices, and the normalisation (fp32 weights and their sum)."""
    e, k = model.num_experts, model.experts_per_token
    if model.family == "deepseek_v3":
        return 4 * model.hidden_size + 4 * e + 16 * model.n_group + 8 * model.topk_group + e + 8 * k + 4 + 4 * k
    if model.family in ("qwen2_moe", "qwen3_moe"):
        return 4 * e + 8 * k
    return 4 * e + 8 * k + 4 + 4 * k  # mixtral and meta-path MoE


def moe_saved(model: ModelSpec, train: TrainSpec, tp: int, autocast: bool = False, etp: int | None = None) -> float:
    """One MoE layer's MLP with transformers 5.x fused experts (`grouped_mm`, integrations/moe.py
    grouped_mm_experts_forward): per routed copy (k per token) the gathered input and the down
    output (c·h each), the gate_up output, act(gate) and the product (4c·I'), the routing weight
    (fp32, c for Qwen's cast) and three int64 permutation indices; plus the router and the
    shared expert (Qwen2-MoE: SwiGLU, sigmoid gate and the gated product; DeepSeek: SwiGLU).
    Under autocast the fused experts run in fp32 (autocast does not cast the grouped matmul's
    3-D weights), so their tensors are 4-byte. Under expert parallelism with whole experts
    (`etp` 1 < tp: plan/experts.py) a TP rank holds the copies of its tokens/tp only, each
    intermediate full-width: k/tp per token of its layer's, the same 4c·I'/tp of intermediates;
    at etp = tp (the default) the copies of all the TP group's tokens, split over I'."""
    c, h, k = train.compute_bytes, model.hidden_size, model.experts_per_token
    etp = tp if etp is None else etp
    weight = c if model.family in ("qwen2_moe", "qwen3_moe") else 4
    ce = 4 if autocast else c
    routed = k * (etp / tp * (2 * ce * h + weight + 24) + 4 * ce * model.expert_width / tp)
    shared = model.shared_expert_intermediate_size / tp
    out = _router(model, train) + routed + gated_saved(train) * c * shared  # the shared expert: a gated MLP
    if model.family == "qwen2_moe" and shared:
        out += c * h + c  # shared_expert_gate: sigmoid output and the shared output it scales
    return out


def gated_saved(train: TrainSpec) -> int:
    """Intermediate-wide tensors a gated MLP (SwiGLU, GeGLU) saves per token: gate, act(gate), up
    and the product in eager PyTorch; gate and up (the fused kernel's inputs, act recomputed in its
    backward) and the product (down_proj's input) under `fused_mlp` (Liger's LigerSiLUMulFunction
    `ctx.save_for_backward(a, b)`: linkedin/Liger-Kernel@3baaa6b src/liger_kernel/ops/swiglu.py)."""
    return 3 if train.fused_mlp else 4


def mlp_saved(model: ModelSpec, train: TrainSpec, tp: int, moe: bool | None = None,
              autocast: bool = False, etp: int | None = None) -> float:
    """Per token: SwiGLU/GeGLU save gate (for the activation), act(gate) and up (for the
    product) and the product (for down_proj): 4·c·I, 3·c·I fused (`gated_saved`; Phi-3's fused
    gate_up_proj saves its whole output once: the same 4·c·I). A GPT-style MLP (fc1, activation,
    fc2) saves `GPT_ACT_SAVED[hidden_act]`·c·I: 2·c·I for GeLU (fc1's output, GeLU's output).
    `moe`: a routed-experts layer (default: the model's layer kind if all layers agree, else MoE);
    `etp`: the TP ranks its experts are split over (`moe_saved`)."""
    if moe is None:
        moe = model.is_moe
    if moe:
        return moe_saved(model, train, tp, autocast, etp)
    c, width = train.compute_bytes, model.intermediate_size / tp
    if model.is_gpt:  # fc1's output and/or the activation's intermediates, fc2's input (GPT_ACT_SAVED)
        saved, shared = GPT_ACT_SAVED[model.hidden_act], model.hidden_act in _SAVES_OUTPUT
    else:
        saved, shared = gated_saved(train), False
    fp8 = train.linear_saved_input_bytes
    if fp8 is None:
        return saved * c * width
    # Transformer Engine's down projection (fc2) keeps its input in fp8: in place of the product's
    # (or the activation output's) c-byte copy, beside it where the activation saves its own output
    return (saved - (0 if shared else 1)) * c * width + fp8 * width


def layer_saved_per_token(model: ModelSpec, train: TrainSpec, tp: int = 1, autocast: bool = False,
                          moe: bool | None = None, etp: int | None = None) -> float:
    """Bytes saved per token by one decoder layer without checkpointing (TP splits attention and
    MLP internals; norms and residuals are split only under sequence parallelism).
    Attention and MLP save the same under autocast: their linears already produce bf16.
    `moe` picks the layer kind where dense and MoE layers differ (default: MoE if any); `etp` the
    TP ranks its routed experts are split over (default tp: `moe_saved`)."""
    if moe is None:
        moe = model.is_moe
    return (_norms(model, train, autocast, moe, tp) + attention_saved(model, train, tp, autocast)
            + mlp_saved(model, train, tp, moe, autocast, etp)
            + dropout_saved_per_token(model, train, tp, autocast, moe, seq_shards(train, tp)))


def final_norm_saved(model: ModelSpec, train: TrainSpec, autocast: bool = False, tp: int = 1) -> float:
    """The final norm, its output read by lm_head."""
    return _norm(model, train, 1, autocast) / seq_shards(train, tp)


def selective_saved_per_token(model: ModelSpec, train: TrainSpec, tp: int = 1, autocast: bool = False,
                              moe: bool | None = None) -> float:
    """One decoder layer under torchtitan's per-op selective activation checkpointing
    (torchtitan/models/llama3/infra/parallelize.py `_save_list` / `_custom_policy`, non-reentrant
    `create_selective_checkpoint_contexts`, a fresh mm counter per layer call): the outputs of
    mm, SDPA (flash / memory-efficient: output and logsumexp), reduce_scatter and max are saved,
    except every second mm of the layer (the 1st, 3rd, ... of `mm_order` are kept); everything
    else is replayed in backward. Plus the checkpoint's input (the layer input) and, under
    sequence parallelism, the two reduce-scatter outputs. Eager attention is replayed."""
    if moe is None:
        moe = model.is_moe
    c, h = train.compute_bytes, model.hidden_size
    kept = sum(width / (tp if split else 1) * (nbytes or c)
               for i, (_, width, split, nbytes) in enumerate(mm_order(model, moe)) if i % 2 == 0)
    if attention_kind(model, train) != "eager":
        kept += (c * model.o_dim + 4 * model.num_heads) / tp
    if seq_shards(train, tp) > 1:
        kept += 2 * c * h / tp
    return kept + (4 if autocast else c) * h / seq_shards(train, tp)


def layer_kinds(model: ModelSpec) -> tuple[bool, ...]:
    """Per decoder layer: planned as a routed-experts layer (True) or a dense one. A model read on
    the meta device (an inventory) is planned with one kind for every layer."""
    return model.moe_layers if model.inventory is None else (model.is_moe,) * model.num_layers


def gathered_inputs(model: ModelSpec, train: TrainSpec, tp: int, autocast: bool = False) -> tuple[float, float]:
    """Per token, what DTensor's tensor parallelism saves beyond Megatron-LM's sequence
    parallelism: (per decoder layer, at lm_head). ColwiseParallel (the trainer's TP plan,
    shardwise.train.model.tensor_parallel, and torchtitan's `parallelize_llama`) all-gathers a block's
    input before its linears, which then save that gathered input; Megatron-SP's linears save
    the sequence-sharded input and all-gather it again in backward (Korthikanti et al. 2022
    §4.2.2), which is what `_norms` counts. The difference is (1 − 1/tp) of the linears' saved
    input: once per block (q/k/v share one tensor, gate/up another), or under autocast each
    linear's own cast (q, k, v; gate, up). Measured: tests/train/test_tp_saved.py."""
    if seq_shards(train, tp) == 1:
        return 0.0, 0.0
    c, h, rest = train.compute_bytes, model.hidden_size, 1 - 1 / tp
    if autocast:
        qkv, mlp = input_linears(model)
        return c * h * (qkv + mlp) * rest, c * h * rest
    return 2 * c * h * rest, c * h * rest


def stage_saved(model: ModelSpec, train: TrainSpec, tp: int, layers: Sequence[int], last: bool,
                autocast: bool = False, gathered: bool = False, etp: int | None = None) -> float:
    """Saved-for-backward bytes of one micro-batch's forward through one pipeline stage: its
    decoder `layers` and, on the `last` stage, the final norm (whose output lm_head reads); the
    whole model at pp 1. What a micro-batch holds once on a rank whatever its stages (the dense
    mask) is `mask_bytes`. `autocast` and `gathered` as `activation_bytes`, `etp` as
    `layer_saved_per_token` (selective checkpointing replays the routed experts)."""
    tokens = train.micro_batch * train.seq_len
    c, h = train.compute_bytes, model.hidden_size
    kinds = layer_kinds(model)
    if train.checkpointing == "full":
        # Only each layer's input is kept (Korthikanti et al. §4.1: 2sbh per layer in 16-bit;
        # the fp32 residual stream under autocast); the layer recomputed in backward is
        # `recompute_bytes`.
        per = {moe: (4 if autocast else c) * h / seq_shards(train, tp) for moe in (False, True)}
    elif train.checkpointing == "selective":
        per = {moe: selective_saved_per_token(model, train, tp, autocast, moe=moe) for moe in {kinds[i] for i in layers}}
    else:
        per = {moe: layer_saved_per_token(model, train, tp, autocast, moe=moe, etp=etp)
               for moe in {kinds[i] for i in layers}}
    body = sum(per[kinds[i]] for i in layers)
    if gathered:  # DTensor TP: the linears save their gathered input (full checkpointing: only at lm_head)
        per_layer_extra, head_extra = gathered_inputs(model, train, tp, autocast)
        if train.checkpointing == "none":
            body += len(layers) * per_layer_extra
        if last:
            body += head_extra
    if last:
        body += final_norm_saved(model, train, autocast, tp)  # its output feeds lm_head
    return tokens * body


def rank_saved(model: ModelSpec, train: TrainSpec, tp: int, rank: PipelineRank, pp: int = 1,
               schedule: str = "1f1b", virtual: int = 1, autocast: bool = False, gathered: bool = False,
               extra: Mapping[int, float] | None = None, etp: int | None = None) -> float:
    """Saved-for-backward bytes one pipeline rank holds at its peak: its stages' (`stage_saved`,
    plus `extra[stage]` where given) for every micro-batch in flight in the schedule's order
    (plan.pipeline: GPipe all grad_accum micro-batches, 1F1B min(m, pp − r) on rank r, interleaved
    1F1B its order's peak), and the dense mask once per micro-batch in flight. One micro-batch at
    pp 1 (its forward, then its backward)."""
    extra = extra or {}
    per_stage = {s: stage_saved(model, train, tp, layers, s == rank.last_stage, autocast, gathered, etp)
                 + extra.get(s, 0.0)
                 for s, layers in zip(rank.stages, rank.stage_layers, strict=True)}
    if pp == 1:
        return per_stage[0] + mask_bytes(train)
    actions = rank_actions(schedule, pp, virtual, train.grad_accum, rank.index)
    return in_flight_peak(actions, per_stage, mask_bytes(train))


def activation_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1, pp: int = 1,
                     autocast: bool = False, gathered: bool = False, schedule: str = "1f1b",
                     virtual: int = 1) -> float:
    """Saved-for-backward bytes per GPU at its peak (the end of forward at pp 1; in flight under
    pipeline parallelism, the fullest rank: `rank_saved`).
    `autocast`: an fp32 module under torch.autocast (DDP mixed precision) instead of a module
    in the compute dtype (DeepSpeed bf16/fp16, FSDP2 param_dtype). `gathered`: tensor parallelism
    through DTensor (FSDP2 and DDP engines: the trainer's, torchtitan's), whose linears save their
    all-gathered input (`gathered_inputs`); False: Megatron-LM's sequence parallelism.
    `schedule`, `virtual`: the pipeline's (strategy.pp_schedule, pp_virtual_stages)."""
    return max(rank_saved(model, train, tp, rank, pp, schedule, virtual, autocast, gathered)
               for rank in pipeline_ranks(model.num_layers, pp, virtual))


def recompute_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1, autocast: bool = False,
                    etp: int | None = None) -> float:
    """With checkpointing, backward recomputes one layer at a time (the largest): its saved set
    is live on top of what forward kept. Full: everything but the kept layer input. Selective:
    everything but the layer input and SDPA's output and logsumexp (cached, and what SDPA's
    backward reads); cached matmul outputs the replayed layer also saves (v, gate) are counted
    twice (an upper bound, not measured: the replay is not visible to saved-tensor hooks)."""
    tokens = train.micro_batch * train.seq_len
    if train.checkpointing == "none":
        return 0.0
    # The recomputed layer's input is the kept checkpoint (same storage), and by the time
    # backward reaches the last layer the final norm's saved tensors are already freed
    # (measured: benchmarks/results/measured_activations.json, peak_with_recompute).
    full = layer_saved_per_token(model, train, tp, autocast, etp=etp)
    kept = (4 if autocast else train.compute_bytes) * model.hidden_size / seq_shards(train, tp)
    if train.checkpointing == "selective" and attention_kind(model, train) != "eager":
        kept += (train.compute_bytes * model.o_dim + 4 * model.num_heads) / tp
    return tokens * max(0.0, full - kept - final_norm_saved(model, train, autocast, tp))


def offload_kept(model: ModelSpec, train: TrainSpec, tp: int = 1, autocast: bool = False,
                 etp: int | None = None) -> float:
    """Saved-for-backward bytes per GPU that stay on the device under activation offloading
    (`activation_offload`): one decoder layer's saved set and lm_head's input. torchtune's
    OffloadActivations (torchtune/training/_activation_offloading.py, with streams) keeps the last
    `max_fwd_stash_size` (5) offloaded tensors alive until their copies complete, which at the
    end of forward are the last layer's, brings back one autograd node's tensors at a time in
    backward, and leaves its output layer alone (NoOpManager: backward needs it first); the
    trainer's offloader keeps the same (shardwise.train.model.activation_offload, measured on 2
    gloo ranks: tests/train/test_activation_offload.py). With full checkpointing a layer's saved
    set is its kept input (the recomputed layer is `recompute_bytes`, on the device as before)."""
    tokens = train.micro_batch * train.seq_len
    head_input = train.compute_bytes * model.hidden_size / seq_shards(train, tp)
    if train.checkpointing == "full":
        layer = (4 if autocast else train.compute_bytes) * model.hidden_size / seq_shards(train, tp)
    elif train.checkpointing == "selective":
        layer = selective_saved_per_token(model, train, tp, autocast)
    else:
        layer = layer_saved_per_token(model, train, tp, autocast, etp=etp)
    return tokens * (layer + head_input)
