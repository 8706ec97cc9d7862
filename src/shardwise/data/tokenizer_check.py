"""A tokenizer directory's files checked before transformers reads them: sizes, strict JSON,
nesting; errors name the file. transformers' own errors name neither the file nor the fault
(a NaN in tokenizer_config.json passes, a deep one ends in a RecursionError traceback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

# tokenizer.json, parsed by the Rust `tokenizers` library: the largest published ones are
# ~35 MB (Gemma 3, 262k tokens with merges); 256 MiB is seven times that.
MAX_TOKENIZER_JSON_BYTES = 256 << 20
# The small JSON files (tokenizer_config.json, special_tokens_map.json, added_tokens.json,
# chat_template.json; config.json when check_remote_code reads it) and chat_template.jinja, parsed by Python: a
# tokenizer_config.json listing 262k added tokens is ~30 MB.
MAX_CONFIG_BYTES = 64 << 20
JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.json")


def read_json(path: Path, *, where: str = "tokenizer", limit: int = MAX_CONFIG_BYTES, strict: bool = True) -> Any:
    """`path` parsed as JSON (`strict`: no NaN/Infinity), at most `limit` bytes and MAX_DEPTH
    levels deep; any fault is a ShardwiseError naming the file. config.json is read with
    strict=False here: its values are the model config checks' to judge, with their fields."""
    from shardwise.data.formats import MAX_DEPTH, STRICT_JSON, too_deep

    size = path.stat().st_size
    if size > limit:
        raise ShardwiseError(f"{where}: {path}: {size} bytes, over the bound of {limit} for this file.")
    try:
        text = path.read_bytes().decode("utf-8")
        doc = STRICT_JSON.decode(text) if strict else json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShardwiseError(f"{where}: {path}:{exc.lineno}: malformed JSON: {exc.msg} at column {exc.colno}.") from None
    except RecursionError:
        raise ShardwiseError(f"{where}: {path}: JSON nested too deeply to parse (more than {MAX_DEPTH} levels "
                             "are refused).") from None  # fmt: skip
    except (UnicodeDecodeError, ValueError, OSError) as exc:
        raise ShardwiseError(f"{where}: {path}: cannot be read as JSON ({exc}).") from None
    if isinstance(doc, (dict, list)) and too_deep(doc):
        raise ShardwiseError(f"{where}: {path}: JSON nested more than {MAX_DEPTH} levels deep.")
    return doc


def check_tokenizer_files(path: Path, *, where: str = "tokenizer") -> None:
    """Refuse a tokenizer directory whose files are too big, not strict JSON, too deep, or
    (the small JSON files) not a JSON object; chat_template.jinja must be UTF-8 text."""
    for name in JSON_FILES:
        f = path / name
        if f.is_file():
            doc = read_json(f, where=where)
            if not isinstance(doc, dict):
                raise ShardwiseError(f"{where}: {f}: expected a JSON object, got {type(doc).__name__}.")
    tj = path / "tokenizer.json"
    if tj.is_file() and (size := tj.stat().st_size) > MAX_TOKENIZER_JSON_BYTES:
        raise ShardwiseError(f"{where}: {tj}: {size} bytes, over the bound of {MAX_TOKENIZER_JSON_BYTES} "
                             "(the largest published tokenizer.json files are ~35 MB).")  # fmt: skip
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        size = jinja.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ShardwiseError(f"{where}: {jinja}: {size} bytes, over the bound of {MAX_CONFIG_BYTES}.")
        try:
            jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ShardwiseError(f"{where}: {jinja}: not UTF-8 text (byte at offset {exc.start}).") from None


def explain_load_failure(path: Path, exc: Exception, *, where: str = "tokenizer") -> ShardwiseError:
    """The error for a tokenizer transformers could not load: naming tokenizer.json when the
    `tokenizers` library refuses it on its own, else the directory."""
    tj = path / "tokenizer.json"
    if tj.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(tj))
        except Exception as inner:  # the Rust library's errors are plain Exceptions
            return ShardwiseError(f"{where}: {tj}: not a valid tokenizer.json: {inner}.")
    return ShardwiseError(f"{where}: cannot load {str(path)!r}: {type(exc).__name__}: {exc}")
