"""Strict JSON for everything shardwise writes (RFC 8259: no bare NaN or Infinity, which most
parsers refuse: jq, JavaScript's JSON.parse, Go, serde, Python with `parse_constant`).

A float that is not finite is written as the string "NaN", "Infinity" or "-Infinity" (the
spelling JavaScript and Python's `float()` read back: `float("Infinity")`), wherever it sits
in the object; everything else is as `json.dumps` writes it. docs/training.md says so for
metrics.jsonl and summary.json."""

from __future__ import annotations

import json
import math
from typing import Any


def encode(obj: Any) -> Any:
    """`obj` with each non-finite float (at any depth of dicts, lists and tuples) replaced by its
    string; a new container where one was changed, the same object otherwise."""
    if isinstance(obj, float):  # numpy's float64 too
        if math.isfinite(obj):
            return obj
        return "NaN" if math.isnan(obj) else "Infinity" if obj > 0 else "-Infinity"
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """`json.dumps(obj, **kw)` with non-finite floats as strings (`encode`) and `allow_nan=False`:
    a value the encoding missed raises instead of writing invalid JSON."""
    return json.dumps(encode(obj), allow_nan=False, **kw)
