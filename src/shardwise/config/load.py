"""A training YAML read into a TrainConfig: the file (bounded, safe YAML), `--set a.b=c`
overrides parsed as YAML scalars and applied before validation (an override is checked exactly
like a line of the file), placeholders `plan --emit` left refused. Errors name the file, the line,
the dotted field, the value given and what is accepted."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shardwise.config.safe_yaml import check_values, key_lines, line_of, parse_yaml, read_yaml
from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError, user_error


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """`a.b.c=value`: value parsed as YAML (so `1e-4`, `true`, `[1, 2]` get their types)."""
    if "=" not in assignment:
        raise ShardwiseError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set strategy.name=zero3")
    value = assignment.split("=", 1)[1]
    parts = list(override_key(assignment))
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ShardwiseError(f"--set {assignment!r}: {p!r} is a value, not a section")
        node = nxt
    if not value.strip():
        node[parts[-1]] = None
        return
    try:  # the file's own bounded reader: depth, values, integer digits, duplicate keys
        node[parts[-1]] = parse_yaml(value, Path("<value>"))[1]
    except ShardwiseError as e:
        short = assignment if len(assignment) <= 80 else assignment[:80] + "..."
        raise ShardwiseError(f"--set {short!r}: {re.sub(r'^<value>(:[0-9]+)?: ', '', str(e))}") from None


# What `plan --emit` writes where only the user knows the value (the real model weights, the
# training files): a string starting with this is refused by `load_config`, naming the field.
PLACEHOLDER = "<FILL IN"


def _placeholders(raw: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """(key path, value) of every string that is a `plan --emit` placeholder."""
    found = []
    stack = [(path, raw)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, str) and v.startswith(PLACEHOLDER):
            found.append((p, v))
        elif isinstance(v, dict):
            stack.extend(((*p, k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend(((*p, i), x) for i, x in enumerate(v))
    return sorted(found, key=lambda f: [str(x) for x in f[0]])


def validate(
    raw: dict[str, Any], source: str = "<config>", lines: dict[tuple, int] | None = None,
    overrides: dict[tuple, str] | None = None,
) -> TrainConfig:
    """`overrides`: the key paths `--set` gave, each with its assignment (errors there name it)."""
    try:
        return TrainConfig.model_validate({**raw, "source": source})
    except ValidationError as exc:
        raise user_error(exc, source, model=TrainConfig, lines=lines, header="invalid config",
                         overrides=overrides) from None


def override_key(assignment: str) -> tuple[str, ...]:
    """The key path of a `--set a.b.c=value` assignment; an empty key or an empty part of one
    (`run..steps`, `.run.steps`, `run.steps.`) is refused, naming the assignment."""
    key = assignment.split("=", 1)[0].strip()
    parts = tuple(key.split("."))
    if not all(p.strip() for p in parts):
        raise ShardwiseError(f"--set {assignment!r}: key {key!r} has an empty part; expected dotted field names "
                             "such as run.steps (--set run.steps=100)")
    return parts


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read, override and validate a YAML config; every failure is a ShardwiseError."""
    path = Path(path)
    node, raw = read_yaml(path)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ShardwiseError(f"{path}: expected a mapping of sections at the top, got {type(raw).__name__}")
    for o in overrides:
        try:
            apply_override(raw, o)
        except RecursionError:  # an override's value is YAML too: as deep as a file can be
            raise ShardwiseError(f"--set {o[:60]!r}...: value nested too deeply to read (expected a scalar "
                                 "or a short list).") from None  # fmt: skip
    check_values(raw, f"{path} (after the --set overrides)")  # ... and gets the same alias budget
    lines = key_lines(node) if node is not None else {}
    holes = _placeholders(raw)
    if holes:
        out = []
        for key, value in holes:
            field = ".".join(str(x) for x in key if not isinstance(x, int))
            example = "'[VALUE, ...]'" if isinstance(key[-1], int) else "VALUE"
            out.append((line_of(lines, key), f"{path}:{line_of(lines, key)}: field {field!r} = {value!r}: replace it "
                        f"in the file, or pass --set {field}={example}"))  # fmt: skip
        raise ShardwiseError(f"{path}: placeholder values (written by `shardwise plan --emit`) to replace before "
                             "training:\n  " + "\n  ".join(m for _, m in sorted(out)))  # fmt: skip
    return validate(raw, str(path), lines, overrides={override_key(o): o for o in overrides})
