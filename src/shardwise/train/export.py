"""Export consolidated weights as a Hugging Face model directory: `model.safetensors`,
`config.json` and the tokenizer, loadable by `AutoModelForCausalLM.from_pretrained` (no code,
no pickles: safetensors only)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shardwise.train.config import TrainConfig


def export_dir(cfg: TrainConfig) -> Path:
    """Where `save_final` puts the Hugging Face directory: `<output_dir>/model`."""
    return Path(cfg.checkpointing.output_dir) / "model"


def export_hf(cfg: TrainConfig, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """Write the directory under a temp name and rename it when complete: a killed export
    never leaves a directory that looks finished (shardwise.train.outputs.atomic_dir)."""
    from safetensors.torch import save_file

    from shardwise.train.outputs import atomic_dir

    hf_config = _hf_config(cfg)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    # Tied weights appear under two names and safetensors refuses shared storage: keep one
    # name, as transformers' own save_pretrained does (the tie is restored on load).
    tensors = {k: v.contiguous().clone() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"refusing to export non-finite weights ({len(bad)} tensors, e.g. {bad[0]})")
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _copy_tokenizer(cfg, tmp)
    return out


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A Hugging Face directory from any shardwise checkpoint, on one process and without the
    world size or engine that wrote it: the fp32 master weights (`model.*`), the config the
    run was trained with, and its tokenizer."""
    from shardwise.train.checkpoint import read_manifest, read_tensors, tensor_shapes
    from shardwise.train.config import TrainConfig

    manifest = read_manifest(checkpoint)
    cfg = TrainConfig.model_validate({**manifest["config"], "source": str(checkpoint / "manifest.json")})
    keys = [k for k in tensor_shapes(checkpoint) if k.startswith("model.")]
    weights = {k.removeprefix("model."): v for k, v in read_tensors(checkpoint, keys).items()}
    return export_hf(cfg, weights, out)


def _hf_config(cfg: TrainConfig) -> dict:
    """The model's own config.json (local checkpoint) or the catalog shape's transformers config."""
    if cfg.model.path:
        return json.loads((Path(cfg.model.path) / "config.json").read_text())
    from transformers import AutoConfig

    from shardwise.run import model_spec

    spec = model_spec(cfg)
    return AutoConfig.for_model(**spec.to_hf_dict()).to_dict() | {"torch_dtype": "float32"}


def _copy_tokenizer(cfg: TrainConfig, out: Path) -> None:
    """The tokenizer the model was trained with (data.tokenizer, else the model directory's own,
    else the bundled one: shardwise.train.sft_data.resolved_tokenizer_path), so the directory
    is self-contained. Only tokenizer files: a model directory's config.json is not copied over
    the exported one."""
    if cfg.data.kind != "sft":
        return
    from shardwise.data import tokenizer_files
    from shardwise.train.sft_data import resolved_tokenizer_path

    src = Path(resolved_tokenizer_path(cfg))
    for f in tokenizer_files(src):
        dest = out / f.relative_to(src)  # keeps additional_chat_templates/ a directory
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
