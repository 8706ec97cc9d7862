"""Reading a config file within bounds, and strict JSON.

`read_text` reads a config the user names (the run YAML, `plan --from` files and the files they
name, a hardware spec or profile, a model's config.json): a regular file of at most
MAX_CONFIG_BYTES, UTF-8, read with that bound, so a 1 GiB file, /dev/zero or a FIFO is refused
before anything is read whole or waited for. `parse_json` is JSON as RFC 8259 has it: no NaN or
infinities, no number beyond a float or past MAX_NUMBER_CHARS digits, no key twice, at most
MAX_DEPTH levels and MAX_VALUES values. Each refusal is a ShardwiseError naming the file.
shardwise.config.safe_yaml reads YAML within the same bounds.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

# A config is a few KiB (the largest shipped or tool-written one is under 10 KiB); PyYAML's
# pure-Python reader takes about a second per MiB, so 1 MiB keeps any file read, or refused,
# within seconds and tens of MB, and a 1 GiB file or /dev/zero is refused unread.
MAX_CONFIG_BYTES = 1 << 20
# Sections of fields nest a few levels; 64 keeps every recursive walker (PyYAML's composer,
# key_lines, pydantic, the --from readers) far below Python's recursion limit.
MAX_DEPTH = 64
# An integer of more characters is no count or size (Python refuses to parse past 4,300 digits,
# and a 0b/0x or sexagesimal one would take quadratic time to build); 40 holds any 128-bit value.
MAX_NUMBER_CHARS = 40
# Values in one config, aliases expanded (a real config has a few hundred).
MAX_VALUES = 100_000


def read_text(path: Path, max_bytes: int = MAX_CONFIG_BYTES, what: str = "config file") -> str:
    """The text of the config file `path` (or another small file shardwise reads: `what`, at
    most `max_bytes`): a regular file (not a device, FIFO or directory) of at most `max_bytes`,
    read with that bound (a file that grows while read stops there too), decoded as UTF-8; each
    refusal a ShardwiseError naming the file."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise ShardwiseError(f"{path}: is a directory (expected a {what})")
        if not stat.S_ISREG(st.st_mode):  # /dev/zero never ends; opening a FIFO waits for a writer
            raise ShardwiseError(f"{path}: not a regular file (a device, FIFO or socket); expected a {what}")
        if st.st_size > max_bytes:
            raise too_large(path, f"{st.st_size:,} bytes", max_bytes, what)
        # O_NONBLOCK: should the path become a FIFO after the stat, opening it does not wait
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ShardwiseError(f"{path}: not a regular file (a device, FIFO or socket); expected a {what}")
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise ShardwiseError(f"{path}: {what} not found") from None
    except OSError as e:
        raise ShardwiseError(f"{path}: cannot read the {what} ({e.strerror})") from None
    if len(data) > max_bytes:
        raise too_large(path, f"more than {max_bytes:,} bytes", max_bytes, what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ShardwiseError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             "expected UTF-8 text.") from None  # fmt: skip


def too_large(path: Path, size: str, max_bytes: int = MAX_CONFIG_BYTES, what: str = "config file") -> ShardwiseError:
    why = " (a config is a few KiB)" if what == "config file" else ""
    return ShardwiseError(f"{path}: {size}; expected a {what} of at most {max_bytes:,} bytes{why}.")


class DuplicateKey(ShardwiseError):
    """A JSON object that gives a key twice (json keeps the last silently)."""


class _Refused(Exception):
    """A JSON value parse_json refuses (raised from json's hooks, which know no position)."""

    def __init__(self, message: str, duplicate: bool = False):
        super().__init__(message)
        self.duplicate = duplicate


def _json_number(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS and kind is int:
            raise _Refused(f"an integer of {len(text):,} digits; expected a count or size of at most "
                           f"{MAX_NUMBER_CHARS} digits")
        value = kind(text)
        if not math.isfinite(value):
            raise _Refused(f"{text[:40]} is beyond a float's range; expected a finite number")
        return value

    return parse


def _json_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number; expected a finite number")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"key {k!r} given twice in one object; expected each key once (JSON readers keep "
                           "only the last silently)", duplicate=True)
        out[k] = v
    return out


def parse_json(text: str, path: Path, *, strict: bool = True) -> Any:
    """`text` as JSON with no integer past MAX_NUMBER_CHARS digits, at most MAX_DEPTH levels and
    MAX_VALUES values; `strict` (RFC 8259, for configs shardwise reads as settings): also no
    NaN/Infinity, no number beyond a float, no key twice in an object (DuplicateKey). Not strict:
    as Python's json (and transformers) read it, for files other tools write."""
    hooks = dict(parse_constant=_json_constant, parse_float=_json_number(float),
                 object_pairs_hook=_json_object) if strict else {}
    try:
        data = json.loads(text, parse_int=_json_number(int), **hooks)
    except json.JSONDecodeError as e:
        raise ShardwiseError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ShardwiseError(f"{path}: JSON nested too deeply to read (more than {MAX_DEPTH} levels; expected "
                             "sections of keys, a few levels deep)") from None  # fmt: skip
    except _Refused as e:
        raise (DuplicateKey if e.duplicate else ShardwiseError)(f"{path}: not valid JSON ({e})") from None
    count, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ShardwiseError(f"{path}: more than {MAX_VALUES:,} values; expected a config of a few hundred")
        if level > MAX_DEPTH:
            raise ShardwiseError(f"{path}: JSON nested too deeply to read (more than {MAX_DEPTH} levels; expected "
                                 "sections of keys, a few levels deep)")
        stack.extend((c, level + 1) for c in (value.values() if isinstance(value, dict) else
                                              value if isinstance(value, list) else ()))
    return data


def read_json_object(path: Path, max_bytes: int = MAX_CONFIG_BYTES, what: str = "config file") -> dict[str, Any]:
    """`parse_json` (strict) of `read_text(path, max_bytes, what)`, whose top level must be an object."""
    doc = parse_json(read_text(path, max_bytes, what), path)
    if not isinstance(doc, dict):
        raise ShardwiseError(f"{path}: expected a JSON object at the top level (a {what}), got {type(doc).__name__}")
    return doc


def is_plain_file_name(name: object) -> bool:
    """A name that can only mean a file directly in one directory: a non-empty string with no
    separator (`/`, `\\`), no NUL, not `.` or `..`. What a file written by someone else (a checkpoint
    manifest or index, a weights index, an emit record) may name."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)
