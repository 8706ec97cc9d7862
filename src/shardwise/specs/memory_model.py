"""The memory model's constants as one frozen value, each with where it comes from.

`plan/memory.py`, `plan/load.py` and `plan/host_cpu.py` count what the engines and the trainer
allocate from the model, the run and the hardware; what they cannot count (the CUDA context, an
NCCL communicator, the caching allocator's slack, a rank's interpreter and libraries, glibc's
heap, the files a checkpoint comes in) lives here, not in module globals. The bundled value is
`catalog/memory.yaml` (`catalog.memory_model()`); each constant's `Provenance` says whether it
is fitted (on which cases), measured (how and where), derived (from what) or assumed (a citation,
or why), as the time model's do (specs/timing_model.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardwise.specs.timing_model import Constants

Start = Literal["exec", "fork"]
Library = Literal["torch", "deepspeed"]


class MemoryModel(Constants):
    """What the memory plan needs beyond the specs. Bytes, unless the name says otherwise."""

    # the GPU outside the allocator's live bytes: the CUDA context of one process, one NCCL
    # communicator per process group of size > 1
    cuda_context_bytes: float = Field(ge=0)
    nccl_per_group_bytes: float = Field(ge=0)
    # the caching allocator's splitting/rounding slack: this fraction of the larger phase's transients
    allocator_slack: float = Field(ge=0, le=1)
    # the fraction of GPU memory kept free when deciding "fits" (`plan --margin`'s default)
    default_margin: float = Field(ge=0, lt=1)
    # DeepSpeed ZeRO-3's optimizer sub-group, elements
    sub_group_size: int = Field(gt=0)
    # a rank's host RSS before it builds anything, by how it started (exec'd; forked from its
    # launcher) and its engine's libraries (torch; DeepSpeed besides); what CUDA adds to it
    process_exec_torch_bytes: float = Field(gt=0)
    process_exec_deepspeed_bytes: float = Field(gt=0)
    process_fork_torch_bytes: float = Field(gt=0)
    process_fork_deepspeed_bytes: float = Field(gt=0)
    cuda_runtime_bytes: float = Field(ge=0)
    # the launcher (`shardwise train`), one per node
    launcher_bytes: float = Field(ge=0)
    # the checkpoint when there is none to read sizes from: the largest file, bytes per element
    default_file_bytes: float = Field(gt=0)
    checkpoint_element_bytes: float = Field(gt=0)
    # glibc's heap on a rank: the mmap threshold the trainer holds, what the heap keeps free after a step
    mmap_threshold_bytes: int = Field(gt=0)
    heap_floor_bytes: float = Field(ge=0)
    def process_bytes(self, start: Start, library: Library) -> float:
        """A rank's interpreter and libraries on the host (CPU build), `start`ed by exec or fork,
        with torch's `library` set or DeepSpeed's besides."""
        return getattr(self, f"process_{start}_{library}_bytes")

