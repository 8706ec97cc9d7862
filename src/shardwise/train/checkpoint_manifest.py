"""A checkpoint's manifest (shardwise.train.checkpoint writes it last, then publishes the
directory): the file entries it lists (bytes and sha256 of every file each rank wrote), the
versions it records, and the reading side: a published checkpoint verified against its manifest
(sizes, sha256, DCP's index through shardwise.train.checkpoint_index's allow-list) and
`checkpointing.resume` resolved to one that verifies. Preflight, export and the load read it
here; the save and load of the state itself stay in shardwise.train.checkpoint."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint_dir import (
    _ANY,
    MANIFEST,
    RANK_FILE,
    TRAINER_STATE,
    checkpoints_dir,
    incomplete,
    published,
    read_manifest_json,
    read_rank_rng,
    read_trainer_state,
)
from shardwise.train.checkpoint_index import UnsafeCheckpointError, read_index
from shardwise.train.lineage import read_lineage

_HASH_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_entries(d: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (d / n).stat().st_size, "sha256": _sha256(d / n)} for n in names}


def versions() -> dict[str, str]:
    """What the manifest records (shardwise.versions.run_versions)."""
    from shardwise.versions import run_versions

    return run_versions()


def read_manifest(path: Path, verify_hashes: bool = True) -> dict[str, Any]:
    """The manifest of a published checkpoint, after checking every file it lists (size, and
    sha256 unless `verify_hashes` is off) and reading DCP's index through the restricted
    unpickler (a crafted index raises UnsafeCheckpointError: the manifest is no signature, whoever
    can write the directory can refresh its hashes), then the trainer state and every rank's
    random streams checked field by field; ShardwiseError naming what is wrong otherwise."""
    manifest = read_manifest_json(path)
    for name, entry in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise ShardwiseError(f"{path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != entry["bytes"]:
            raise ShardwiseError(f"{path}: file {name} has {f.stat().st_size} bytes, the manifest says "
                                 f"{entry['bytes']}: the checkpoint is damaged")
        if verify_hashes and _sha256(f) != entry["sha256"]:
            raise ShardwiseError(f"{path}: file {name} does not match its sha256 in the manifest: "
                                 "the checkpoint is damaged")
    read_index(path)
    if TRAINER_STATE not in manifest["files"]:
        raise ShardwiseError(f"{path}: the manifest lists no {TRAINER_STATE}: not a complete checkpoint")
    read_trainer_state(path)
    for name in manifest["files"]:
        if RANK_FILE.fullmatch(name):
            read_rank_rng(path, name)
    return manifest


def resolve_resume(spec: str | None, output_dir: str | Path, verify_hashes: bool = True) -> Path | None:
    """`latest` -> the newest valid checkpoint of the output dir's current lineage (damaged
    ones are skipped and named), the branch's parent when the lineage has saved nothing yet, or
    None when the directory holds no checkpoint at all; if it holds some and none is valid, a
    ShardwiseError naming each. An explicit checkpoint dir must verify; a run dir (or its
    `checkpoints/`) means its latest. A crafted index is refused, never skipped."""
    if spec is None:
        return None
    if spec != "latest":
        p = Path(spec)
        if p.is_dir() and not (p / MANIFEST).exists() and (checkpoints_dir(p).is_dir() or p.name == "checkpoints"):
            root = p if p.name == "checkpoints" else checkpoints_dir(p)
            lin = read_lineage(root.parent)
            found = _newest_valid(root, verify_hashes, lin.lineage if lin else _ANY)
            if found is None:
                raise ShardwiseError(f"{root}: no complete checkpoint")
            return found
        read_manifest(p, verify_hashes)
        return p
    root = checkpoints_dir(output_dir)
    lin = read_lineage(output_dir)
    found = _newest_valid(root, verify_hashes, lin.lineage if lin else _ANY)
    if found is None and lin is not None and lin.parent is not None:
        parent = Path(lin.parent)
        print(f"shardwise: --resume latest: the branch started from {parent} has saved no checkpoint yet; "
              "resuming its parent")
        read_manifest(parent, verify_hashes)
        return parent
    if found is None and (published(root) or incomplete(root)):
        names = ", ".join(d.name for d in [*incomplete(root), *(d for _, d in published(root))])
        raise ShardwiseError(
            f"{root}: --resume latest: no valid checkpoint of this run's lineage among {names} (each is named "
            "above with what is wrong); nothing was started. Pass one explicitly with --resume PATH, or start "
            "over with --overwrite.")
    return found


def _newest_valid(root: Path, verify_hashes: bool, lineage: Any) -> Path | None:
    for d in incomplete(root):
        print(f"shardwise: skipping {d}: no {MANIFEST} (an incomplete or foreign directory); never loaded")
    for _, d in reversed(published(root, lineage)):
        try:
            read_manifest(d, verify_hashes)
            return d
        except UnsafeCheckpointError:
            raise
        except ShardwiseError as e:
            print(f"shardwise: skipping checkpoint {d}: {e}")
    return None
