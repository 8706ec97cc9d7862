"""The output directory: checked before any compute, owned by one run at a time, and only
ever holding complete files.

- `check_output_dir`: not a file, writable, enough free space for one checkpoint (and the
  export) — found in a second at launch, not after hours at the first save.
- `OutputLock`: an exclusive `flock` on `<output_dir>/.shardwise.lock`, held by the launching
  process for the whole run (the kernel drops it when the process dies, so a crashed run
  never leaves a stale lock). A second run into the same directory is refused with the
  holder's pid and host. flock is local to a machine: on a shared filesystem two nodes can
  both take it, so multi-node jobs take it on global rank 0 only.
- `atomic_dir`: exports are written to `.tmp-<name>` beside the target and renamed when
  complete, so a killed export leaves no directory that looks finished.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardwise import strict_json
from shardwise.errors import ShardwiseError
from shardwise.specs.hardware import GIB
from shardwise.train.checkpoint.directory import checkpoints_dir, step_dirs
from shardwise.train.checkpoint.lineage import lineage_path

LOCK_NAME = ".shardwise.lock"
TMP_PREFIX = ".tmp-"


def checkpoint_bytes(params: int) -> int:
    """One canonical checkpoint: fp32 master weights and AdamW's two fp32 moments."""
    return 12 * params


def size_text(n: float) -> str:
    """Bytes as GiB, or MiB below a tenth of a GiB (where 0.00 GiB would say nothing)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def check_output_dir(output_dir: str | Path, need_bytes: int, where: str = "checkpointing.output_dir",
                     how: str | None = None) -> Path:
    """Create `output_dir` if needed and refuse one that is a file, not writable, or on a
    filesystem with less than `need_bytes` free."""
    d = Path(output_dir)
    if d.exists() and not d.is_dir():
        raise ShardwiseError(f"{where}: {str(d)!r} is a file, not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f"{TMP_PREFIX}write-probe-{os.getpid()}{TMP_SUFFIX}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise ShardwiseError(f"{where}: {str(d)!r} is not writable ({e.strerror or e})") from None
    free = shutil.disk_usage(d).free
    if free < need_bytes:
        raise ShardwiseError(
            f"{where}: {str(d)!r} has {free / GIB:.2f} GiB free; this run needs {need_bytes / GIB:.2f} GiB "
            f"({how or 'checkpoints: fp32 weights + AdamW moments = 12 bytes per parameter, plus the export'}). "
            "Free space, lower checkpointing.keep_last, or choose another directory."
        )
    return d


class OutputLock:
    """Exclusive ownership of an output directory for the life of this process (see module doc)."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ShardwiseError(
                f"checkpointing.output_dir: {str(self.path.parent)!r} is in use by another run ({holder}); "
                "two runs would overwrite each other's checkpoints and exports. Wait for it, or set another "
                "--set checkpointing.output_dir=..."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, strict_json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())  # fmt: skip
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# Every temp entry shardwise creates is named `.tmp-…`; a directory also holds TMP_MARKER and a
# file ends in TMP_SUFFIX. Start-up clean-up removes exactly those, so a user's own `.tmp-thesis/`
# (or `.tmp-notes.txt`) beside the checkpoints survives it.
TMP_MARKER = ".shardwise-tmp"
TMP_SUFFIX = ".shardwise-tmp"


def make_own_tmp_dir(path: Path) -> Path:
    """Create the temp directory `path` (a `.tmp-` name) with the marker that makes it ours."""
    assert path.name.startswith(TMP_PREFIX), path
    path.mkdir()
    (path / TMP_MARKER).touch()
    return path


def fresh_own_tmp_dir(path: Path) -> Path:
    """make_own_tmp_dir, after removing what a killed writer of the same name left there: a
    directory with our marker, or an empty one (killed between its mkdir and the marker: nothing
    in it to lose). Anything else at `path` stays, and the mkdir fails naming it."""
    if is_own_tmp(path) or (path.is_dir() and not path.is_symlink() and not any(path.iterdir())):
        shutil.rmtree(path)
    return make_own_tmp_dir(path)


