"""Writing an emit's files into their directory without going through what is already there
(shardwise.emit builds the files; this module only puts them in place).

Every file is written into a new private temp directory inside the target and renamed over its
name (`os.replace` replaces a symlink, it does not follow it), so a link planted at `README.md`
stays pointing where it pointed and its target is untouched. What was written is recorded in
`.shardwise-emit.json` (name -> sha256); the next emit into the directory removes the files of
the earlier one that it does not write again (a `ds_config.json` beside a new FSDP plan), and
nothing else. An earlier file that was edited since, or stale files without a record (an emit of
an older shardwise), are refused, named, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from shardwise import strict_json
from shardwise.config.file import is_plain_file_name
from shardwise.emit.accelerate import DS_HF_FILE
from shardwise.errors import ShardwiseError

EMIT_MANIFEST = ".shardwise-emit.json"
EMIT_FORMAT = "shardwise-emit/1"
_TMP_PREFIX = ".shardwise-emit-tmp-"
# Every name an emit can write (shardwise.emit's emit_configs, launch.py, accelerate.py): stale ones in a
# directory without a manifest were written by an older shardwise, or by the user.
EMITTABLE = ("shardwise.yaml", "ds_config.json", DS_HF_FILE, "accelerate.yaml", "launch_torchrun.sh",
             "launch_deepspeed.sh", "launch_accelerate.sh", "slurm.sbatch", "README.md")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _plain_name(name: object) -> bool:
    """A file name directly in the emit dir (a manifest entry naming anything else is ignored)."""
    return is_plain_file_name(name) and name != EMIT_MANIFEST


def _regular_file_hash(path: Path) -> str | None:
    """sha256 of `path` when it is a regular file (read without following a symlink), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return _sha256(f.read())
    except OSError:
        return None


def earlier_emit(out_dir: Path) -> dict[str, str] | None:
    """name -> sha256 of what an earlier emit wrote into `out_dir` (its manifest), None without one."""
    try:
        fd = os.open(out_dir / EMIT_MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return None
    entries = doc.get("files") if isinstance(doc, dict) and doc.get("format") == EMIT_FORMAT else None
    if not isinstance(entries, dict):
        return None
    return {k: v for k, v in entries.items() if _plain_name(k) and isinstance(v, str)}


def stale_files(out_dir: Path, names: set[str]) -> list[Path]:
    """The files of an earlier emit into `out_dir` that this one (writing `names`) does not write
    again, to remove once the new files are in place; refuses, before anything is written, one
    that changed since it was emitted and stale emit files nobody recorded."""
    where = f"--emit {str(out_dir)!r}"
    before = earlier_emit(out_dir)
    if before is None:
        unknown = [n for n in EMITTABLE if n not in names and os.path.lexists(out_dir / n)]
        if unknown:
            raise ShardwiseError(
                f"{where}: holds {', '.join(unknown)}, which this plan does not use and no earlier `plan --emit` "
                f"recorded ({EMIT_MANIFEST} is missing): left beside the new files it would be read as part of "
                "this plan. Delete or move it, or choose another directory.")
        return []
    stale, changed = [], []
    for name, digest in before.items():
        path = out_dir / name
        if name in names or not os.path.lexists(path):
            continue
        (stale if _regular_file_hash(path) == digest else changed).append(path)
    if changed:
        raise ShardwiseError(
            f"{where}: {', '.join(p.name for p in changed)} was written by an earlier `plan --emit` and changed since "
            "(or replaced); this plan does not use it, and shardwise removes only the files it wrote unchanged. "
            "Delete or move it, or choose another directory.")
    return stale


def publish(out_dir: Path, files: dict[str, tuple[str, bool]]) -> list[Path]:
    """Write `files` (name -> text, executable) into `out_dir` without following anything already
    there, record them in the manifest and remove the earlier emit's leftovers (module docstring).
    Returns the paths written, in order (the manifest not included)."""
    where = f"--emit {str(out_dir)!r}"
    for name in files:
        p = out_dir / name
        if p.is_dir() and not p.is_symlink():
            raise ShardwiseError(f"{where}: {name} is a directory; expected a file name free for the emitted file.")
    stale = stale_files(out_dir, set(files))
    for old in out_dir.glob(_TMP_PREFIX + "*"):  # what a killed emit left
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=out_dir))
    except OSError as e:
        raise ShardwiseError(f"{where}: cannot write into the directory ({e.strerror}); expected a writable "
                             "directory.") from None  # fmt: skip
    try:
        record = {}
        name = EMIT_MANIFEST
        try:
            for name, (text, executable) in files.items():
                (tmp / name).write_text(text)  # a fresh private directory: nothing there to follow
                if executable:
                    (tmp / name).chmod(0o755)
                record[name] = _sha256(text.encode())
            name = EMIT_MANIFEST
            (tmp / name).write_text(strict_json.dumps({"format": EMIT_FORMAT, "files": record}, indent=2) + "\n")
            for name in [*files, EMIT_MANIFEST]:  # the manifest last: it describes what is in place
                os.replace(tmp / name, out_dir / name)
        except OSError as e:
            raise ShardwiseError(f"{where}: cannot write {name} ({e.strerror}); expected a writable "
                                 "directory.") from None  # fmt: skip
        for p in stale:
            p.unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out_dir / n for n in files]


def writable_dir(out_dir: Path) -> None:
    """Refuse an --emit target that cannot hold the files, before any is written: an existing
    file, a directory that cannot be created, or one this user cannot write into."""
    where = f"--emit {str(out_dir)!r}"
    if out_dir.exists() and not out_dir.is_dir():
        raise ShardwiseError(f"{where}: is an existing file; expected a directory (existing or to be created).")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ShardwiseError(f"{where}: cannot create the directory ({e.strerror}); expected a writable "
                             "directory path.") from None  # fmt: skip
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ShardwiseError(f"{where}: the directory is not writable; expected a writable directory.")
