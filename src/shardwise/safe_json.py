"""One JSON file read as untrusted input: bounded, strict, and every failure a ShardwiseError.

Python's `json` accepts `NaN`/`Infinity` (not JSON) and reads `1e400` as infinity, raises RecursionError on deep nesting and
ValueError on a 5,000-digit integer (the int-string limit), and `Path.read_text` reads a file of
any size (or `/dev/zero` for ever). Here the file must be a regular file within `max_bytes`, it is
read with a bounded read, and each of those ends in a ShardwiseError naming the file.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

MIB = 1 << 20


def read_bounded(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most `max_bytes` (a FIFO, a device or a larger file is
    refused before reading; the read itself stops at `max_bytes + 1`, should the file grow)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ShardwiseError(f"{p}: {what} not found") from None
    except OSError as e:
        raise ShardwiseError(f"{p}: {what} cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ShardwiseError(f"{p}: {what} is not a regular file")
    if st.st_size > max_bytes:
        raise ShardwiseError(f"{p}: {what} has {st.st_size} bytes, over the {max_bytes} shardwise reads")
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ShardwiseError(f"{p}: {what} cannot be read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise ShardwiseError(f"{p}: {what} grew past the {max_bytes} bytes shardwise reads")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text[:40]} is beyond a float's range")
    return v


def loads(text: str | bytes, where: str) -> Any:
    """Strict JSON (no NaN/Infinity, no number that overflows a float), a ShardwiseError naming
    `where` for anything else."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError as e:
        raise ShardwiseError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ShardwiseError(f"{where}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise ShardwiseError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # NaN/Infinity, an integer past Python's int-string limit
        raise ShardwiseError(f"{where}: not valid JSON ({e})") from None


def read_json(path: str | Path, max_bytes: int = 64 * MIB, what: str = "JSON file") -> Any:
    """`loads` of a file read by `read_bounded`."""
    return loads(read_bounded(path, max_bytes, what), str(path))


def read_json_object(path: str | Path, max_bytes: int = 64 * MIB, what: str = "JSON file") -> dict[str, Any]:
    """`read_json` of a file whose top level must be an object."""
    doc = read_json(path, max_bytes, what)
    if not isinstance(doc, dict):
        raise ShardwiseError(f"{path}: expected a JSON object at the top level, got {type(doc).__name__}")
    return doc
