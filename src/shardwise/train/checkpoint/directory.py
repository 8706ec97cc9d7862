"""The checkpoints directory of a run, torch-free: the `step-N` names, which directories look
published (a manifest is present; optionally of one lineage), which are incomplete, and the
checkpoint's JSON files read as untrusted input (shardwise.config.file: bounded, strict) with the
types of every field shardwise reads checked: the manifest, `trainer_state.json` and the ranks'
`rank-N.json` (nothing verified against the files: shardwise.train.checkpoint.sharded.read_manifest does
that). The checkpoint, the lineage and the output-directory checks read them here."""

from __future__ import annotations

import base64
import binascii
import math
import re
from pathlib import Path
from typing import Any

from shardwise.config.file import is_plain_file_name, read_json_object
from shardwise.errors import ShardwiseError

FORMAT = "shardwise-checkpoint/1"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RANK_FILE = re.compile(r"rank-(\d{5,})\.json")
_ANY = object()
_MAX_MANIFEST = 256 << 20  # a file entry per shard per rank: ~150 bytes each, a few MB at 1,000s of ranks
_MAX_STATE = 4 << 20  # the trainer state and one rank's RNG streams: a few KB


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"

def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"

def step_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    for d in root.glob("step-*") if root.is_dir() else ():
        try:
            step = int(d.name.removeprefix("step-"))
        except ValueError:
            continue
        if d.is_dir():
            out.append((step, d))
    return sorted(out)

def published(root: Path, lineage: Any = _ANY) -> list[tuple[int, Path]]:
    """(step, dir) of every directory that looks published (a manifest is present), oldest
    first; with `lineage`, only those whose manifest names that lineage (None: the legacy
    checkpoints that name none; shardwise.train.checkpoint.lineage)."""
    out = []
    for step, d in step_dirs(root):
        if not (d / MANIFEST).is_file():
            continue
        if lineage is not _ANY:
            try:
                if read_json_object(d / MANIFEST, _MAX_MANIFEST, "checkpoint manifest").get("lineage") != lineage:
                    continue
            except ShardwiseError:
                continue  # unreadable: not this lineage's (resolve_resume names it)
        out.append((step, d))
    return out

def incomplete(root: Path) -> list[Path]:
    """`step-*` directories without a manifest: never loaded, always named."""
    return [d for _, d in step_dirs(root) if not (d / MANIFEST).is_file()]

def _is_int(v: Any, least: int = 0) -> bool:
    return type(v) is int and v >= least


def read_manifest_json(path: Path) -> dict[str, Any]:
    """The manifest of `path` parsed and the fields shardwise reads checked (format, step, world
    size, the file entries: plain names, sizes, sha256; config, lineage), nothing verified."""
    mf = path / MANIFEST
    if not path.is_dir():
        raise ShardwiseError(f"{path}: checkpoint directory not found")
    if not mf.is_file():
        raise ShardwiseError(f"{path}: no {MANIFEST}: an incomplete checkpoint (a save that did not finish); "
                             "it is never loaded")
    manifest = read_json_object(mf, _MAX_MANIFEST, "checkpoint manifest")
    if manifest.get("format") != FORMAT:
        raise ShardwiseError(f"{mf}: field 'format': expected {FORMAT!r}, got {manifest.get('format')!r}")
    bad = _manifest_field_errors(manifest)
    if bad:
        raise ShardwiseError(f"{mf}: {bad}; the checkpoint is not loaded")
    return manifest


