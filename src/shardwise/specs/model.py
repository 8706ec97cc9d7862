"""ModelSpec: the architecture numbers the planner needs, and the parameter count derived from them.

The count must equal what `transformers` builds for the same config, to the parameter
(tests/test_model_spec.py and tests/test_families.py build each on the meta device and check).

Two paths (docs/planner.md "Architectures"):

* analytic families (no torch): llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, qwen2_moe,
  gemma, gemma2, gemma3_text, phi3, olmo2, deepseek_v3, and the GPT-style blocks mpt and gpt2
  (LayerNorm, fused QKV, a non-gated GeLU MLP, optional biases and learned position
  embeddings). Each module's parameters are derived from the config, mirroring
  `transformers/models/<family>/modeling_<family>.py` (MPT: llm-foundry's reading of the
  config fields transformers ignores, see `ModelSpec.from_hf_dict`);
* any other decoder-only `transformers` architecture: `shardwise.specs.hf_meta` builds the
  model on the meta device and the spec carries the inventory it read (`family="hf"`).
"""

from __future__ import annotations

from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from shardwise.errors import ShardwiseError
from shardwise.specs.base import Spec

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
class ParamTensor(Spec):
    """One module's direct parameters (weight, optional bias), `count` times (e.g. per layer).

    Kept per module because DeepSpeed's estimators size "the largest layer" by a module's
    direct parameters, and per tensor (`weight`, `bias`) because ZeRO-3 keeps tensors under
    `stage3_param_persistence_threshold` elements whole on every rank. A fused-experts module
    holds two 3-D tensors: gate_up in `weight`, down in `bias`; a module with more direct
    parameters lists the rest in `extra`.
    """

    name: str
    weight: int
    bias: int = 0
    count: int = 1
    layer: bool = True  # inside a decoder layer (an FSDP/ZeRO-3 unit) or in the root group
    extra: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.weight + self.bias + sum(self.extra)


class HFInventory(Spec):
    """What `shardwise.specs.hf_meta` read from a model built on the meta device: the exact
    per-module inventory, `model.parameters()` order and the numbers derived from them."""

    model_type: str
    layer_class: str  # the decoder layer's class name (the FSDP wrap unit)
    tensors: tuple[ParamTensor, ...]
    hf_order: tuple[int, ...]
    layer_sizes: tuple[int, ...]  # parameters of each decoder layer, in order
    largest_module: int
    active_params: int
    expert_params: int  # parameters under modules named "experts" (routed experts)
    embedding_params: int
    config_json: str  # the config.json it was built from (to_hf_dict)


