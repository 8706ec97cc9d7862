"""glibc's malloc on the ranks' host: large blocks mapped and unmapped whole, so freed memory
goes back to the system instead of staying in the heap as holes.

glibc serves an allocation below its mmap threshold from the heap, and its dynamic threshold
rises to 32 MiB after the first large frees. Tensors freed and allocated again at every layer
(the parameters FSDP2 or ZeRO-3 gathers and frees per layer, the full tensors `zero.Init` builds
and partitions per module) then leave holes that small long-lived allocations (the activations
saved for backward) split, so the next layer's tensor of the same size no longer fits and the
heap grows by about a layer per layer: most of the unsharded model per rank, free but never
returned (docs/training.md has the measurements). With the threshold fixed at the memory
model's `mmap_threshold_bytes` (catalog/memory.yaml, which the planner's heap term reads too),
every tensor from 1 MiB up is its own mapping, returned when it is freed. No-op off glibc
(macOS, musl); device memory is torch's own allocator's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from shardwise.catalog import memory_model

# glibc's dynamic maximum (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), set back when the outermost
# context exits.
DEFAULT_MMAP_THRESHOLD = 32 << 20
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_depth = 0


@contextlib.contextmanager
def large_allocations_returned() -> Iterator[None]:
    """glibc's mmap threshold (M_MMAP_THRESHOLD: bytes from which it maps an allocation on its
    own) fixed at the memory model's `mmap_threshold_bytes` inside (re-entrant: the outermost
    context sets and restores it)."""
    global _depth
    mallopt = _mallopt() if _depth == 0 else None
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, memory_model().mmap_threshold_bytes)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if mallopt is not None:
            mallopt(_M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD)


def _mallopt() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return getattr(libc, "mallopt", None) if libc is not None and hasattr(libc, "gnu_get_libc_version") else None
