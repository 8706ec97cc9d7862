"""Count the bytes an engine hands to collectives, per kind, in the calling process.

`CommCounter` is a TorchDispatchMode: every `torch.distributed` collective, whether issued
from Python (torch.distributed, deepspeed.comm, FSDP2) or from C++ (the DDP reducer calls
`c10d::allreduce_` through the dispatcher), reaches the dispatcher as a `c10d::*` op with
its real tensors, so the mode sees what the engine ASKS for. That is deliberately not wire
traffic: gloo, for one, runs `reduce_scatter_tensor` as a full all-reduce internally.

Counting unit (shared with shardwise.plan.comm):
  all_reduce     bytes of the tensor(s) all-reduced
  all_gather     bytes of the gathered OUTPUT (full size)
  reduce_scatter bytes of the INPUT (full size)
  reduce         bytes of the tensor reduced to one rank (ring cost ≈ a reduce-scatter)
  broadcast      bytes of the tensor broadcast
  p2p            bytes sent plus bytes received
  all_to_all     bytes of the input sent
  gather/scatter bytes of the full (gathered / scattered) side
Barriers carry a dummy tensor and are ignored. `one_rank_groups=False` also leaves out the
collectives over a group of one rank (they move nothing; DeepSpeed still reduces its gradients
over a one-rank data-parallel group when AutoTP spans every rank).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "p2p", "all_to_all",
         "gather", "scatter")


def _tensors(x: Any) -> Iterable[torch.Tensor]:
    """Every tensor in a (nested) list/tuple argument."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


# op name (without overload) -> (kind, index of the argument whose bytes are counted)
# Arg positions follow torch/csrc/distributed/c10d/Ops.cpp (torch 2.13).
_C10D: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),  # output_tensors: list[list[Tensor]], the world's copies
    "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),  # input_tensors: list[list[Tensor]]
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_": ("reduce", 0),
    "broadcast_": ("broadcast", 0),
    "send": ("p2p", 0),
    "recv_": ("p2p", 0),
    "recv_any_source_": ("p2p", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "gather_": ("gather", 0),
    "scatter_": ("scatter", 1),
}
# Functional collectives (torch.distributed._functional_collectives): these return new
# tensors, so the full-size side is the input for reduce-scatter and the output for all-gather.
_FUNCTIONAL: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "in"),
    "all_reduce_": ("all_reduce", "in"),
    "all_reduce_coalesced": ("all_reduce", "in"),
    "all_reduce_coalesced_": ("all_reduce", "in"),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in"),
    "all_to_all_single": ("all_to_all", "in"),
    "broadcast": ("broadcast", "in"),
    "broadcast_": ("broadcast", "in"),
}


def _group_size(args: tuple) -> int | None:
    """Ranks in the process group a c10d op runs on (its ProcessGroup argument), None if unseen."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return torch._C._distributed_c10d.ProcessGroup.unbox(a).size()
            except (AttributeError, RuntimeError, TypeError):
                return None
    return None


@dataclass
class CommCounts:
    """Bytes, call counts and dtypes per collective kind, plus a per-call log if asked."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dtypes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    bytes_by_dtype: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    log: list[tuple[str, str, int]] | None = None  # (op, kind, bytes) per call

    def add(self, op: str, kind: str, payload: Any) -> None:
        n = _nbytes(payload)
        self.bytes[kind] += n
        self.calls[kind] += 1
        for t in _tensors(payload):
            dt = str(t.dtype).removeprefix("torch.")
            self.dtypes[kind].add(dt)
            self.bytes_by_dtype[kind][dt] += t.numel() * t.element_size()
        if self.log is not None:
            self.log.append((op, kind, n))

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes": dict(self.bytes),
            "calls": dict(self.calls),
            "dtypes": {k: sorted(v) for k, v in self.dtypes.items()},
            "bytes_by_dtype": {k: dict(v) for k, v in self.bytes_by_dtype.items()},
        }


class CommCounter(TorchDispatchMode):
    """`with CommCounter() as c: ...` then read `c.counts`. Set `enabled=False` to pause
    counting without leaving the mode (e.g. around steps that should not be measured)."""

    def __init__(self, keep_log: bool = False, one_rank_groups: bool = True) -> None:
        super().__init__()
        self.one_rank_groups = one_rank_groups  # False: leave out collectives over a group of one rank
        self.counts = CommCounts(log=[] if keep_log else None)
        self.enabled = True

    def reset(self, keep_log: bool = False) -> None:
        self.counts = CommCounts(log=[] if keep_log else None)

    def __torch_dispatch__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.enabled:
            ns = func.namespace
            name = func._schema.name.split("::", 1)[1]
            if ns == "c10d" and name in _C10D and not self.one_rank_groups and _group_size(args) == 1:
                pass  # a group of one rank moves nothing (DeepSpeed reduces over its 1-rank DP group under TP)
            elif ns == "c10d" and name in _C10D:
                kind, idx = _C10D[name]
                self.counts.add(name, kind, args[idx] if idx < len(args) else None)
            elif ns == "_c10d_functional" and name in _FUNCTIONAL:
                kind, side = _FUNCTIONAL[name]
                self.counts.add(name, kind, args[0] if side == "in" else out)
        return out