def _manifest_field_errors(m: dict[str, Any]) -> str | None:
    if not _is_int(m.get("step")):
        return f"field 'step': expected a non-negative integer, got {m.get('step')!r}"
    if not _is_int(m.get("world_size"), 1):
        return f"field 'world_size': expected a positive integer, got {m.get('world_size')!r}"
    for key in ("config", "files"):
        if not isinstance(m.get(key), dict):
            return f"field {key!r}: expected an object, got {type(m.get(key)).__name__}"
    for key in ("lineage", "parent", "strategy"):
        if m.get(key) is not None and not isinstance(m[key], str):
            return f"field {key!r}: expected a string, got {m[key]!r}"
    for name, entry in m["files"].items():
        if not is_plain_file_name(name):
            return f"field 'files': {name!r} is not a file name of the checkpoint directory"
        if not (isinstance(entry, dict) and _is_int(entry.get("bytes"))
                and isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            return f"field 'files.{name}': expected {{bytes: a non-negative integer, sha256: 64 hex digits}}"
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    """`trainer_state.json`: step, samples consumed, global batch and the streak of skipped
    non-finite steps (non-negative integers), the engine's extra state (optimizer step, loss
    scaler), the training time."""
    f = path / TRAINER_STATE
    d = read_json_object(f, _MAX_STATE, "trainer state")
    fields = {"step", "samples_consumed", "global_batch", "engine", "train_time_s", "nonfinite_streak"}
    if set(d) - fields or not {"step", "samples_consumed", "global_batch"} <= set(d):
        raise ShardwiseError(f"{f}: expected the fields {sorted(fields)} (the last three optional), got "
                             f"{sorted(d)}; the checkpoint is not loaded")
    for k in ("step", "samples_consumed", "global_batch", "nonfinite_streak"):
        if k not in d:
            continue
        if not _is_int(d[k], 1 if k == "global_batch" else 0):
            raise ShardwiseError(f"{f}: field {k!r}: expected a {'positive' if k == 'global_batch' else 'non-negative'}"
                                 f" integer, got {d[k]!r}; the checkpoint is not loaded")
    engine = d.get("engine", {})
    scaler = engine.get("scaler") if isinstance(engine, dict) else None
    if not (isinstance(engine, dict) and set(engine) <= {"optimizer_step", "scaler"}
            and ("optimizer_step" not in engine or _is_int(engine["optimizer_step"]))
            and (scaler is None or (isinstance(scaler, dict) and all(_scalar(v) for v in scaler.values())))):
        raise ShardwiseError(f"{f}: field 'engine': expected {{optimizer_step: a non-negative integer, scaler: null "
                             "or an object of numbers}}; the checkpoint is not loaded")
    t = d.get("train_time_s", 0.0)
    if not (type(t) in (int, float) and math.isfinite(t) and t >= 0):
        raise ShardwiseError(f"{f}: field 'train_time_s': expected a non-negative number, got {t!r}; "
                             "the checkpoint is not loaded")
    return d


def _scalar(v: Any) -> bool:
    return v is None or type(v) in (bool, int, str) or (type(v) is float and math.isfinite(v))


_TORCH_RNG_BYTES = 5056  # torch.get_rng_state() on the CPU: the MT19937 state (torch 2.x)


def read_rank_rng(path: Path, name: str) -> dict[str, Any]:
    """The random streams in `rank-N.json`, their shapes checked as `set_rng_state` needs them
    (Python's and NumPy's Mersenne Twister, torch's CPU state, optionally CUDA's)."""
    f = path / name
    d = read_json_object(f, _MAX_STATE, "rank state")
    rng = d.get("rng")
    why = _rng_errors(rng)
    if why:
        raise ShardwiseError(f"{f}: field 'rng': {why}; the checkpoint is not loaded")
    return rng


def _rng_errors(rng: Any) -> str | None:
    if not isinstance(rng, dict):
        return "expected an object"
    py = rng.get("python")
    if not (isinstance(py, list) and len(py) == 3 and _is_int(py[0]) and isinstance(py[1], list)
            and len(py[1]) == 625 and all(_is_int(x) and x < 2**32 for x in py[1])
            and (py[2] is None or type(py[2]) is float)):
        return "'python': expected [version, 625 integers below 2**32, null or a float]"
    npy = rng.get("numpy")
    if not (isinstance(npy, list) and len(npy) == 5 and npy[0] == "MT19937" and isinstance(npy[1], list)
            and len(npy[1]) == 624 and all(_is_int(x) and x < 2**32 for x in npy[1])
            and _is_int(npy[2]) and npy[2] <= 624 and _is_int(npy[3]) and type(npy[4]) in (int, float)
            and math.isfinite(npy[4])):
        return "'numpy': expected ['MT19937', 624 integers below 2**32, position <= 624, has_gauss, a number]"
    for key in ("torch", "cuda"):
        if key == "cuda" and key not in rng:
            continue
        try:
            raw = base64.b64decode(rng.get(key), validate=True) if isinstance(rng.get(key), str) else None
        except (binascii.Error, ValueError):
            raw = None
        if raw is None or (key == "torch" and len(raw) != _TORCH_RNG_BYTES):
            return f"{key!r}: expected base64 of the generator's state" + (
                f" ({_TORCH_RNG_BYTES} bytes)" if key == "torch" else "")
    return None
