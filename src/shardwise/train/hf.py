"""What transformers builds, as the trainer reads it: the causal-LM class of a model type, and
the decoder layers of a built model (FSDP2's units, the compiled regions, the bench's probes).
transformers is imported inside the functions only."""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError


def causal_lm_class(model_type: str):
    """transformers' AutoModelForCausalLM class for `model_type` (None where it has none: a
    checkpoint's own code decides)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of an HF causal LM (`model.model.layers` for Llama/Qwen/Mistral)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ShardwiseError(f"{type(model).__name__}: no `model.layers` to wrap per decoder layer")
    return list(layers)


def enable_checkpointing(model: Any, use_reentrant: bool = False) -> None:
    """Activation checkpointing of every decoder layer, through transformers' current name
    (`activation_checkpointing_enable`; `gradient_checkpointing_enable` before transformers 5.2x,
    a deprecated alias since, warning on every call)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def checkpointing_enabled(model: Any) -> bool:
    """Whether activation checkpointing is on (`is_activation_checkpointing`, or its deprecated
    alias `is_gradient_checkpointing` on older transformers)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
