"""A checkpoint save that fails fails on every rank alike (shardwise.train.checkpoint.sharded).

Each stage of a save gathers every rank's outcome, so a rank whose write failed never leaves
its peers waiting in the next collective; the failure is then classified once, the same way
on every rank: out of space (ENOSPC/EDQUOT anywhere in any rank's causes, or less free than
the checkpoint needs at the failure, since torch's zip writer reports a full disk as
"unexpected pos" without an errno) or anything else.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.train.outputs import size_text

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def describe(e: BaseException) -> dict[str, Any]:
    """What a rank reports of a failed save: the root causes, one line each (DCP's
    CheckpointException carries every rank's exception and traceback: those, not it)."""
    roots = [x for x in causes(e) if not isinstance(x, CheckpointException) and x.__cause__ is None] or [e]
    text = "; ".join(dict.fromkeys(f"{type(x).__name__}: {str(x).strip().splitlines()[0] if str(x).strip() else ''}"
                                   for x in roots))
    return {"error": text, "errno": getattr(e, "errno", None)}


def space_errno(failures: list[dict[str, Any]], exc: BaseException | None = None) -> bool:
    if any(f and f.get("errno") in SPACE_ERRNOS for f in failures):
        return True
    for inner in causes(exc):
        if getattr(inner, "errno", None) in SPACE_ERRNOS:
            return True
    return False


def causes(exc: BaseException | None) -> list[BaseException]:
    """An exception, its causes and (DCP's CheckpointException) each rank's failure."""
    out, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or e in out:
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP: rank -> (exception, traceback)
        if isinstance(failures, dict):
            for v in failures.values():
                todo += [x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, BaseException)]
    return out


def free_bytes(d: Path) -> int:
    try:
        return shutil.disk_usage(d).free
    except OSError:
        return 0


def raise_save_failure(failures: list[Any], final: Path, need: int, free: int) -> None:
    """The same error on every rank. Out of space when any rank saw ENOSPC/EDQUOT, or when the
    disk had less free than the checkpoint needs at the failure (torch's zip writer reports a
    full disk as "unexpected pos", without an errno)."""
    from shardwise.errors import OutOfSpaceError

    errors = {r: f["error"] for r, f in enumerate(failures) if f}
    if len(set(errors.values())) == 1 and len(errors) == len(failures) > 1:  # DCP's: every rank reports all
        where = [f"every rank: {next(iter(errors.values()))}"]
    else:
        where = [f"rank {r}: {e}" for r, e in errors.items()]
    if space_errno(failures) or free < need:
        raise OutOfSpaceError(
            f"{final}: the save ran out of disk space (it needs about {size_text(need)}, {size_text(free)} were "
            f"free on {final.parent}); the previous checkpoints are intact and this one was removed. Free space "
            f"and --resume latest. ({'; '.join(where)})",
            path=str(final), need_bytes=need, free_bytes=free)
    raise RuntimeError(f"{final}: the save failed, the previous checkpoints are intact: {'; '.join(where)}")
