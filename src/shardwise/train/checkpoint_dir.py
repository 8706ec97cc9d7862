"""The checkpoints directory of a run, torch-free: the `step-N` names, which directories look
published (a manifest is present; optionally of one lineage), which are incomplete, and a
manifest read and its format checked (nothing verified: shardwise.train.checkpoint_manifest does that).
The checkpoint, the lineage and the output-directory checks read it here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

FORMAT = "shardwise-checkpoint/1"
MANIFEST = "manifest.json"
_ANY = object()


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
    checkpoints that name none; shardwise.train.lineage)."""
    out = []
    for step, d in step_dirs(root):
        if not (d / MANIFEST).is_file():
            continue
        if lineage is not _ANY:
            try:
                if json.loads((d / MANIFEST).read_text()).get("lineage") != lineage:
                    continue
            except (OSError, ValueError, AttributeError):
                continue  # unreadable: not this lineage's (resolve_resume names it)
        out.append((step, d))
    return out

def incomplete(root: Path) -> list[Path]:
    """`step-*` directories without a manifest: never loaded, always named."""
    return [d for _, d in step_dirs(root) if not (d / MANIFEST).is_file()]

def read_manifest_json(path: Path) -> dict[str, Any]:
    """The manifest of `path` parsed and its format checked, nothing verified."""
    mf = path / MANIFEST
    if not path.is_dir():
        raise ShardwiseError(f"{path}: checkpoint directory not found")
    if not mf.is_file():
        raise ShardwiseError(f"{path}: no {MANIFEST}: an incomplete checkpoint (a save that did not finish); "
                             "it is never loaded")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardwiseError(f"{mf}: not valid JSON ({e}); the checkpoint is not loaded") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardwiseError(f"{mf}: field 'format': expected {FORMAT!r}, got "
                             f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    return manifest
