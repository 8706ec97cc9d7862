"""What transformers builds, as the trainer reads it: the causal-LM class of a model type (or,
without importing transformers, its name and its `forward`'s source from transformers' files),
and the decoder layers of a built model (FSDP2's units, the compiled regions, the bench's
probes). transformers is imported inside the functions only."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError


def run_model_type(run: Any) -> str:
    """The transformers model_type a run builds: its checkpoint's config.json's, else the catalog
    family's."""
    inventory = run.model.inventory
    return inventory.model_type if inventory is not None else run.model.family


def causal_lm_class(model_type: str):
    """transformers' AutoModelForCausalLM class for `model_type` (None where it has none: a
    checkpoint's own code decides)."""
    import transformers

    name = causal_lm_name(model_type)
    return getattr(transformers, name, None) if name is not None else None


def _transformers_file(*parts: str) -> Path | None:
    """A file of the installed transformers package, found without importing it."""
    spec = importlib.util.find_spec("transformers")
    roots = spec.submodule_search_locations if spec is not None else None
    path = Path(next(iter(roots)), *parts) if roots else None
    return path if path is not None and path.is_file() else None


@functools.cache
def _parsed(path: Path) -> tuple[str, ast.Module] | None:
    try:
        text = path.read_text(encoding="utf-8")
        return text, ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None


@functools.cache
def _causal_lm_names() -> dict[str, str]:
    """transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, read from its source (an OrderedDict of
    literal pairs); imported where the file no longer holds it so."""
    path = _transformers_file("models", "auto", "modeling_auto.py")
    read = _parsed(path) if path is not None else None
    for node in read[1].body if read is not None else ():
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"]
            and isinstance(node.value, ast.Call)
            and len(node.value.args) == 1
        ):
            try:
                return dict(ast.literal_eval(node.value.args[0]))
            except (ValueError, TypeError):
                break
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_name(model_type: str) -> str | None:
    """The name of transformers' AutoModelForCausalLM class for `model_type` (None where it has
    none), without importing transformers."""
    name = _causal_lm_names().get(model_type)
    return name if isinstance(name, str) else None


def forward_source(model_type: str, name: str) -> str | None:
    """The source of `name.forward` where transformers defines it in the model type's own
    modeling file (`models/<type>/modeling_<type>.py`, or the family's: `gemma3_text` is in
    `gemma3`), read without importing it; None where it is elsewhere (an alias of another
    family's class, an inherited forward): import the class."""
    parts = model_type.replace("-", "_").split("_")
    for module in ("_".join(parts[:n]) for n in range(len(parts), 0, -1)):
        path = _transformers_file("models", module, f"modeling_{module}.py")
        read = _parsed(path) if path is not None else None
        for node in read[1].body if read is not None else ():
            if isinstance(node, ast.ClassDef) and node.name == name:
                fn = next(
                    (f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None
                )
                return ast.get_source_segment(read[0], fn) if fn is not None else None
    return None


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of an HF causal LM (`model.model.layers` for Llama/Qwen/Mistral)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ShardwiseError(f"{type(model).__name__}: no `model.layers` to wrap per decoder layer")
    return list(layers)


def final_norm(model: Any) -> Any:
    """The norm after the decoder layers (`model.model.norm` for Llama/Qwen/Mistral)."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is None:
        raise ShardwiseError(f"{type(model).__name__}: no `model.norm` to shard with lm_head")
    return norm


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
