"""Export consolidated weights as a Hugging Face model directory: `model.safetensors`,
`config.json` and the tokenizer, loadable by `AutoModelForCausalLM.from_pretrained` (no code,
no pickles: safetensors only)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from shardwise.train.config import TrainConfig


def export_hf(cfg: TrainConfig, weights: dict[str, torch.Tensor], out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf_config = _hf_config(cfg)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    # Tied weights appear under two names and safetensors refuses shared storage: keep one
    # name, as transformers' own save_pretrained does (the tie is restored on load).
    tensors = {k: v.contiguous().clone() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    _copy_tokenizer(cfg, out)
    return out


def _hf_config(cfg: TrainConfig) -> dict:
    """The model's own config.json (local checkpoint) or the catalog shape's transformers config."""
    if cfg.model.path:
        return json.loads((Path(cfg.model.path) / "config.json").read_text())
    from transformers import AutoConfig

    from shardwise.run import model_spec

    spec = model_spec(cfg)
    return AutoConfig.for_model(**spec.to_hf_dict()).to_dict() | {"torch_dtype": "float32"}


def _copy_tokenizer(cfg: TrainConfig, out: Path) -> None:
    """The tokenizer the model was trained with, so the directory is self-contained."""
    if cfg.data.kind != "sft":
        return
    from shardwise.data import default_tokenizer_path

    src = Path(cfg.data.tokenizer) if cfg.data.tokenizer else Path(default_tokenizer_path())
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy2(f, out / f.name)
