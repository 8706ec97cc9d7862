"""A `plan --from` file with the advice's edits applied: written as a copy (the user's file is never
touched), so the edits can be planned again through the same reader before they are shown.

An edit's key is the key as the advice prints it: a dotted key of the file ("zero_optimization.stage"),
a dotted key of a file it names ("in ds_z3.json: zero_optimization.stage": the copy of that file is
edited and the copy of the config names it), or a setting of the program that runs the file, which
no key of the file holds ("TrainingArguments per_device_train_batch_size": given to the re-plan as
the flag it stands for). Torch-free.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from shardwise.errors import ShardwiseError
from shardwise.ingest.common import Setting, load

# the program's settings an advice names beside the file (ingest.deepspeed.trainer_keys,
# ingest.accelerate's batch keys), by the plan flag each stands for
_RUNNER = re.compile(r"^TrainingArguments (\w+)")
_RUNNER_FLAGS = {"per_device_train_batch_size": "micro_batch", "gradient_accumulation_steps": "grad_accum",
                 "gradient_checkpointing": "checkpointing"}
_IN_FILE = re.compile(r"^in (?P<name>[^:]+): (?P<key>.+)$")


def edited_copy(path: Path, edits: dict[str, Any], setting: Setting, dest: Path) -> tuple[Path, dict[str, Any]]:
    """Write `path` (and each file it names that an edit changes) with `edits` applied under `dest`;
    returns (the edited copy of `path`, the plan flags the runner's settings among `edits` stand
    for). A relative path the config names beside itself is made absolute in the copy, so the
    copy reads the files the original reads."""
    doc = load(path)
    data = _absolute_paths(doc.data, path.parent)
    flags: dict[str, Any] = {}
    named: dict[str, dict[str, Any]] = {}
    for key, value in edits.items():
        if (m := _RUNNER.match(key)) is not None:
            param = _RUNNER_FLAGS.get(m.group(1))
            if param is None:
                raise ShardwiseError(f"advice edit {key!r}: no plan flag stands for it")
            flags[param] = (setting.checkpointing if value else "none") if param == "checkpointing" else value
        elif (m := _IN_FILE.match(key)) is not None:
            named.setdefault(m.group("name"), {})[m.group("key")] = value
        else:
            _set(data, key, value)
    for name, file_edits in named.items():
        ref = _reference(data, name)
        if ref is None:
            raise ShardwiseError(f"advice edits {name}, which {path.name} does not name")
        keys, inner_path = ref
        inner = _absolute_paths(load(inner_path).data, inner_path.parent)
        for key, value in file_edits.items():
            _set(inner, key, value)
        out = dest / "named" / inner_path.name
        _write(out, inner, inner_path)
        _put(data, keys, str(out))
    out = dest / path.name
    _write(out, data, path)
    return out, flags


def _write(out: Path, data: dict, like: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if like.suffix.lower() == ".json" or like.read_text(errors="replace").lstrip().startswith("{"):
        out.write_text(json.dumps(data, indent=2))
    else:
        out.write_text(yaml.safe_dump(data, sort_keys=False))


def _set(data: dict, dotted_key: str, value: Any) -> None:
    """Set a dotted key, making the mappings on its way."""
    *parents, last = dotted_key.split(".")
    node = data
    for part in parents:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    node[last] = value


def _put(data: dict, keys: tuple, value: Any) -> None:
    node = data
    for part in keys[:-1]:
        node = node[part]
    node[keys[-1]] = value


def _absolute_paths(data: Any, base: Path) -> Any:
    """`data` with each string that names a file beside the config but not from the working
    directory (where the tools look first: ingest.common.resolve_path) made absolute."""
    if isinstance(data, dict):
        return {k: _absolute_paths(v, base) for k, v in data.items()}
    if isinstance(data, list):
        return [_absolute_paths(v, base) for v in data]
    if isinstance(data, str) and 0 < len(data) < 4096 and "\n" not in data:
        try:  # a string that is no path (a NUL, "~user" of no user) stays as it is
            p = Path(data).expanduser()
            if not p.is_absolute() and not p.is_file() and (base / p).is_file():
                return str((base / p).resolve())
        except (OSError, RuntimeError, ValueError):
            return data
    return data


def _reference(data: Any, name: str, keys: tuple = ()) -> tuple[tuple, Path] | None:
    """(the keys, the file) of the first string in `data` naming a file called `name`."""
    if isinstance(data, dict):
        for k, v in data.items():
            if (found := _reference(v, name, (*keys, k))) is not None:
                return found
    elif isinstance(data, str) and Path(data).name == name:
        try:
            p = Path(data).expanduser()
            if p.is_file():
                return keys, p
        except (OSError, RuntimeError, ValueError):
            return None
    return None