def publish_own_tmp_dir(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target` (which must not exist), then drop the marker: a kill between the
    two leaves a stray marker file in `target`, never an unmarked `.tmp-` directory that would
    block the next writer of the same name."""
    os.rename(tmp, target)
    (target / TMP_MARKER).unlink(missing_ok=True)


def is_own_tmp(p: Path) -> bool:
    if not p.name.startswith(TMP_PREFIX) or p.is_symlink():
        return False
    if p.is_dir():
        return (p / TMP_MARKER).is_file()
    return p.name.endswith(TMP_SUFFIX)


def remove_own_tmp(d: str | Path) -> list[str]:
    """Remove shardwise's own temp files and directories in `d` (killed saves, exports,
    probes); return their names. Anything else named `.tmp-*` is left alone."""
    d = Path(d)
    removed = []
    for p in sorted(d.glob(TMP_PREFIX + "*")) if d.is_dir() else ():
        if not is_own_tmp(p):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def clean_stale_outputs(output_dir: str | Path) -> list[str]:
    """Remove temp files and directories left by killed exports or saves, in the output dir and
    its `checkpoints/`; return their names."""
    return remove_own_tmp(output_dir) + remove_own_tmp(checkpoints_dir(output_dir))


@contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temp dir beside `target`; on success it replaces `target` in one rename
    (an existing `target` is moved aside first and removed after); on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_own_tmp_dir(target.parent / f"{TMP_PREFIX}{target.name}-{os.getpid()}")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f"{TMP_PREFIX}old-{target.name}-{os.getpid()}"
        os.rename(target, old)
        (old / TMP_MARKER).touch()  # ours now: a kill before the rmtree below leaves it to clean-up
    publish_own_tmp_dir(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- what shardwise wrote, recorded ----------------------------------------------------------

# One record per log name (`.shardwise/own/summary.json.json`, ...): the (device, inode) of each
# file shardwise created under that name. A fresh run deletes a log only when every file of it
# is recorded and is still the same file; anything else there is another tool's (or the user's).
OWN_RECORDS = Path(".shardwise") / "own"


def _record_path(output_dir: str | Path, name: str) -> Path:
    return Path(output_dir) / OWN_RECORDS / f"{name}.json"


def _identities(output_dir: Path, name: str) -> dict[str, list[int]]:
    """(st_dev, st_ino) of `<output_dir>/<name>` (a file) or of each file under it (a directory),
    by path relative to `output_dir`; symlinks are never shardwise's."""
    target = output_dir / name
    if target.is_dir() and not target.is_symlink():
        paths = [f for f in sorted(target.rglob("*")) if f.is_file() or f.is_symlink()]
    else:
        paths = [target] if target.exists() or target.is_symlink() else []
    out = {}
    for f in paths:
        st = f.lstat()
        out[str(f.relative_to(output_dir))] = [-1, -1] if f.is_symlink() else [st.st_dev, st.st_ino]
    return out


def record_own(output_dir: str | Path, name: str, added: list[Path] | None = None) -> None:
    """Record that shardwise wrote `<output_dir>/<name>`: the file as it is now, or, with `added`,
    these files (created by shardwise inside the directory `name`) beside those already recorded.
    A record that cannot be written (a full disk) is skipped: the next fresh run then refuses to
    delete that log, it never deletes one it cannot tell is shardwise's."""
    d = Path(output_dir)
    path = _record_path(d, name)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}{TMP_SUFFIX}")
    try:
        now = _identities(d, name)
        if added is None:
            files = now
        else:
            files = {f: i for f, i in _recorded(d, name).items() if now.get(f) == i}
            mine = {str(Path(a).relative_to(d)) for a in added}
            files |= {f: i for f, i in now.items() if f in mine}
        files = {f: i for f, i in files.items() if i != [-1, -1]}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(strict_json.dumps({"name": name, "files": files}))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def files_under(output_dir: str | Path, name: str) -> set[Path]:
    """The files now under `<output_dir>/<name>` (to tell, later, which ones a writer added)."""
    d = Path(output_dir)
    return {d / f for f in _identities(d, name)}


def _recorded(d: Path, name: str) -> dict[str, list[int]]:
    try:
        files = json.loads(_record_path(d, name).read_text())["files"]
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def foreign(output_dir: str | Path, name: str) -> list[str]:
    """The files at `<output_dir>/<name>` that shardwise's record does not name, or that are no
    longer the file it recorded (replaced, or a symlink): relative paths; [] when all are its own
    or nothing is there."""
    d = Path(output_dir)
    present = _identities(d, name)
    if not present:
        return []
    recorded = _recorded(d, name)
    return [f for f, ident in present.items() if ident == [-1, -1] or recorded.get(f) != ident]


# --- an output directory that an earlier run used -------------------------------------------

# Logs a fresh run rewrites: replaced, and named, when nothing else of the earlier run is there
# and shardwise's record says it wrote them (`record_own`); anything else is never deleted.
EARLIER_LOGS = ("metrics.jsonl", "summary.json", "tensorboard")


def earlier_run_outputs(output_dir: str | Path) -> list[Path]:
    """What an earlier run left that a fresh run would delete or mix with its own: checkpoint
    directories (published or not) and exported models (`model/`, `model-merged/`)."""
    d = Path(output_dir)
    found = [p for _, p in step_dirs(checkpoints_dir(d))]
    for name in ("model", "model-merged"):
        if (d / name).is_dir() and any((d / name).iterdir()):
            found.append(d / name)
    return found


def check_fresh_output(output_dir: str | Path, *, resume: str | None, overwrite: bool, where: str,
                       logs: tuple[str, ...] = EARLIER_LOGS) -> None:
    """A fresh run (no `--resume`) into a directory holding an earlier run's checkpoints or
    exported model is refused, naming them, unless `overwrite` (which `clear_earlier_run` then
    honours): `keep_last` would otherwise delete the new run's checkpoints in favour of the
    old ones' higher steps, `--resume latest` would continue the other run, and the export and
    logs would be mixed. A fresh run is refused, with or without `overwrite`, when one of the
    `logs` it writes (metrics.jsonl, summary.json, and tensorboard/ when that tracker is on) holds
    files shardwise did not write (`foreign`): replacing them would delete another tool's files."""
    if resume is not None:
        return
    others = [f for name in logs for f in foreign(output_dir, name)]
    if others:
        names = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
        raise ShardwiseError(
            f"{where}: {str(output_dir)!r} holds files that shardwise did not write where this run writes its "
            f"logs ({names}); they are not deleted, with or without --overwrite. Move them, or choose another "
            "--set checkpointing.output_dir=...")
    if overwrite:
        return
    found = earlier_run_outputs(output_dir)
    if found:
        names = ", ".join(str(p.relative_to(output_dir)) for p in found[:6]) + (" ..." if len(found) > 6 else "")
        raise ShardwiseError(
            f"{where}: {str(output_dir)!r} holds an earlier run's outputs ({names}); a fresh run would mix with "
            "them. Continue that run with --resume latest, replace it with --overwrite "
            "(checkpointing.overwrite: true; its checkpoints, model and logs are deleted), or choose another "
            "--set checkpointing.output_dir=...")


def clear_earlier_run(output_dir: str | Path, *, overwrite: bool) -> tuple[list[str], list[str]]:
    """Before a fresh run starts (the lock held): with `overwrite`, remove the earlier run's
    checkpoints and exports; in any case the logs shardwise's record says an earlier run wrote
    (metrics.jsonl, summary.json, TensorBoard events, which the new run would otherwise mix with
    its own). Returns (what was removed, the logs left because they hold files shardwise did not
    write: this run does not write them, or `check_fresh_output` would have refused)."""
    d = Path(output_dir)
    gone, left = [], []
    for p in earlier_run_outputs(d) if overwrite else []:
        _remove(p)
        gone.append(str(p.relative_to(d)))
    for name in EARLIER_LOGS:
        p = d / name
        if not (p.exists() or p.is_symlink()):
            continue
        if foreign(d, name):
            left.append(name)
            continue
        _remove(p)
        _record_path(d, name).unlink(missing_ok=True)
        gone.append(name)
    lineage_path(d).unlink(missing_ok=True)
    return gone, left


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()
