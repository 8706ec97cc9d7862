"""The values of a Hugging Face `config.json` checked before anything is planned or built from
it (`check_values`), each refusal a ShardwiseError naming the file, the dotted field, the value
and what is accepted. transformers checks few of them: a NaN `rms_norm_eps` trains into NaN
losses, a negative RoPE factor trains, a size of `true` builds a one-wide model.

- every number finite, at any depth (Python's `json` reads `NaN` and `Infinity`);
- sizes (widths, layers, heads, vocabulary, positions) integers from 1 to MAX_SIZE, where given;
- epsilons (`*_eps`, `*_epsilon`) finite and above 0;
- `rope_theta` above 0; inside `rope_scaling` / `rope_parameters`: factors above 0, lists of
  factors above 0, `original_max_position_embeddings` a size, `partial_rotary_factor` in (0, 1];
- dropout probabilities in [0, 1];
- the heads: `num_key_value_heads` divides `num_attention_heads`, which divides `hidden_size`
  where no `head_dim` is given (the same in a nested `text_config`).
Torch-free.
"""

from __future__ import annotations

import math
from typing import Any

from shardwise.errors import ShardwiseError

# Far above any published model's sizes (context windows of ~10M positions, vocabularies of
# ~256k, widths of ~20k); kernels index many of these dimensions with int32.
MAX_SIZE = 2**31 - 1
SIZES = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "head_dim", "max_position_embeddings", "original_max_position_embeddings", "moe_intermediate_size",
    "num_experts_per_tok",
    "shared_expert_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    # GPT-style aliases (shardwise.specs.hf_config._from_gpt_dict)
    "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "d_model", "n_heads", "n_layers", "max_seq_len",
})  # fmt: skip
ROPE_SECTIONS = ("rope_scaling", "rope_parameters")
ROPE_FACTORS = frozenset({"factor", "low_freq_factor", "high_freq_factor", "attention_factor", "rope_theta"})
ROPE_LISTS = frozenset({"short_factor", "long_factor"})


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_values(cfg: dict, source: str) -> None:
    """Refuse `cfg` (a parsed config.json) where a value is outside what a model can be built
    from (module docstring); `source` names the file in the message."""
    stack: list[tuple[tuple[str, ...], Any, bool]] = [((), cfg, False)]
    while stack:
        path, value, in_rope = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append(((*path, str(k)), v, in_rope or str(k) in ROPE_SECTIONS))
            if isinstance(value, dict) and not in_rope:
                _check_heads(value, path, source)
        elif isinstance(value, list):
            stack.extend(((*path, str(i)), v, in_rope) for i, v in enumerate(value))
        if not path:
            continue
        key = path[-1]
        if isinstance(value, float) and not math.isfinite(value):
            _refuse(source, path, value, "a finite number (NaN and Infinity are not numbers a model can use)")
        if value is None:
            continue
        if in_rope:
            _check_rope(key, path, value, source)
        elif key in SIZES and not (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE):
            if not (isinstance(value, list) and key == "intermediate_size"):  # a width per layer: each checked below
                _refuse(source, path, value, f"an integer from 1 to {MAX_SIZE}")
        elif key.endswith(("_eps", "_epsilon")) or key in ("eps", "epsilon"):
            if not (_number(value) and value > 0):
                _refuse(source, path, value, "a number above 0 (a normalisation's epsilon)")
        elif key == "rope_theta" and not (_number(value) and value > 0):
            _refuse(source, path, value, "a number above 0 (RoPE's base wavelength)")
        elif key == "partial_rotary_factor" and not (_number(value) and 0 < value <= 1):
            _refuse(source, path, value, "a number in (0, 1] (the fraction of each head RoPE rotates)")
        elif (key.endswith(("dropout", "_pdrop")) or key == "dropout_rate") and not isinstance(value, bool) and not (
                _number(value) and 0 <= value <= 1):  # a boolean is a switch (`use_dropout`), not a probability
            _refuse(source, path, value, "a probability from 0 to 1")
        elif len(path) >= 2 and path[-2] == "intermediate_size" and not (
                isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE):
            _refuse(source, path, value, f"an integer from 1 to {MAX_SIZE}")


def _check_rope(key: str, path: tuple[str, ...], value: Any, source: str) -> None:
    if key in ROPE_FACTORS and not (_number(value) and value > 0):
        _refuse(source, path, value, "a number above 0 (a RoPE scaling factor)")
    elif key in ROPE_LISTS and not (isinstance(value, list) and all(_number(x) and x > 0 for x in value)):
        _refuse(source, path, value, "a list of numbers above 0 (RoPE's per-frequency factors)")
    elif key == "original_max_position_embeddings" and not (
            isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE):
        _refuse(source, path, value, f"an integer from 1 to {MAX_SIZE}")
    elif key == "partial_rotary_factor" and not (_number(value) and 0 < value <= 1):
        _refuse(source, path, value, "a number in (0, 1] (the fraction of each head RoPE rotates)")


def _check_heads(d: dict, path: tuple[str, ...], source: str) -> None:
    """Attention heads against the width, in one (sub-)config, where all are valid sizes."""
    def size(k: str) -> int | None:
        v = d.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_SIZE else None

    heads, kv, hidden = size("num_attention_heads"), size("num_key_value_heads"), size("hidden_size")
    if heads and kv and heads % kv:
        _refuse(source, (*path, "num_key_value_heads"), kv, f"a divisor of num_attention_heads ({heads}): "
                "each key/value head serves a whole group of query heads")
    if heads and hidden and d.get("head_dim") is None and hidden % heads:
        _refuse(source, (*path, "num_attention_heads"), heads, f"a divisor of hidden_size ({hidden}) when no "
                "head_dim is given: each head is hidden_size / num_attention_heads wide")


def _refuse(source: str, path: tuple[str, ...], value: Any, expected: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:80] + "..."
    raise ShardwiseError(f"{source}: field {'.'.join(path)!r} = {shown}: expected {expected}")
