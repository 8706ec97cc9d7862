"""Reading and writing Hugging Face config.json for `ModelSpec` (its `from_hf_config`,
`from_hf_dict`, `to_hf_dict` call here): each family's fields, transformers' defaults for
omitted ones, the aliases GPT-style configs use, and the errors naming the file and field.
It returns the spec's fields; ModelSpec builds itself from them. Torch-free; other
architectures go to `shardwise.specs.hf_meta`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.config.file import parse_json, read_text
from shardwise.errors import ShardwiseError
from shardwise.specs.families import ANALYTIC_FAMILIES, GPT_ACTIVATIONS, GPT_FAMILIES
from shardwise.specs.hf_values import check_values

if TYPE_CHECKING:
    from shardwise.specs.model import ModelSpec

# transformers' config defaults that change parameter counts when a config.json omits them.
_HF_DEFAULTS: dict[str, dict] = {
    "mistral": {"num_key_value_heads": 8},
    "mixtral": {"num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
    "gemma": {"num_key_value_heads": 16, "head_dim": 256, "tie_word_embeddings": True},
    "gemma2": {"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True, "final_logit_softcapping": 30.0},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True},
    "qwen2_moe": {"num_key_value_heads": 16, "qkv_bias": True, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "deepseek_v3": {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                    "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8,
                    "topk_group": 4},
}
# Special-token ids transformers defaults to; emitted as None by to_hf_dict when outside the vocab
# (phi3's pad 32000 would make nn.Embedding refuse a small vocab).
_HF_TOKEN_IDS = {"phi3": {"bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000},
                 "olmo2": {"pad_token_id": 1, "eos_token_id": 50279},
                 "gemma": {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}}



def config_name(cfg: dict) -> str | None:
    """The model's name as its config.json records it: the last part of the hub id that
    transformers writes into `_name_or_path` (`meta-llama/Llama-2-7b-hf` -> `Llama-2-7b-hf`);
    None for a local path there (a directory's name says nothing about the model) or none."""
    value = cfg.get("_name_or_path")
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or value.startswith(("/", ".", "~")) or "\\" in value or ":" in value or value.count("/") > 1:
        return None
    return value.rsplit("/", 1)[-1] or None


def read_config_json(path: str | Path) -> tuple[dict, Path]:
    """A local Hugging Face `config.json` (a file or its directory) as a dict, and its path;
    a file past shardwise.config.file's bounds (size, nesting, integer digits), not UTF-8 JSON, or
    holding a value no model is built from (shardwise.specs.hf_values) is a ShardwiseError naming it."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ShardwiseError(f"{path}: file not found (expected a Hugging Face config.json)")
    cfg = parse_json(read_text(path), path, strict=False)  # bounded: size, nesting, integer digits
    if not isinstance(cfg, dict):
        raise ShardwiseError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    check_values(cfg, str(path))
    return cfg, path


def spec_fields(cfg: dict, name: str = "custom", source: str = "config") -> tuple[dict, str]:
    """The `ModelSpec` fields of a config.json dict, and the prefix its validation errors take:
    analytic for the families above (torch-free), else read on the meta device by
    `shardwise.specs.hf_meta` (needs torch + transformers)."""
    model_type = cfg.get("model_type", "llama")
    if not isinstance(model_type, str):
        raise ShardwiseError(f"{source}: field 'model_type' must be a string, got {model_type!r}")
    if model_type not in ANALYTIC_FAMILIES:
        from shardwise.specs.hf_meta import spec_fields_from_meta

        return spec_fields_from_meta(cfg, name=name, source=source), f"{source} ({model_type})"
    if model_type in GPT_FAMILIES:
        return _from_gpt_dict(cfg, model_type, name, source), source
    required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ShardwiseError(
            f"{source}: missing field(s) {', '.join(repr(k) for k in missing)} "
            f"(a {model_type} config.json needs {', '.join(required)})"
        )
    d = {**_HF_DEFAULTS.get(model_type, {}), **cfg}
    ints = [*required, "num_key_value_heads", "head_dim", "num_local_experts", "num_experts",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "n_shared_experts", "first_k_dense_replace", "decoder_sparse_step", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
            "max_position_embeddings"]
    for k in ints:
        if d.get(k) is not None and (not isinstance(d[k], int) or isinstance(d[k], bool)):
            raise ShardwiseError(f"{source}: field {k!r} must be an integer, got {d[k]!r}")
    heads = d["num_attention_heads"]
    kw: dict = dict(
        name=name,
        family=model_type,
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or 0,
        intermediate_size=d["intermediate_size"],
        vocab_size=d["vocab_size"],
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        max_position_embeddings=d.get("max_position_embeddings") or 4096,
    )

    def need(k: str) -> int:
        if d.get(k) is None:
            raise ShardwiseError(f"{source}: field {k!r} is null; a {model_type} config.json needs an integer")
        return d[k]

    if model_type == "llama":
        kw["mlp_bias"] = bool(d.get("mlp_bias", False))
    if model_type in ("gemma2", "gemma3_text"):
        cap = d.get("final_logit_softcapping")
        if cap is not None and (not isinstance(cap, int | float) or isinstance(cap, bool) or cap < 0):
            raise ShardwiseError(f"{source}: field 'final_logit_softcapping' must be a number >= 0 or null, "
                                 f"got {cap!r}")
        kw["final_logit_softcapping"] = float(cap or 0)
    if model_type == "mixtral":
        kw.update(num_experts=d.get("num_local_experts", 0) or 0, experts_per_token=d.get("num_experts_per_tok", 0) or 0)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ShardwiseError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
        kw.update(num_experts=d.get("num_experts", d.get("num_local_experts", 0)) or 0,
                  experts_per_token=d.get("num_experts_per_tok", 0) or 0,
                  moe_intermediate_size=need("moe_intermediate_size"),
                  decoder_sparse_step=d.get("decoder_sparse_step", 1), mlp_only_layers=tuple(only))
        if model_type == "qwen2_moe":
            kw.update(attention_bias=bool(d.get("qkv_bias")),
                      shared_expert_intermediate_size=need("shared_expert_intermediate_size"))
    elif model_type == "deepseek_v3":
        kw.update(num_kv_heads=heads, head_dim=0,
                  num_experts=need("n_routed_experts"), experts_per_token=need("num_experts_per_tok"),
                  moe_intermediate_size=need("moe_intermediate_size"),
                  shared_expert_intermediate_size=need("n_shared_experts") * need("moe_intermediate_size"),
                  first_k_dense=need("first_k_dense_replace"), n_group=need("n_group"), topk_group=need("topk_group"),
                  q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=need("kv_lora_rank"),
                  qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
                  v_head_dim=need("v_head_dim"))
    elif model_type == "phi3":
        kw["attention_bias"] = False
    return kw, source

def _from_gpt_dict(cfg: dict, model_type: str, name: str, source: str) -> dict:
    """A GPT-style config.json (mpt, gpt2). Widths under their own names or transformers'
    aliases (d_model/n_embd = hidden_size, n_heads/n_head = num_attention_heads,
    n_layers/n_layer = num_hidden_layers, max_seq_len/n_positions = max_position_embeddings).

    gpt2 (GPT2Config, gpt2/modeling_gpt2.py): Conv1D and LayerNorm biases everywhere, wpe of
    n_positions rows, MLP n_inner (default 4h), `activation_function` (default gelu_new),
    tied lm_head unless tie_word_embeddings is false. Dropout is not modelled (0 assumed).

    mpt: fields read as MptConfig documents them and llm-foundry (which wrote these configs)
    builds them: `no_bias` drops every linear and LayerNorm bias, `expansion_ratio`·d_model is
    the MLP width, and a learned position table of max_seq_len rows exists when
    `learned_pos_emb` and neither `attn_config.alibi` nor `attn_config.rope` (llm-foundry's
    MPTConfig turns learned_pos_emb off under ALiBi/RoPE). transformers' MptForCausalLM
    (mpt/modeling_mpt.py) ignores those three fields: it always builds ALiBi, no biases and a
    4h MLP, so with transformers' defaults (no_bias true, alibi true, expansion_ratio 4: the
    Hub checkpoints) both agree to the parameter; llm-foundry's own defaults (no_bias false,
    alibi false, learned_pos_emb true: its training yamls) describe a model transformers
    cannot build (its published NumParams are matched instead). Grouped/multi-query
    attention, qk_ln, RoPE with learned positions and non-`mptmlp` FFNs are refused."""
    names = {
        "mpt": {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                "max_position_embeddings": "max_seq_len"},
        "gpt2": {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                 "max_position_embeddings": "n_positions"},
    }[model_type]
    d = dict(cfg)
    for alias, own in names.items():
        if d.get(alias) is None:
            d.pop(alias, None)
            continue
        value = d.pop(alias)
        if d.get(own) is None:
            d[own] = value
        elif d[own] != value:
            raise ShardwiseError(f"{source}: field {own!r} ({d[own]!r}) and its alias {alias!r} ({value!r}) "
                                 "disagree; give one of them")
    required = [names["hidden_size"], names["num_attention_heads"], names["num_hidden_layers"], "vocab_size"]
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise ShardwiseError(f"{source}: missing field(s) {', '.join(repr(k) for k in missing)} "
                             f"(a {model_type} config.json needs {', '.join(required)})")
    pos = names["max_position_embeddings"]
    d.setdefault(pos, 2048 if model_type == "mpt" else 1024)
    ints = [*required, pos] + (["n_inner"] if model_type == "gpt2" else [])
    for k in ints:
        if d.get(k) is not None and (not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] <= 0):
            raise ShardwiseError(f"{source}: field {k!r} must be a positive integer, got {d[k]!r}")
    h = d[names["hidden_size"]]
    kw: dict = dict(name=name, family=model_type, hidden_size=h, num_layers=d[names["num_hidden_layers"]],
                    num_heads=d[names["num_attention_heads"]], num_kv_heads=d[names["num_attention_heads"]],
                    vocab_size=d["vocab_size"], max_position_embeddings=d[pos],
                    tie_embeddings=bool(d.get("tie_word_embeddings", True)))
    if model_type == "gpt2":
        if d.get("add_cross_attention"):
            raise ShardwiseError(f"{source}: field 'add_cross_attention' is true: cross-attention layers "
                                 "belong to an encoder-decoder, not a decoder-only model")
        act = d.get("activation_function", "gelu_new")
        if act not in GPT_ACTIVATIONS:
            raise ShardwiseError(f"{source}: field 'activation_function' is {act!r}, not one whose saved "
                                 f"tensors the planner derives ({', '.join(GPT_ACTIVATIONS)})")
        kw.update(intermediate_size=d.get("n_inner") or 4 * h, hidden_act=act, attention_bias=True,
                  mlp_bias=True, norm_bias=True, learned_pos_emb=True)
    else:
        attn = d.get("attn_config") or {}
        ffn = d.get("ffn_config") or {}
        if not isinstance(attn, dict) or not isinstance(ffn, dict):
            raise ShardwiseError(f"{source}: fields 'attn_config' and 'ffn_config' must be objects")
        if attn.get("attn_type", "multihead_attention") != "multihead_attention":
            raise ShardwiseError(f"{source}: field 'attn_config.attn_type' is {attn['attn_type']!r}: the mpt "
                                 "family is multi-head attention (transformers' MptAttention builds no other)")
        if attn.get("qk_ln") or attn.get("qk_gn"):
            raise ShardwiseError(f"{source}: field 'attn_config.qk_ln' is not modelled for mpt")
        if ffn.get("ffn_type", "mptmlp") != "mptmlp":
            raise ShardwiseError(f"{source}: field 'ffn_config.ffn_type' is {ffn['ffn_type']!r}: the mpt family "
                                 "is the non-gated GeLU MLP ('mptmlp')")
        ratio = d.get("expansion_ratio", 4)
        if not isinstance(ratio, int | float) or isinstance(ratio, bool) or ratio <= 0:
            raise ShardwiseError(f"{source}: field 'expansion_ratio' must be a positive number, got {ratio!r}")
        bias = not d.get("no_bias", True)
        learned = bool(d.get("learned_pos_emb", True)) and not attn.get("alibi", True) and not attn.get("rope")
        kw.update(intermediate_size=int(h * ratio), hidden_act="gelu", attention_bias=bias, mlp_bias=bias,
                  norm_bias=bias, learned_pos_emb=learned)
    return kw

def _to_gpt_dict(self: ModelSpec) -> dict:
    h, i = self.hidden_size, self.intermediate_size
    if self.family == "gpt2":
        d: dict[str, Any] = {
            "model_type": "gpt2", "n_embd": h, "n_layer": self.num_layers, "n_head": self.num_heads,
            "n_inner": i, "n_positions": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "activation_function": self.hidden_act, "tie_word_embeddings": self.tie_embeddings,
            # dropout is not modelled: the spec describes the model without it
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        }
        if 50256 >= self.vocab_size:  # GPT2Config's bos/eos default, outside a small vocab
            d.update(bos_token_id=None, eos_token_id=None)
        return d
    return {
        "model_type": "mpt", "d_model": h, "n_heads": self.num_heads, "n_layers": self.num_layers,
        "expansion_ratio": i // h if i % h == 0 else i / h, "max_seq_len": self.max_position_embeddings,
        "vocab_size": self.vocab_size, "no_bias": not self.attention_bias,
        "learned_pos_emb": self.learned_pos_emb, "attn_config": {"alibi": not self.learned_pos_emb},
        "tie_word_embeddings": self.tie_embeddings,
    }

def to_hf_dict(self: ModelSpec) -> dict:
    """The transformers config this spec describes (for meta-device checks and random init).
    An mpt spec with biases or learned positions (llm-foundry's) is written as such;
    transformers' MptForCausalLM builds it without them (see `_from_gpt_dict`)."""
    if self.inventory is not None:
        return json.loads(self.inventory.config_json)
    if self.is_gpt:
        return _to_gpt_dict(self)
    f = self.family
    d: dict[str, Any] = {
        "model_type": f,
        "hidden_size": self.hidden_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "intermediate_size": self.intermediate_size,
        "vocab_size": self.vocab_size,
        "tie_word_embeddings": self.tie_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
    }
    if f == "llama":
        d["attention_bias"] = self.attention_bias
        if self.mlp_bias:
            d["mlp_bias"] = True
    elif f in ("qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "olmo2"):
        d["attention_bias"] = self.attention_bias
    if f in ("gemma2", "gemma3_text"):
        d["final_logit_softcapping"] = self.final_logit_softcapping or None
    if f == "mixtral" and self.is_moe:
        d["num_local_experts"] = self.num_experts
        d["num_experts_per_tok"] = self.experts_per_token
    elif f in ("qwen2_moe", "qwen3_moe"):
        d.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token or 1,
                 moe_intermediate_size=self.expert_width, decoder_sparse_step=self.decoder_sparse_step,
                 mlp_only_layers=list(self.mlp_only_layers))
        if f == "qwen2_moe":
            d.update(qkv_bias=self.attention_bias,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size)
    elif f == "deepseek_v3":
        del d["head_dim"]  # DeepseekV3Config sets head_dim = qk_rope_head_dim itself
        d.update(n_routed_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                 moe_intermediate_size=self.expert_width,
                 n_shared_experts=self.shared_expert_intermediate_size // self.expert_width,
                 first_k_dense_replace=self.first_k_dense, n_group=self.n_group, topk_group=self.topk_group,
                 q_lora_rank=self.q_lora_rank or None, kv_lora_rank=self.kv_lora_rank,
                 qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                 v_head_dim=self.v_head_dim, attention_bias=self.attention_bias)
    for k, v in _HF_TOKEN_IDS.get(f if f not in ("gemma2", "gemma3_text") else "gemma", {}).items():
        if v >= self.vocab_size:
            d[k] = None
    return d