class ModelSpec(Spec):
    """A decoder-only transformer: the Llama family and its relatives (q/k norms, sandwich and
    post norms, fused projections, GeGLU, MoE with shared experts and dense layers, MLA), or
    any transformers architecture read on the meta device (`family="hf"`, `inventory`)."""

    name: str = "custom"
    family: Family = "llama"
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(0, ge=0, description="0 = hidden_size // num_heads; MLA: qk_nope + qk_rope")
    intermediate_size: int = Field(gt=0, description="dense MLP width (dense layers of MoE models too)")
    vocab_size: int = Field(gt=0)
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v(/o) biases where the family has the switch (qwen2: always)
    mlp_bias: bool = False  # llama's mlp_bias
    norm_bias: bool = Field(False, description="LayerNorm bias (GPT-style families: gpt2 always, mpt unless no_bias)")
    learned_pos_emb: bool = Field(False, description="a learned absolute position table of max_position_embeddings "
                                  "rows (gpt2: n_positions; mpt: llm-foundry's learned_pos_emb without ALiBi, which "
                                  "transformers' MptForCausalLM never builds)")
    hidden_act: str = Field("", description="GPT-style MLP activation (transformers ACT2FN name; mpt: gelu); "
                            "'' for the other families, whose activation the family fixes")
    num_experts: int = Field(0, ge=0, description="0 = dense MLP")
    experts_per_token: int = Field(0, ge=0)
    max_position_embeddings: int = 4096
    # MoE layout (qwen2_moe, qwen3_moe, deepseek_v3)
    moe_intermediate_size: int = Field(0, ge=0, description="routed expert width; 0 = intermediate_size")
    shared_expert_intermediate_size: int = Field(0, ge=0, description="shared expert MLP width (qwen2_moe; "
                                                 "deepseek: n_shared_experts·moe_intermediate_size); 0 = none")
    first_k_dense: int = Field(0, ge=0, description="deepseek first_k_dense_replace: leading dense layers")
    decoder_sparse_step: int = Field(1, gt=0, description="qwen MoE: layer i is MoE when (i+1) % step == 0")
    mlp_only_layers: tuple[int, ...] = Field((), description="qwen MoE: layers with a dense MLP")
    n_group: int = Field(1, gt=0, description="deepseek router groups (forward only)")
    topk_group: int = Field(1, gt=0, description="deepseek router groups kept (forward only)")
    # Multi-head latent attention (deepseek_v3); kv_lora_rank 0 = not MLA
    q_lora_rank: int = Field(0, ge=0, description="0 = a full-rank q_proj")
    kv_lora_rank: int = Field(0, ge=0)
    qk_nope_head_dim: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)
    v_head_dim: int = Field(0, ge=0)
    final_logit_softcapping: float = Field(0.0, ge=0, description="gemma2/3: logits = cap·tanh(logits/cap) "
                                           "(one more c·V per token saved on the loss side); 0 = none")
    inventory: HFInventory | None = None  # family "hf" only

    @model_validator(mode="before")
    @classmethod
    def _gpt_defaults(cls, data: Any) -> Any:
        """GPT-style families' fixed parts, filled where a spec (catalog entry, constructor) omits
        them: gpt2 has every bias, learned positions, MHA and `gelu_new` (GPT2Config's default);
        mpt has MHA and exact GeLU."""
        if not isinstance(data, dict) or data.get("family") not in GPT_FAMILIES:
            return data
        d = dict(data)
        if d.get("num_heads") is not None:
            d.setdefault("num_kv_heads", d["num_heads"])
        if d.get("hidden_size") is not None:
            d.setdefault("intermediate_size", 4 * d["hidden_size"])
        if d["family"] == "gpt2":
            for k in ("attention_bias", "mlp_bias", "norm_bias", "learned_pos_emb"):
                d.setdefault(k, True)
            d.setdefault("hidden_act", "gelu_new")
        else:
            d.setdefault("hidden_act", "gelu")
        return d

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        where = f"model {self.name!r}"
        self._check_gpt(where)
        if self.family == "deepseek_v3":
            if not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
                raise ShardwiseError(f"{where}: deepseek_v3 needs kv_lora_rank, qk_rope_head_dim and v_head_dim > 0")
            hd = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim and self.head_dim != hd:
                raise ShardwiseError(f"{where}: deepseek_v3 head_dim is qk_nope_head_dim + qk_rope_head_dim = {hd}, "
                                     f"got {self.head_dim}")
            if self.num_kv_heads != self.num_heads:
                raise ShardwiseError(f"{where}: deepseek_v3 (MLA) expands k/v to every head: num_kv_heads must "
                                     f"equal num_heads {self.num_heads}, got {self.num_kv_heads}")
            if self.num_experts and self.num_experts % self.n_group:
                raise ShardwiseError(f"{where}: num_experts {self.num_experts} must be a multiple of "
                                     f"n_group {self.n_group}")
        elif self.kv_lora_rank or self.q_lora_rank:
            raise ShardwiseError(f"{where}: q_lora_rank/kv_lora_rank (MLA) belong to family deepseek_v3, "
                                 f"not {self.family}")
        else:
            hd = self.head_dim or self.hidden_size // self.num_heads
            if not self.head_dim and self.hidden_size % self.num_heads:
                raise ShardwiseError(
                    f"{where}: hidden_size {self.hidden_size} is not divisible by "
                    f"num_heads {self.num_heads}; give head_dim explicitly"
                )
        if self.num_heads % self.num_kv_heads:
            raise ShardwiseError(
                f"{where}: num_heads {self.num_heads} must be a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ShardwiseError(
                f"{where}: experts_per_token must be in 1..{self.num_experts}, "
                f"got {self.experts_per_token}"
            )
        if self.num_experts and self.family not in (*MOE_FAMILIES, "hf"):
            raise ShardwiseError(f"{where}: family {self.family} has no experts (num_experts {self.num_experts}); "
                                 f"MoE families: {', '.join(MOE_FAMILIES)}")
        if self.shared_expert_intermediate_size and self.family not in ("qwen2_moe", "deepseek_v3"):
            raise ShardwiseError(f"{where}: shared experts are a qwen2_moe / deepseek_v3 layout, not {self.family}")
        if self.family == "deepseek_v3" and self.shared_expert_intermediate_size % self.expert_width:
            raise ShardwiseError(f"{where}: deepseek shared_expert_intermediate_size must be a multiple "
                                 f"(n_shared_experts) of moe_intermediate_size {self.expert_width}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ShardwiseError(f"{where}: mlp_only_layers {bad} outside 0..{self.num_layers - 1}")
        if (self.family == "hf") != (self.inventory is not None):
            raise ShardwiseError(f"{where}: family 'hf' and an inventory go together (read by "
                                 "ModelSpec.from_hf_config on the meta device)")
        object.__setattr__(self, "head_dim", hd)
        return self

    def _check_gpt(self, where: str) -> None:
        """GPT-style fields belong to the GPT-style families; those families' fixed parts."""
        f = self.family
        if f not in GPT_FAMILIES:
            bad = [k for k in ("norm_bias", "learned_pos_emb", "hidden_act") if getattr(self, k)]
            if bad:
                raise ShardwiseError(f"{where}: {', '.join(bad)} belong to the GPT-style families "
                                     f"({', '.join(GPT_FAMILIES)}), not {f}")
            return
        if self.num_kv_heads != self.num_heads:
            raise ShardwiseError(f"{where}: {f} is multi-head attention: num_kv_heads must equal num_heads "
                                 f"{self.num_heads}, got {self.num_kv_heads}")
        if self.head_dim not in (0, self.hidden_size // self.num_heads) or self.hidden_size % self.num_heads:
            raise ShardwiseError(f"{where}: {f} head_dim is hidden_size / num_heads: hidden_size {self.hidden_size} "
                                 f"must be a multiple of num_heads {self.num_heads} (head_dim {self.head_dim})")
        if self.hidden_act not in GPT_ACTIVATIONS:
            raise ShardwiseError(f"{where}: hidden_act {self.hidden_act!r} is not one the planner derives "
                                 f"({', '.join(GPT_ACTIVATIONS)})")
        if f == "gpt2":
            fixed = {k: getattr(self, k) for k in ("attention_bias", "mlp_bias", "norm_bias", "learned_pos_emb")}
            if not all(fixed.values()):
                raise ShardwiseError(f"{where}: gpt2 always has linear and LayerNorm biases and learned position "
                                     f"embeddings (transformers' GPT2 Conv1D/LayerNorm/wpe); got {fixed}")
        else:
            if not self.attention_bias == self.mlp_bias == self.norm_bias:
                raise ShardwiseError(f"{where}: mpt biases are all or none (no_bias): attention_bias "
                                     f"{self.attention_bias}, mlp_bias {self.mlp_bias}, norm_bias {self.norm_bias}")
            if self.hidden_act != "gelu":
                raise ShardwiseError(f"{where}: mpt's MLP activation is exact GeLU (hidden_act 'gelu'), "
                                     f"got {self.hidden_act!r}")

    @property
    def is_gpt(self) -> bool:
        """A GPT-style block (mpt, gpt2): LayerNorm, fused QKV, non-gated MLP."""
        return self.family in GPT_FAMILIES

    @property
    def position_embedding_params(self) -> int:
        """The learned absolute position table (a lookup, not a matmul); 0 without one."""
        return self.max_position_embeddings * self.hidden_size if self.learned_pos_emb else 0

    # --- derived numbers -------------------------------------------------------------
    @cached_property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and (self.inventory is not None or any(self.moe_layers))

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_width(self) -> int:
        """Intermediate width of one routed expert."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def q_dim(self) -> int:
        """Query width: heads·head_dim (MLA: heads·(qk_nope + qk_rope), the q/k dot-product width)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Key width: kv_heads·head_dim (MLA: k is expanded per head to heads·(qk_nope + qk_rope))."""
        return self.num_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Value width: kv_dim (MLA: heads·v_head_dim)."""
        return self.num_heads * self.v_head_dim if self.is_mla else self.kv_dim

    @property
    def o_dim(self) -> int:
        """Attention output width, o_proj's input: q_dim (MLA: heads·v_head_dim)."""
        return self.num_heads * self.v_head_dim if self.is_mla else self.q_dim

    @cached_property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per decoder layer: routed experts (True) or a dense MLP, as the HF decoder layer decides
        (mixtral: all; qwen2_moe/qwen3_moe: mlp_only_layers, decoder_sparse_step; deepseek_v3:
        first_k_dense_replace)."""
        n, e = self.num_layers, self.num_experts
        if self.family == "mixtral":
            return (e > 0,) * n
        if self.family in ("qwen2_moe", "qwen3_moe"):
            only = set(self.mlp_only_layers)
            return tuple(i not in only and e > 0 and (i + 1) % self.decoder_sparse_step == 0 for i in range(n))
        if self.family == "deepseek_v3":
            return tuple(i >= self.first_k_dense for i in range(n))
        return (False,) * n

    def _attention(self) -> list[tuple[str, int, int]]:
        """(module, weight, bias) of one layer's attention, in registration order."""
        h, q, kv, f = self.hidden_size, self.q_dim, self.kv_dim, self.family
        if f in GPT_FAMILIES:  # one fused qkv projection [q | k | v] and the output projection
            names = _GPT_NAMES[f][0]
            b = self.attention_bias
            return [(names[1], h * (q + 2 * kv), (q + 2 * kv) if b else 0), (names[2], q * h, h if b else 0)]
        if f == "deepseek_v3":  # deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention (MLA)
            b = self.attention_bias
            heads, ql, kvl, rope = self.num_heads, self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
            if ql:
                out = [("q_a_proj", h * ql, ql if b else 0), ("q_a_layernorm", ql, 0), ("q_b_proj", ql * q, 0)]
            else:
                out = [("q_proj", h * q, 0)]
            return [
                *out,
                ("kv_a_proj_with_mqa", h * (kvl + rope), (kvl + rope) if b else 0),
                ("kv_a_layernorm", kvl, 0),
                ("kv_b_proj", kvl * heads * (self.qk_nope_head_dim + self.v_head_dim), 0),
                ("o_proj", self.o_dim * h, h if b else 0),
            ]
        if f == "phi3":  # phi3/modeling_phi3.py: o_proj is registered before the fused qkv_proj
            return [("o_proj", q * h, 0), ("qkv_proj", h * (q + 2 * kv), 0)]
        qkv_bias = f == "qwen2" or (self.attention_bias and f not in ("mistral", "mixtral"))
        o_bias = self.attention_bias and f not in ("mistral", "mixtral", "qwen2", "qwen2_moe")
        out = [
            ("q_proj", h * q, q if qkv_bias else 0),
            ("k_proj", h * kv, kv if qkv_bias else 0),
            ("v_proj", h * kv, kv if qkv_bias else 0),
            ("o_proj", q * h, h if o_bias else 0),
        ]
        norm = QK_NORM.get(f)
        if norm == "head":
            out += [("q_norm", self.head_dim, 0), ("k_norm", self.head_dim, 0)]
        elif norm == "full":
            out += [("q_norm", q, 0), ("k_norm", kv, 0)]
        return out

    def _dense_mlp(self) -> list[tuple[str, int, int]]:
        h, i = self.hidden_size, self.intermediate_size
        if self.family == "phi3":
            return [("gate_up_proj", h * 2 * i, 0), ("down_proj", i * h, 0)]
        if self.family in GPT_FAMILIES:  # fc1 (h -> I), activation, fc2 (I -> h)
            names, b = _GPT_NAMES[self.family][0], self.mlp_bias
            return [(names[4], h * i, i if b else 0), (names[5], i * h, h if b else 0)]
        b = self.mlp_bias
        return [("gate_proj", h * i, i if b else 0), ("up_proj", h * i, i if b else 0), ("down_proj", i * h, h if b else 0)]

    def _moe_mlp(self) -> list[tuple[str, int, int]]:
        """transformers 5.x fuses experts into 3-D tensors: gate_up [E, 2I, h], down [E, h, I]
        (one module; `bias` slot holds down_proj)."""
        h, e, i = self.hidden_size, self.num_experts, self.expert_width
        router, experts = ("router", e * h, 0), ("experts", e * 2 * i * h, e * i * h)
        s = self.shared_expert_intermediate_size
        if self.family == "qwen2_moe":  # gate, experts, shared_expert, shared_expert_gate
            out = [router, experts]
            if s:
                out += [("shared_expert.gate_proj", h * s, 0), ("shared_expert.up_proj", h * s, 0),
                        ("shared_expert.down_proj", s * h, 0), ("shared_expert_gate", h, 0)]
            return out
        if self.family == "qwen3_moe":
            return [experts, router]
        if self.family == "deepseek_v3":  # experts, gate, shared_experts
            return [experts, router, ("shared_experts.gate_proj", h * s, 0), ("shared_experts.up_proj", h * s, 0),
                    ("shared_experts.down_proj", s * h, 0)]
        return [router, experts]  # mixtral

    def _layer(self, moe: bool) -> list[tuple[str, int, int]]:
        """One decoder layer's modules in `model.parameters()` order."""
        if self.family in GPT_FAMILIES:  # norm 1, attention, norm 2, MLP
            names, h = _GPT_NAMES[self.family][0], self.hidden_size
            nb = h if self.norm_bias else 0
            return [(names[0], h, nb), *self._attention(), (names[3], h, nb), *self._dense_mlp()]
        norms = [(n, self.hidden_size, 0) for n in LAYER_NORMS.get(self.family, PRE_NORMS)]
        return self._attention() + (self._moe_mlp() if moe else self._dense_mlp()) + norms

    @cached_property
    def tensors(self) -> tuple[ParamTensor, ...]:
        """Every module's direct parameters: decoder-layer modules (count = layers that have
        them) and the root group (embeddings, final norm, untied lm_head), in HF order."""
        if self.inventory is not None:
            return self.inventory.tensors
        kinds = Counter(self.moe_layers)
        t: list[ParamTensor] = []
        seen: dict[tuple[str, int, int], int] = {}
        for moe in (False, True):
            for mod in self._layer(moe) if kinds[moe] else ():
                if mod in seen:  # attention and norms: shared by both kinds of layer
                    t[seen[mod]] = t[seen[mod]].model_copy(update={"count": self.num_layers})
                    continue
                seen[mod] = len(t)
                t.append(ParamTensor(name=mod[0], weight=mod[1], bias=mod[2], count=kinds[moe]))
        t += [ParamTensor(name=n, weight=w, bias=b, layer=False) for n, w, b in self._root()]
        return tuple(t)

    def _root(self) -> list[tuple[str, int, int]]:
        """(module, weight, bias) outside the decoder layers, in `model.parameters()` order:
        token embedding, learned position embedding (GPT-style), final norm, untied lm_head."""
        h, v = self.hidden_size, self.vocab_size
        if self.family in GPT_FAMILIES:
            wte, wpe, norm = _GPT_NAMES[self.family][1]
            out = [(wte, v * h, 0)]
            if self.learned_pos_emb:
                out.append((wpe, self.position_embedding_params, 0))
            out.append((norm, h, h if self.norm_bias else 0))
        else:
            out = [("embed_tokens", v * h, 0), ("norm", h, 0)]
        if not self.tie_embeddings:
            out.append(("lm_head", v * h, 0))
        return out

    @cached_property
    def layer_sizes(self) -> tuple[int, ...]:
        """Parameters of each decoder layer, in order."""
        if self.inventory is not None:
            return self.inventory.layer_sizes
        size = {moe: sum(w + b for _, w, b in self._layer(moe)) for moe in set(self.moe_layers)}
        return tuple(size[moe] for moe in self.moe_layers)

    @cached_property
    def params_per_layer(self) -> int:
        """Parameters of the largest decoder layer. A decoder layer is one FSDP / ZeRO-3 unit
        (gathered whole), so the largest one sizes the unsharded buffers; where layers differ
        (dense layers among MoE layers) the total is `layer_params`, not L·params_per_layer."""
        return max(self.layer_sizes)

    @cached_property
    def layer_params(self) -> int:
        """Parameters of all decoder layers together (exact where layers differ)."""
        return sum(self.layer_sizes)

    @cached_property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, final norm, lm_head (and, on the
        meta path, anything else the model holds outside its layer list)."""
        return self.params - self.layer_params

    @cached_property
    def params(self) -> int:
        """Total stored parameters Ψ (tied embeddings counted once; all experts)."""
        return sum(t.numel * t.count for t in self.tensors)

    @cached_property
    def active_params(self) -> int:
        """Parameters touched per token (MoE: top-k routed experts; router and shared experts
        always) — what FLOPs scale with."""
        if self.inventory is not None:
            return self.inventory.active_params
        if not self.is_moe:
            return self.params
        per_expert = 3 * self.expert_width * self.hidden_size
        idle = (self.num_experts - self.experts_per_token) * per_expert * sum(self.moe_layers)
        return self.params - idle

    @cached_property
    def expert_params(self) -> int:
        """Routed experts' parameters over all layers (the fused 3-D gate_up and down tensors;
        torch.autocast does not cast them, unlike nn.Linear weights)."""
        if self.inventory is not None:
            return self.inventory.expert_params
        return 3 * self.num_experts * self.expert_width * self.hidden_size * sum(self.moe_layers)

    @cached_property
    def embedding_params(self) -> int:
        """Token embedding, untied lm_head and a learned position table (lookups and the output
        projection: the parameters outside the decoder layers' matmuls)."""
        if self.inventory is not None:
            return self.inventory.embedding_params
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2) + self.position_embedding_params

    @cached_property
    def largest_module(self) -> int:
        """Largest module's direct parameters (DeepSpeed's `largest_layer_params`)."""
        if self.inventory is not None:
            return self.inventory.largest_module
        return max(t.numel for t in self.tensors)

    @cached_property
    def hf_order(self) -> tuple[int, ...]:
        """Every parameter tensor's size in `model.parameters()` order of the HF model (embed,
        each decoder layer's modules in registration order [weight then bias], final norm,
        lm_head). DeepSpeed ZeRO-1/2 flattens in this order and splits the flat buffer into N
        partitions."""
        if self.inventory is not None:
            return self.inventory.hf_order
        per_kind = {}
        for moe in set(self.moe_layers):
            sizes: list[int] = []
            for _, w, b in self._layer(moe):
                sizes += [w] + ([b] if b else [])
            per_kind[moe] = sizes
        root = [[w] + ([b] if b else []) for _, w, b in self._root()]
        n_embed = 2 if self.is_gpt and self.learned_pos_emb else 1  # wte (and wpe) come before the layers
        out = [n for sizes in root[:n_embed] for n in sizes]
        for moe in self.moe_layers:
            out += per_kind[moe]
        out += [n for sizes in root[n_embed:] for n in sizes]
        return tuple(out)

    @cached_property
    def _tensor_sizes(self) -> tuple[tuple[int, int], ...]:
        out = []
        for t in self.tensors:
            out += [(n, t.count) for n in (t.weight, t.bias, *t.extra) if n]
        return tuple(out)

    def tensor_sizes(self) -> list[tuple[int, int]]:
        """(numel, how many) for every individual parameter tensor."""
        return list(self._tensor_sizes)

    # --- constructors (config.json reading/writing: shardwise.specs.hf_config) ------------
    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Read a local Hugging Face `config.json` (no code is loaded, no hub is asked)."""
        from shardwise.specs import hf_config

        return hf_config.from_hf_config(cls, path, name)

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "custom", source: str = "config") -> ModelSpec:
        """The spec of a config.json dict: analytic for the families above (torch-free), else
        read on the meta device by `shardwise.specs.hf_meta` (needs torch + transformers)."""
        from shardwise.specs import hf_config

        return hf_config.from_hf_dict(cls, cfg, name, source)

    def to_hf_dict(self) -> dict:
        """The transformers config this spec describes (for meta-device checks and random init)."""
        from shardwise.specs import hf_config

        return hf_config.to_hf_dict(self)

    @classmethod
    def from_params(cls, params: float) -> ModelSpec:
        """A Llama-shaped model of about `params` parameters (documented default shape).

        Shape rule (docs/planner.md): hidden h a multiple of 128, head_dim 128 (MHA),
        L = h/128 layers (Llama-2-7B's depth/width: 32 layers at 4096), intermediate
        8/3·h rounded up to 256, vocab 32000, untied; the h whose total is closest to
        `params` wins. `--params 7e9` gives exactly Llama-2-7B's shape.
        """
        if not params or params <= 0:
            raise ShardwiseError(f"--params must be a positive number, got {params!r}")
        best = None
        for h in range(128, 65536 + 1, 128):
            spec = _default_shape(h)
            err = abs(spec.params - params)
            if best is None or err < best[0]:
                best = (err, spec)
            if spec.params > params:
                break
        assert best is not None
        return best[1].model_copy(update={"name": f"llama-like-{params / 1e9:.3g}b"})


def _default_shape(h: int) -> ModelSpec:
    inter = -(-int(h * 8 / 3) // 256) * 256
    return ModelSpec(
        name="llama-like",
        hidden_size=h,
        num_layers=h // 128,
        num_heads=h // 128,
        num_kv_heads=h // 128,
        intermediate_size=inter,
        vocab_size=32000,
    )
