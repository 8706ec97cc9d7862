"""Where the end-of-run export (`checkpointing.save_final`) reads the final weights: a DCP
directory, never one process's memory.

The run's checkpoint of its last step when it saved one (the default: `save_every_minutes`),
else the engine's canonical `model.*` tensors written by every rank into a temp directory
beside the checkpoints (`dcp.save`: each rank its shards, a replicated tensor once; no AdamW
moments, no manifest, not a checkpoint of the lineage). Rank 0 then writes the Hugging Face
directory from it as `shardwise export` does, one shard at a time (shardwise.train.export.hf_dir), and
removes the temp directory; the other ranks have nothing left to do (no collective follows).
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
from shardwise.train.checkpoint.save_failure import describe, free_bytes, gather, space_errno

STAGED = ".tmp-final-weights"  # a shardwise temp directory (marker inside): start-up clean-up removes a stray one


@dataclass(frozen=True)
class FinalWeights:
    path: Path  # a DCP directory holding the final `model.<fqn>` tensors (the master dtype)
    temporary: bool  # staged for the export only: removed once it is written

    def discard(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
            with contextlib.suppress(OSError):  # checkpoints/, when staging created it for nothing else
                self.path.parent.rmdir()


def final_weights(engine: Any, output_dir: str | Path, step: int, checkpoint: Path | None) -> FinalWeights:
    """The final weights as a DCP directory (collective: every rank calls it). `checkpoint` is
    the last one this run published; when it is the step-`step` one it holds them already."""
    if checkpoint is not None and checkpoint.name == step_dir_name(step):
        return FinalWeights(checkpoint, temporary=False)
    return FinalWeights(stage(engine, checkpoints_dir(output_dir) / STAGED), temporary=True)


def stage(engine: Any, path: Path) -> Path:
    """Write the engine's `model.*` canonical tensors to `path` with DCP. FSDP2 and DDP hand over
    their live tensors (no copy); DeepSpeed assembles its share as for a checkpoint. Every rank's
    outcome is gathered, so a failure (out of space: OutOfSpaceError, exit 74) is every rank's."""
    from shardwise.errors import OutOfSpaceError
    from shardwise.train.outputs import fresh_own_tmp_dir, size_text

    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors, _ = engine.checkpoint_state()
    weights = {k: v for k, v in tensors.items() if k.startswith("model.")}
    del tensors
    # every tensor's full size once (a DTensor's numel is the global one; DCP writes a replica once)
    need = sum({k: n for held in gather({k: int(t.numel()) * t.element_size() for k, t in weights.items()})
                for k, n in held.items()}.values())
    failure = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fresh_own_tmp_dir(path)
        except OSError as e:
            failure = describe(e)
    if not any(gather(failure)):
        try:
            dcp.save(weights, storage_writer=FileSystemWriter(str(path), single_file_per_rank=True),
                     no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP's (a BaseException) is raised on every rank alike
            failure = describe(e)
    failures = gather(failure)
    if not any(failures):
        return path
    free = gather(free_bytes(path.parent) if rank == 0 else 0)[0]
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    errors = "; ".join(f"rank {r}: {f['error']}" for r, f in enumerate(failures) if f)
    what = f"{path}: writing the final weights for the export failed ({errors}); nothing was exported"
    if space_errno(failures) or free < need:
        raise OutOfSpaceError(f"{what}: out of disk space ({size_text(need)} to write, {size_text(free)} free)",
                              path=str(path), need_bytes=need, free_bytes=free)
    raise RuntimeError(what)

