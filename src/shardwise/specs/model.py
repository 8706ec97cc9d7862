"""ModelSpec: the architecture numbers the planner needs, and the parameter count derived from them.

The count must equal what `transformers` builds for the same config, to the parameter
(tests/test_model_spec.py builds every catalog entry on the meta device and checks).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from shardwise.errors import ShardwiseError
from shardwise.specs.base import Spec

Family = Literal["llama", "mistral", "mixtral", "qwen2"]


class ParamTensor(Spec):
    """One module's direct parameters (weight, optional bias), `count` times (e.g. per layer).

    Kept per module because DeepSpeed's estimators size "the largest layer" by a module's
    direct parameters, and per tensor (`weight`, `bias`) because ZeRO-3 keeps tensors under
    `stage3_param_persistence_threshold` elements whole on every rank.
    """

    name: str
    weight: int
    bias: int = 0
    count: int = 1
    layer: bool = True  # inside a decoder layer (an FSDP/ZeRO-3 unit) or in the root group

    @property
    def numel(self) -> int:
        return self.weight + self.bias


class ModelSpec(Spec):
    """A decoder-only transformer (Llama family: RMSNorm, RoPE, SwiGLU, optional GQA/MoE)."""


    name: str = "custom"
    family: Family = "llama"
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(0, ge=0, description="0 = hidden_size // num_heads")
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases; handled via family
    num_experts: int = Field(0, ge=0, description="0 = dense MLP")
    experts_per_token: int = Field(0, ge=0)
    max_position_embeddings: int = 4096

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        hd = self.head_dim or self.hidden_size // self.num_heads
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise ShardwiseError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}; give head_dim explicitly"
            )
        if self.num_heads % self.num_kv_heads:
            raise ShardwiseError(
                f"model {self.name!r}: num_heads {self.num_heads} must be a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ShardwiseError(
                f"model {self.name!r}: experts_per_token must be in 1..{self.num_experts}, "
                f"got {self.experts_per_token}"
            )
        object.__setattr__(self, "head_dim", hd)
        return self

    # --- derived numbers -------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def tensors(self) -> tuple[ParamTensor, ...]:
        """Every parameter tensor, per decoder layer (count = L) and in the root group."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        bias = self.family == "qwen2" or self.attention_bias
        t = [
            ParamTensor(name="q_proj", weight=h * self.q_dim, bias=self.q_dim if bias else 0, count=L),
            ParamTensor(name="k_proj", weight=h * self.kv_dim, bias=self.kv_dim if bias else 0, count=L),
            ParamTensor(name="v_proj", weight=h * self.kv_dim, bias=self.kv_dim if bias else 0, count=L),
            ParamTensor(name="o_proj", weight=self.q_dim * h, count=L),
            ParamTensor(name="input_layernorm", weight=h, count=L),
            ParamTensor(name="post_attention_layernorm", weight=h, count=L),
        ]
        if self.is_moe:
            # transformers 5.x fuses experts into 3-D tensors: gate_up [E, 2I, h], down [E, h, I]
            e = self.num_experts
            # (one module holding both 3-D tensors; `bias` slot reused for down_proj)
            t += [
                ParamTensor(name="router", weight=e * h, count=L),
                ParamTensor(name="experts", weight=e * 2 * i * h, bias=e * i * h, count=L),
            ]
        else:
            t += [
                ParamTensor(name="gate_proj", weight=h * i, count=L),
                ParamTensor(name="up_proj", weight=h * i, count=L),
                ParamTensor(name="down_proj", weight=i * h, count=L),
            ]
        t += [
            ParamTensor(name="embed_tokens", weight=self.vocab_size * h, layer=False),
            ParamTensor(name="norm", weight=h, layer=False),
        ]
        if not self.tie_embeddings:
            t.append(ParamTensor(name="lm_head", weight=self.vocab_size * h, layer=False))
        return tuple(t)

    @cached_property
    def params_per_layer(self) -> int:
        return sum(t.numel for t in self.tensors if t.layer)

    @cached_property
    def params(self) -> int:
        """Total stored parameters Ψ (tied embeddings counted once; all experts)."""
        return sum(t.numel * t.count for t in self.tensors)

    @cached_property
    def active_params(self) -> int:
        """Parameters touched per token (MoE: top-k experts) — what FLOPs scale with."""
        if not self.is_moe:
            return self.params
        per_expert = 3 * self.intermediate_size * self.hidden_size
        idle = (self.num_experts - self.experts_per_token) * per_expert * self.num_layers
        return self.params - idle

    @cached_property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @cached_property
    def largest_module(self) -> int:
        """Largest module's direct parameters (DeepSpeed's `largest_layer_params`)."""
        return max(t.numel for t in self.tensors)

    @cached_property
    def hf_order(self) -> tuple[int, ...]:
        """Every parameter tensor's size in `model.parameters()` order of the HF model (embed,
        per layer: q, k, v, o [weight then bias], mlp, 2 norms; final norm; lm_head). DeepSpeed
        ZeRO-1/2 flattens in this order and splits the flat buffer into N partitions."""
        by = {t.name: t for t in self.tensors}
        per_layer: list[int] = []
        mlp = ("router", "experts") if self.is_moe else ("gate_proj", "up_proj", "down_proj")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", *mlp, "input_layernorm", "post_attention_layernorm"):
            t = by[name]
            per_layer += [t.weight] + ([t.bias] if t.bias else [])
        out = [by["embed_tokens"].weight] + per_layer * self.num_layers + [by["norm"].weight]
        if "lm_head" in by:
            out.append(by["lm_head"].weight)
        return tuple(out)

    def tensor_sizes(self) -> list[tuple[int, int]]:
        """(numel, how many) for every individual parameter tensor."""
        out = []
        for t in self.tensors:
            out.append((t.weight, t.count))
            if t.bias:
                out.append((t.bias, t.count))
        return out

    # --- constructors ----------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Read a local Hugging Face `config.json` (no code is loaded, no hub is asked)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ShardwiseError(f"{path}: file not found (expected a Hugging Face config.json)") from None
        except json.JSONDecodeError as e:
            raise ShardwiseError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(cfg, dict):
            raise ShardwiseError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
        return cls.from_hf_dict(cfg, name=name or path.parent.name, source=str(path))

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "custom", source: str = "config") -> ModelSpec:
        model_type = cfg.get("model_type", "llama")
        families = {"llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "qwen2": "qwen2"}
        if model_type not in families:
            raise ShardwiseError(
                f"{source}: field 'model_type' is {model_type!r}; supported: {', '.join(families)}"
            )
        required = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ShardwiseError(
                f"{source}: missing field(s) {', '.join(repr(k) for k in missing)} "
                f"(a {model_type} config.json needs {', '.join(required)})"
            )
        for k in required:
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool):
                raise ShardwiseError(f"{source}: field {k!r} must be an integer, got {cfg[k]!r}")
        return cls(
            name=name,
            family=families[model_type],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_experts=cfg.get("num_local_experts", 0) or 0,
            experts_per_token=cfg.get("num_experts_per_tok", 0) or 0,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        )

    def to_hf_dict(self) -> dict:
        """The transformers config this spec describes (for meta-device checks and random init)."""
        d = {
            "model_type": self.family,
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
        if self.family == "llama":
            d["attention_bias"] = self.attention_bias
        if self.is_moe:
            d["num_local_experts"] = self.num_experts
            d["num_experts_per_tok"] = self.experts_per_token
        return d

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
