"""SFT data pipeline: formats, chat templates, loss masks, isolated packing, resumable sampling.

Heavy imports (torch, transformers, datasets) happen lazily, on first use of the name that
needs them, so ``import shardwise.data`` and the asset paths stay cheap.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any

_ASSETS = Path(__file__).resolve().parent.parent / "assets"

_LAZY = {
    "DataConfig": "shardwise.data.config",
    "load_data_config": "shardwise.data.config",
    "build_dataset": "shardwise.data.dataset",
    "SFTDataset": "shardwise.data.dataset",
    "DataStats": "shardwise.data.dataset",
    "SFTCollator": "shardwise.data.collate",
    "count_target_tokens": "shardwise.data.labels",
    "ResumableDistributedSampler": "shardwise.data.sampler",
    "DEFAULT_CHAT_TEMPLATE": "shardwise.data.template",
}

__all__ = ["DEFAULT_CHAT_TEMPLATE", "DataConfig", "DataStats", "ResumableDistributedSampler", "SFTCollator",
           "SFTDataset", "build_dataset", "count_target_tokens", "default_tokenizer_path", "load_data_config",
           "load_tokenizer", "sample_data_path"]


def default_tokenizer_path() -> Path:
    """The bundled offline tokenizer (byte-level BPE, 2048 tokens, chat template)."""
    return _ASSETS / "tokenizer"


def sample_data_path() -> Path:
    """The bundled sample SFT dataset (chat, multi-turn and alpaca records, JSONL)."""
    return _ASSETS / "data" / "sft_sample.jsonl"


def load_tokenizer(path: str | Path | None = None) -> Any:
    """A fast HF tokenizer from a local dir (default: the bundled one); never touches the hub."""
    from transformers import AutoTokenizer

    from shardwise.errors import ShardwiseError

    path = Path(path) if path is not None else default_tokenizer_path()
    if not path.exists():
        raise ShardwiseError(f"tokenizer: path {str(path)!r} not found (expected a local tokenizer directory).")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ShardwiseError(f"tokenizer: cannot load {str(path)!r}: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise ShardwiseError(f"tokenizer: {str(path)!r} is not a fast tokenizer (tokenizer.json needed).")
    if tok.pad_token_id is None:  # padding is labelled -100 and isolated, so any id will do
        tok.pad_token = tok.eos_token
    return tok


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise.data' has no attribute {name!r}")
