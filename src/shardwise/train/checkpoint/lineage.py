"""Which run a checkpoint belongs to: pruning and `--resume latest` never cross runs.

Every run gets a `run_id`; every checkpoint's manifest names the run that wrote it, its
*lineage* (the timeline it continues) and, for the first run of a branch, the checkpoint it
started from (`parent`). The output directory records the lineage of the run that last
started in it (`<output_dir>/.shardwise/lineage.json`, written before any rank starts).

- A fresh run starts a new lineage (a fresh run into a directory that already holds
  checkpoints or an exported model is refused, unless `--overwrite` clears them first).
- Resuming the newest checkpoint of a lineage in the same directory continues that lineage.
- Resuming any other checkpoint (an earlier step of the same directory, or another
  directory's) starts a branch: a new lineage whose parent is that checkpoint. The abandoned
  timeline's later checkpoints stay where they are; the branch neither prunes nor resumes
  them (only a checkpoint of the same step name is replaced when the branch saves it).
- `keep_last` counts only the current lineage; `--resume latest` takes the newest valid
  checkpoint of the directory's current lineage, or its parent when the branch has not
  saved yet.

Checkpoints written before lineages existed have none: together they form one legacy lineage
(`None`), handled as before.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from shardwise import strict_json
from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint.directory import checkpoints_dir, published, read_manifest_json

LINEAGE_FILE = "lineage.json"
RUN_ID_ENV = "SHARDWISE_RUN_ID"  # the launcher's run id, passed to the ranks it starts


@dataclass(frozen=True)
class Lineage:
    run_id: str
    lineage: str | None  # None: checkpoints from before lineages (one legacy timeline)
    parent: str | None = None  # the checkpoint a branch started from

    def manifest_fields(self) -> dict[str, str | None]:
        return {"run_id": self.run_id, "lineage": self.lineage, "parent": self.parent}


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def lineage_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / ".shardwise" / LINEAGE_FILE


def read_lineage(output_dir: str | Path) -> Lineage | None:
    """The lineage of the run that last started in `output_dir`, None when none recorded."""
    from shardwise.config.file import read_json_object

    p = lineage_path(output_dir)
    if not p.exists():
        return None
    try:
        d = read_json_object(p, 1 << 20, "lineage record")
        return Lineage(run_id=str(d["run_id"]), lineage=d.get("lineage"), parent=d.get("parent"))
    except (ShardwiseError, KeyError, TypeError):
        return None


def write_lineage(output_dir: str | Path, lineage: Lineage) -> None:
    p = lineage_path(output_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".tmp-{LINEAGE_FILE}-{os.getpid()}.shardwise-tmp")
    tmp.write_text(strict_json.dumps(asdict(lineage), indent=2))
    os.replace(tmp, p)


def manifest_lineage(manifest: dict) -> str | None:
    return manifest.get("lineage")


def start_lineage(output_dir: str | Path, resume: Path | None, run_id: str | None = None) -> Lineage:
    """This run's lineage: new for a fresh run; the checkpoint's own when it resumes the newest
    checkpoint of that lineage in this directory; otherwise a branch from `resume`."""
    run_id = run_id or new_run_id()
    if resume is None:
        return Lineage(run_id, run_id)
    manifest = read_manifest_json(resume)
    lin = manifest_lineage(manifest)
    root = checkpoints_dir(output_dir)
    same_dir = root.is_dir() and Path(resume).resolve().parent == root.resolve()
    if same_dir:
        steps = [step for step, _ in published(root, lineage=lin)]
        if steps and int(manifest["step"]) >= max(steps):
            return Lineage(run_id, lin, manifest.get("parent") if lin is not None else None)
    return Lineage(run_id, run_id, parent=str(Path(resume).resolve()))
