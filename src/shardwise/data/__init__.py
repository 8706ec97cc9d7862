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
    "build_dataset": "shardwise.data.dataset",
    "SFTDataset": "shardwise.data.dataset",
    "DataStats": "shardwise.data.dataset",
    "SFTCollator": "shardwise.data.collate",
    "count_target_tokens": "shardwise.data.labels",
    "ResumableDistributedSampler": "shardwise.data.sampler",
    "DEFAULT_CHAT_TEMPLATE": "shardwise.data.template",
    "ensure_cache": "shardwise.data.cache",
    "find_cache": "shardwise.data.cache",
    "load_dataset": "shardwise.data.cache",
}

__all__ = ["DEFAULT_CHAT_TEMPLATE", "TOKENIZER_FILES", "DataStats", "ResumableDistributedSampler",
           "SFTCollator", "SFTDataset", "build_dataset", "check_remote_code", "count_target_tokens",
           "default_tokenizer_path", "ensure_cache", "find_cache", "load_dataset", "load_tokenizer",
           "sample_data_path", "tokenizer_files"]

# The files a Hugging Face tokenizer is saved as (save_pretrained, and the legacy slow formats).
# A model directory also holds config.json and weights: only these names are the tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "merges.txt", "vocab.txt")  # fmt: skip


def default_tokenizer_path() -> Path:
    """The bundled offline tokenizer (byte-level BPE, 1172 tokens, chat template); it fits the
    2048-row embeddings of the tiny catalog models."""
    return _ASSETS / "tokenizer"


def sample_data_path() -> Path:
    """The bundled sample SFT dataset (chat, multi-turn and alpaca records, JSONL)."""
    return _ASSETS / "data" / "sft_sample.jsonl"


def tokenizer_files(path: str | Path) -> list[Path]:
    """The tokenizer's files in `path` (sorted; none when it holds no tokenizer): what the data
    cache key hashes and what an exported model directory must carry."""
    path = Path(path)
    files = [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
    extra = path / "additional_chat_templates"  # where save_pretrained puts named chat templates
    if extra.is_dir():
        files += [f for f in extra.iterdir() if f.is_file()]
    return sorted(files)


# The files of a tokenizer directory whose `auto_map` makes AutoTokenizer import Python code from
# that directory: tokenizer_config.json names the tokenizer class, and config.json is read when it
# does not (its AutoConfig / AutoTokenizer entries).
REMOTE_CODE_FILES = ("tokenizer_config.json", "config.json")
OPT_IN = "set model.trust_remote_code: true (--set model.trust_remote_code=true)"


def check_remote_code(path: str | Path, trust_remote_code: bool = False, *, where: str = "tokenizer",
                      opt_in: str = OPT_IN) -> None:  # fmt: skip
    """Refuse a tokenizer directory that ships its own code (an `auto_map` in one of
    REMOTE_CODE_FILES) unless the user opted in: the error names the file, the `auto_map` and
    the opt-in. transformers would otherwise ask on stdin (a piped `y` ran the code); with the
    explicit `trust_remote_code` it never asks."""
    import json

    from shardwise.data.tokenizer_check import read_json
    from shardwise.errors import ShardwiseError

    if trust_remote_code:
        return
    for name in REMOTE_CODE_FILES:
        f = Path(path) / name
        if not f.is_file():
            continue
        doc = read_json(f, where=where, strict=name != "config.json")
        auto_map = doc.get("auto_map") if isinstance(doc, dict) else None
        if auto_map:
            shown = json.dumps(auto_map)
            shown = shown if len(shown) <= 200 else shown[:200] + "..."
            raise ShardwiseError(
                f"{where}: {f}: field 'auto_map' is {shown}: the tokenizer ships its own Python code, which "
                f"shardwise does not run by default; {opt_in} only if you trust that code.")


def load_tokenizer(path: str | Path | None = None, trust_remote_code: bool = False, *,
                   opt_in: str = OPT_IN) -> Any:  # fmt: skip
    """A fast HF tokenizer from a local dir (default: the bundled one); never touches the hub.

    `trust_remote_code` (the config's `model.trust_remote_code`) is passed to transformers
    explicitly, so it never prompts on stdin; without it a directory with an `auto_map` is
    refused first (`check_remote_code`, whose message names `opt_in`), and files too big, not
    strict JSON or too deep are refused naming the file (`check_tokenizer_files`)."""
    from transformers import AutoTokenizer

    from shardwise.data.tokenizer_check import check_tokenizer_files, explain_load_failure
    from shardwise.errors import ShardwiseError

    path = Path(path) if path is not None else default_tokenizer_path()
    if not path.exists():
        raise ShardwiseError(f"tokenizer: path {str(path)!r} not found (expected a local tokenizer directory).")
    check_remote_code(path, trust_remote_code, opt_in=opt_in)
    check_tokenizer_files(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise explain_load_failure(path, exc) from None
    if not getattr(tok, "is_fast", False):
        raise ShardwiseError(f"tokenizer: {str(path)!r} is not a fast tokenizer (tokenizer.json needed).")
    if tok.pad_token_id is None:  # padding is labelled -100 and isolated, so any id will do
        tok.pad_token = tok.eos_token
    return tok


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardwise.data' has no attribute {name!r}")
