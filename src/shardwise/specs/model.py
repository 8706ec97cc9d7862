"""ModelSpec: the architecture numbers the planner needs, and the parameter count derived from them.

The count must equal what `transformers` builds for the same config, to the parameter
(tests/specs/test_model_spec.py and tests/specs/test_families.py build each on the meta device and check).

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
from typing import Any

from pydantic import Field, model_validator

from shardwise.config.base import Spec
from shardwise.errors import ShardwiseError
from shardwise.specs import hf_config
from shardwise.specs.families import (
    GPT_FAMILIES,
    Family,
    check_fields,
    layer_modules,
    root_modules,
)
from shardwise.specs.inventory import HFInventory, ParamTensor
from shardwise.specs.train import weight_decayed


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
        object.__setattr__(self, "head_dim", check_fields(self))  # specs/families.py
        return self

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
            for mod in layer_modules(self, moe) if kinds[moe] else ():
                if mod in seen:  # attention and norms: shared by both kinds of layer
                    t[seen[mod]] = t[seen[mod]].model_copy(update={"count": self.num_layers})
                    continue
                seen[mod] = len(t)
                t.append(ParamTensor(name=mod[0], weight=mod[1], bias=mod[2], count=kinds[moe]))
        t += [ParamTensor(name=n, weight=w, bias=b, layer=False) for n, w, b in root_modules(self)]
        return tuple(t)

    @cached_property
    def layer_sizes(self) -> tuple[int, ...]:
        """Parameters of each decoder layer, in order."""
        if self.inventory is not None:
            return self.inventory.layer_sizes
        size = {moe: sum(w + b for _, w, b in layer_modules(self, moe)) for moe in set(self.moe_layers)}
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

    @property
    def lm_head_params(self) -> int:
        """The output projection hidden → vocab (its weight; tied or not, it is one matmul)."""
        return self.vocab_size * self.hidden_size

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
        lm_head). DeepSpeed ZeRO-1/2 flattens each optimizer group in this order and splits
        its flat buffer into N partitions."""
        if self.inventory is not None:
            return self.inventory.hf_order
        return tuple(n for n, _ in self._hf_tensors)

    @cached_property
    def hf_decayed(self) -> tuple[bool, ...] | None:
        """Per `hf_order` tensor: whether the trainer's AdamW decays it (specs.train.weight_decayed:
        biases and norm weights are 1-D, embeddings go by name); None where an inventory read
        before this was recorded does not say."""
        if self.inventory is not None:
            return self.inventory.hf_decayed or None
        return tuple(d for _, d in self._hf_tensors)

    @cached_property
    def _hf_tensors(self) -> tuple[tuple[int, bool], ...]:
        """(size, decayed) of every parameter tensor in `model.parameters()` order."""
        def tensors(name: str, w: int, b: int) -> list[tuple[int, bool]]:
            if name == "experts":  # fused 3-D gate_up and down (families.moe_mlp_modules: the bias slot)
                return [(w, weight_decayed("experts.gate_up_proj", 3)), (b, weight_decayed("experts.down_proj", 3))]
            ndim = 1 if "norm" in name or name.startswith("ln_") else 2  # norms' weights are 1-D
            return [(w, weight_decayed(f"{name}.weight", ndim))] + ([(b, False)] if b else [])

        per_kind = {moe: [t for mod in layer_modules(self, moe) for t in tensors(*mod)] for moe in set(self.moe_layers)}
        root = [tensors(*mod) for mod in root_modules(self)]
        n_embed = 2 if self.is_gpt and self.learned_pos_emb else 1  # wte (and wpe) come before the layers
        out = [t for mod in root[:n_embed] for t in mod]
        for moe in self.moe_layers:
            out += per_kind[moe]
        out += [t for mod in root[n_embed:] for t in mod]
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
        """Read a local Hugging Face `config.json` (no code is loaded, no hub is asked). The model
        is named from the config, not from its directory: `name`, else the hub id transformers
        records in `_name_or_path` (its last part), else its model_type and size (`llama-1.1b`)."""
        cfg, path = hf_config.read_config_json(path)
        given = name or hf_config.config_name(cfg)
        spec = cls.from_hf_dict(cfg, name=given or "custom", source=str(path))
        if given:
            return spec
        return spec.model_copy(update={"name": f"{cfg.get('model_type', 'hf')}-{spec.params / 1e9:.3g}b"})

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "custom", source: str = "config") -> ModelSpec:
        """The spec of a config.json dict: analytic for the families above (torch-free), else
        read on the meta device by `shardwise.specs.hf_meta` (needs torch + transformers)."""
        fields, where = hf_config.spec_fields(cfg, name, source)
        try:
            return cls(**fields)
        except ShardwiseError as e:
            raise ShardwiseError(f"{where}: {e}") from None

    def to_hf_dict(self) -> dict:
        """The transformers config this spec describes (for meta-device checks and random init)."""
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
