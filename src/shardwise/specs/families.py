"""The analytic families: what each builds and which fields it takes.

For every family `shardwise.specs.ModelSpec` counts without torch, the modules of a decoder
layer and of the root group as `(module name, weight numel, bias numel)` in the order
`transformers` registers them (`transformers/models/<family>/modeling_<family>.py`), and the
checks that refuse fields a family does not have. ModelSpec derives every count from these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from shardwise.errors import ShardwiseError

if TYPE_CHECKING:
    from shardwise.specs.model import ModelSpec

Module = tuple[str, int, int]  # (name, weight numel, bias numel; fused experts: down in `bias`)

Family = Literal[
    "llama", "mistral", "mixtral", "qwen2",
    "qwen3", "qwen3_moe", "qwen2_moe", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "deepseek_v3",
    "mpt", "gpt2",
    "hf",  # any other transformers architecture, read on the meta device (ModelSpec.inventory)
]
ANALYTIC_FAMILIES: tuple[str, ...] = (
    "llama", "mistral", "mixtral", "qwen2",
    "qwen3", "qwen3_moe", "qwen2_moe", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "deepseek_v3",
    "mpt", "gpt2",
)
# GPT-style blocks: pre-LayerNorm, one fused QKV projection, multi-head attention, a non-gated
# fc1 (h -> I) / activation / fc2 (I -> h) MLP, optional biases and learned position embeddings.
GPT_FAMILIES = ("mpt", "gpt2")
# Module names per GPT-style family (transformers' names): layer (norm 1, fused qkv, attention
# output, norm 2, fc1, fc2) and root (token embedding, position embedding, final norm).
_GPT_NAMES = {
    "gpt2": (("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"), ("wte", "wpe", "ln_f")),
    "mpt": (("norm_1", "attn.Wqkv", "attn.out_proj", "norm_2", "ffn.up_proj", "ffn.down_proj"), ("wte", "wpe", "norm_f")),
}
# MLP activations a GPT-style block may use (transformers' ACT2FN names); what each saves for
# backward is `plan.activations.GPT_ACT_SAVED`. MPT's is fixed: nn.GELU(approximate="none").
GPT_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python", "gelu_accurate", "gelu_10",
                   "quick_gelu", "relu", "silu", "mish", "tanh", "sigmoid")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")
# q/k norms: "head" = RMSNorm over head_dim after the projection (qwen3, gemma3), "full" = over
# the whole q / kv projection width before the head split (olmo2).
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "full"}
# Decoder-layer norms in registration order: pre-norm (Llama), sandwich (gemma2/3: pre and post
# around attention and MLP), post-norm only (olmo2: after attention and after the MLP).
LAYER_NORMS = {
    "gemma2": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "gemma3_text": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
}
PRE_NORMS = ("input_layernorm", "post_attention_layernorm")


def check_fields(m: ModelSpec) -> int:
    """Refuse fields the family does not have or values it cannot build; the head_dim it
    implies (0 in the spec = hidden_size // num_heads; MLA: qk_nope + qk_rope)."""
    where = f"model {m.name!r}"
    check_gpt(m, where)
    if m.family == "deepseek_v3":
        if not (m.kv_lora_rank and m.qk_rope_head_dim and m.v_head_dim):
            raise ShardwiseError(f"{where}: deepseek_v3 needs kv_lora_rank, qk_rope_head_dim and v_head_dim > 0")
        hd = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.head_dim and m.head_dim != hd:
            raise ShardwiseError(f"{where}: deepseek_v3 head_dim is qk_nope_head_dim + qk_rope_head_dim = {hd}, "
                                 f"got {m.head_dim}")
        if m.num_kv_heads != m.num_heads:
            raise ShardwiseError(f"{where}: deepseek_v3 (MLA) expands k/v to every head: num_kv_heads must "
                                 f"equal num_heads {m.num_heads}, got {m.num_kv_heads}")
        if m.num_experts and m.num_experts % m.n_group:
            raise ShardwiseError(f"{where}: num_experts {m.num_experts} must be a multiple of "
                                 f"n_group {m.n_group}")
    elif m.kv_lora_rank or m.q_lora_rank:
        raise ShardwiseError(f"{where}: q_lora_rank/kv_lora_rank (MLA) belong to family deepseek_v3, "
                             f"not {m.family}")
    else:
        hd = m.head_dim or m.hidden_size // m.num_heads
        if not m.head_dim and m.hidden_size % m.num_heads:
            raise ShardwiseError(
                f"{where}: hidden_size {m.hidden_size} is not divisible by "
                f"num_heads {m.num_heads}; give head_dim explicitly"
            )
    if m.num_heads % m.num_kv_heads:
        raise ShardwiseError(
            f"{where}: num_heads {m.num_heads} must be a multiple of "
            f"num_kv_heads {m.num_kv_heads}"
        )
    if m.num_experts and not 0 < m.experts_per_token <= m.num_experts:
        raise ShardwiseError(
            f"{where}: experts_per_token must be in 1..{m.num_experts}, "
            f"got {m.experts_per_token}"
        )
    if m.num_experts and m.family not in (*MOE_FAMILIES, "hf"):
        raise ShardwiseError(f"{where}: family {m.family} has no experts (num_experts {m.num_experts}); "
                             f"MoE families: {', '.join(MOE_FAMILIES)}")
    if m.shared_expert_intermediate_size and m.family not in ("qwen2_moe", "deepseek_v3"):
        raise ShardwiseError(f"{where}: shared experts are a qwen2_moe / deepseek_v3 layout, not {m.family}")
    if m.family == "deepseek_v3" and m.shared_expert_intermediate_size % m.expert_width:
        raise ShardwiseError(f"{where}: deepseek shared_expert_intermediate_size must be a multiple "
                             f"(n_shared_experts) of moe_intermediate_size {m.expert_width}")
    bad = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
    if bad:
        raise ShardwiseError(f"{where}: mlp_only_layers {bad} outside 0..{m.num_layers - 1}")
    if (m.family == "hf") != (m.inventory is not None):
        raise ShardwiseError(f"{where}: family 'hf' and an inventory go together (read by "
                             "ModelSpec.from_hf_config on the meta device)")
    return hd


def check_gpt(m: ModelSpec, where: str) -> None:
    """GPT-style fields belong to the GPT-style families; those families' fixed parts."""
    f = m.family
    if f not in GPT_FAMILIES:
        bad = [k for k in ("norm_bias", "learned_pos_emb", "hidden_act") if getattr(m, k)]
        if bad:
            raise ShardwiseError(f"{where}: {', '.join(bad)} belong to the GPT-style families "
                                 f"({', '.join(GPT_FAMILIES)}), not {f}")
        return
    if m.num_kv_heads != m.num_heads:
        raise ShardwiseError(f"{where}: {f} is multi-head attention: num_kv_heads must equal num_heads "
                             f"{m.num_heads}, got {m.num_kv_heads}")
    if m.head_dim not in (0, m.hidden_size // m.num_heads) or m.hidden_size % m.num_heads:
        raise ShardwiseError(f"{where}: {f} head_dim is hidden_size / num_heads: hidden_size {m.hidden_size} "
                             f"must be a multiple of num_heads {m.num_heads} (head_dim {m.head_dim})")
    if m.hidden_act not in GPT_ACTIVATIONS:
        raise ShardwiseError(f"{where}: hidden_act {m.hidden_act!r} is not one the planner derives "
                             f"({', '.join(GPT_ACTIVATIONS)})")
    if f == "gpt2":
        fixed = {k: getattr(m, k) for k in ("attention_bias", "mlp_bias", "norm_bias", "learned_pos_emb")}
        if not all(fixed.values()):
            raise ShardwiseError(f"{where}: gpt2 always has linear and LayerNorm biases and learned position "
                                 f"embeddings (transformers' GPT2 Conv1D/LayerNorm/wpe); got {fixed}")
    else:
        if not m.attention_bias == m.mlp_bias == m.norm_bias:
            raise ShardwiseError(f"{where}: mpt biases are all or none (no_bias): attention_bias "
                                 f"{m.attention_bias}, mlp_bias {m.mlp_bias}, norm_bias {m.norm_bias}")
        if m.hidden_act != "gelu":
            raise ShardwiseError(f"{where}: mpt's MLP activation is exact GeLU (hidden_act 'gelu'), "
                                 f"got {m.hidden_act!r}")


def attention_modules(m: ModelSpec) -> list[Module]:
    """(module, weight, bias) of one layer's attention, in registration order."""
    h, q, kv, f = m.hidden_size, m.q_dim, m.kv_dim, m.family
    if f in GPT_FAMILIES:  # one fused qkv projection [q | k | v] and the output projection
        names = _GPT_NAMES[f][0]
        b = m.attention_bias
        return [(names[1], h * (q + 2 * kv), (q + 2 * kv) if b else 0), (names[2], q * h, h if b else 0)]
    if f == "deepseek_v3":  # deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention (MLA)
        b = m.attention_bias
        heads, ql, kvl, rope = m.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        if ql:
            out = [("q_a_proj", h * ql, ql if b else 0), ("q_a_layernorm", ql, 0), ("q_b_proj", ql * q, 0)]
        else:
            out = [("q_proj", h * q, 0)]
        return [
            *out,
            ("kv_a_proj_with_mqa", h * (kvl + rope), (kvl + rope) if b else 0),
            ("kv_a_layernorm", kvl, 0),
            ("kv_b_proj", kvl * heads * (m.qk_nope_head_dim + m.v_head_dim), 0),
            ("o_proj", m.o_dim * h, h if b else 0),
        ]
    if f == "phi3":  # phi3/modeling_phi3.py: o_proj is registered before the fused qkv_proj
        return [("o_proj", q * h, 0), ("qkv_proj", h * (q + 2 * kv), 0)]
    qkv_bias = f == "qwen2" or (m.attention_bias and f not in ("mistral", "mixtral"))
    o_bias = m.attention_bias and f not in ("mistral", "mixtral", "qwen2", "qwen2_moe")
    out = [
        ("q_proj", h * q, q if qkv_bias else 0),
        ("k_proj", h * kv, kv if qkv_bias else 0),
        ("v_proj", h * kv, kv if qkv_bias else 0),
        ("o_proj", q * h, h if o_bias else 0),
    ]
    norm = QK_NORM.get(f)
    if norm == "head":
        out += [("q_norm", m.head_dim, 0), ("k_norm", m.head_dim, 0)]
    elif norm == "full":
        out += [("q_norm", q, 0), ("k_norm", kv, 0)]
    return out


def dense_mlp_modules(m: ModelSpec) -> list[Module]:
    h, i = m.hidden_size, m.intermediate_size
    if m.family == "phi3":
        return [("gate_up_proj", h * 2 * i, 0), ("down_proj", i * h, 0)]
    if m.family in GPT_FAMILIES:  # fc1 (h -> I), activation, fc2 (I -> h)
        names, b = _GPT_NAMES[m.family][0], m.mlp_bias
        return [(names[4], h * i, i if b else 0), (names[5], i * h, h if b else 0)]
    b = m.mlp_bias
    return [("gate_proj", h * i, i if b else 0), ("up_proj", h * i, i if b else 0), ("down_proj", i * h, h if b else 0)]


def moe_mlp_modules(m: ModelSpec) -> list[Module]:
    """transformers 5.x fuses experts into 3-D tensors: gate_up [E, 2I, h], down [E, h, I]
    (one module; `bias` slot holds down_proj)."""
    h, e, i = m.hidden_size, m.num_experts, m.expert_width
    router, experts = ("router", e * h, 0), ("experts", e * 2 * i * h, e * i * h)
    s = m.shared_expert_intermediate_size
    if m.family == "qwen2_moe":  # gate, experts, shared_expert, shared_expert_gate
        out = [router, experts]
        if s:
            out += [("shared_expert.gate_proj", h * s, 0), ("shared_expert.up_proj", h * s, 0),
                    ("shared_expert.down_proj", s * h, 0), ("shared_expert_gate", h, 0)]
        return out
    if m.family == "qwen3_moe":
        return [experts, router]
    if m.family == "deepseek_v3":  # experts, gate, shared_experts
        return [experts, router, ("shared_experts.gate_proj", h * s, 0), ("shared_experts.up_proj", h * s, 0),
                ("shared_experts.down_proj", s * h, 0)]
    return [router, experts]  # mixtral


def layer_modules(m: ModelSpec, moe: bool) -> list[Module]:
    """One decoder layer's modules in `model.parameters()` order."""
    if m.family in GPT_FAMILIES:  # norm 1, attention, norm 2, MLP
        names, h = _GPT_NAMES[m.family][0], m.hidden_size
        nb = h if m.norm_bias else 0
        return [(names[0], h, nb), *attention_modules(m), (names[3], h, nb), *dense_mlp_modules(m)]
    norms = [(n, m.hidden_size, 0) for n in LAYER_NORMS.get(m.family, PRE_NORMS)]
    return attention_modules(m) + (moe_mlp_modules(m) if moe else dense_mlp_modules(m)) + norms


def root_modules(m: ModelSpec) -> list[Module]:
    """(module, weight, bias) outside the decoder layers, in `model.parameters()` order:
    token embedding, learned position embedding (GPT-style), final norm, untied lm_head."""
    h, v = m.hidden_size, m.vocab_size
    if m.family in GPT_FAMILIES:
        wte, wpe, norm = _GPT_NAMES[m.family][1]
        out = [(wte, v * h, 0)]
        if m.learned_pos_emb:
            out.append((wpe, m.position_embedding_params, 0))
        out.append((norm, h, h if m.norm_bias else 0))
    else:
        out = [("embed_tokens", v * h, 0), ("norm", h, 0)]
    if not m.tie_embeddings:
        out.append(("lm_head", v * h, 0))
    return out
