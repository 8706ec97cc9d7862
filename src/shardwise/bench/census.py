"""Per-rank tensor census: the bytes a wrapped model + optimizer actually hold, by category.

Every tensor is reduced to its *storage* (an untyped byte buffer) and a storage is counted
once, at its full size, in the first category that claims it. Claim order (CATEGORIES):

  params           the module's parameters as they exist on this rank: full tensors (DDP,
                   ZeRO-0/1/2, where they are views into DeepSpeed's flat `bit16_groups_flat`
                   so the flat buffer and its alignment padding are counted whole),
                   ZeRO-3 `param.ds_tensor` partitions (views into `lp_param_buffer` /
                   `fp16_partitioned_groups_flat`) plus whatever `param.data` still holds
                   (persistent params under `stage3_param_persistence_threshold`), and
                   FSDP2 DTensor `_local_tensor` shards.
  grads            `param.grad` (DTensor: its local shard), `param.grad_accum` (ZeRO-1/2
                   when `use_grad_accum_attribute`), and DeepSpeed's gradient partitions:
                   stage 1/2 `averaged_gradients`, `grads_in_partition`, `all_grad_tensors`
                   (stage_1_and_2.py: independent_gradient_partition_epilogue,
                   copy_grads_in_partition); stage 3 `grad_partitions_flat_buffer`,
                   `__param_id_to_grad_partition`, `averaged_gradients` (stage3.py
                   `_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition`).
  master_params    DeepSpeed fp32 partitions: stage 1/2 `single_partition_of_fp32_groups`,
                   stage 3 `fp32_partitioned_groups_flat`. (If a config makes the master the
                   same storage as the params, `params` claims it first and master reads 0.)
  optimizer_states the inner torch optimizer's `state` tensors (exp_avg, exp_avg_sq, step).
  other            every remaining tensor reachable from the engine / optimizer / module
                   object graph (IPG buckets, flat buffers, module buffers such as RoPE's
                   inv_freq), and with `gc_sweep` every other live tensor in the process —
                   minus the storages passed in `exclude` (the input batch).

Params are claimed before grads on purpose: when a gradient buffer aliases a parameter
buffer (it should not), the bytes exist once and the planner should count them once.
"""

from __future__ import annotations

import gc
import types
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.bench import CATEGORIES

# DeepSpeed attributes (on the ZeRO optimizer object) read per category; names as of 0.19.
_DS_GRAD_ATTRS = (
    "averaged_gradients",
    "grads_in_partition",
    "all_grad_tensors",
    "grad_partitions_flat_buffer",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
)
_DS_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_DS_PARAM_ATTRS = ("bit16_groups_flat", "lp_param_buffer", "fp16_partitioned_groups_flat")

# The object-graph walk only descends into objects of these libraries (and containers),
# so it stays inside the engine and does not wander through all of torch's module globals.
_WALK_MODULE_PREFIXES = ("deepspeed", "torch", "transformers", "shardwise")
_MAX_DEPTH = 24


@dataclass
class Census:
    """Bytes by category on this rank, and which storages made them up (for diagnosis)."""

    bytes: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CATEGORIES})
    items: dict[str, list[tuple[str, int]]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})

    @property
    def model_states(self) -> int:
        b = self.bytes
        return b["params"] + b["grads"] + b["master_params"] + b["optimizer_states"]

    def top(self, category: str, n: int = 8) -> list[tuple[str, int]]:
        return sorted(self.items[category], key=lambda x: -x[1])[:n]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's bytes live in its `_local_tensor`, a functional collective's result
    (AsyncCollectiveTensor, under tensor parallelism) in its `elem`; other tensors are their own
    storage."""
    for attr in ("_local_tensor", "elem"):
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor) and inner is not t:
            return _local(inner)
    return t


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data_ptr, nbytes) of the tensor's storage; None for empty or storage-less tensors."""
    t = _local(t)
    if t.device.type == "meta":
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. wrapper subclasses without storage
        return None
    n = st.nbytes()
    if n == 0:
        return None
    return st.data_ptr(), n


def iter_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors inside nested lists/tuples/dicts (the shapes DeepSpeed keeps its groups in)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}[{i}]")


class _Claims:
    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self.owner: dict[int, str] = {}
        self.census = Census()
        for t in exclude:
            if not isinstance(t, torch.Tensor):  # a packed batch also carries plain numbers (max_seqlen)
                continue
            k = storage_key(t)
            if k:
                self.owner[k[0]] = "excluded"

    def claim(self, category: str, path: str, t: torch.Tensor) -> None:
        k = storage_key(t)
        if k is None or k[0] in self.owner:
            return
        self.owner[k[0]] = category
        self.census.bytes[category] += k[1]
        self.census.items[category].append((path, k[1]))


def _param_parts(p: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield "", p
    ds = getattr(p, "ds_tensor", None)  # ZeRO-3 partition (partition_parameters.py)
    if isinstance(ds, torch.Tensor):
        yield ".ds_tensor", ds


def _grad_parts(p: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if p.grad is not None:
        yield ".grad", p.grad
    acc = getattr(p, "grad_accum", None)
    if isinstance(acc, torch.Tensor):
        yield ".grad_accum", acc


def _walkable(obj: Any) -> bool:
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
        return False
    mod = type(obj).__module__ or ""
    return mod.startswith(_WALK_MODULE_PREFIXES)


def _key(k: Any) -> str:
    """A dict key in a path: repr of a plain key; type and id of anything else (DeepSpeed keys
    dicts by parameter, and a tensor's repr formats its values)."""
    return repr(k) if isinstance(k, (str, int, float, bool, type(None))) else f"<{type(k).__name__} {id(k):#x}>"


def walk_graph(roots: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Breadth-first over attributes/containers from `roots`, yielding every tensor reached."""
    seen: set[int] = set()
    queue: deque[tuple[Any, str, int]] = deque((obj, name, 0) for name, obj in roots.items())
    while queue:
        obj, path, depth = queue.popleft()
        if id(obj) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield path, obj
            if obj.is_leaf and obj.grad is not None:
                queue.append((obj.grad, path + ".grad", depth + 1))
            children: Iterable[tuple[str, Any]] = getattr(obj, "__dict__", {}).items()
        elif isinstance(obj, dict):
            children = ((f"[{_key(k)}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            children = ((f"[{i}]", v) for i, v in enumerate(obj))
        elif _walkable(obj):
            d = dict(getattr(obj, "__dict__", {}) or {})
            for s in getattr(type(obj), "__slots__", ()) or ():
                if hasattr(obj, s):
                    d[s] = getattr(obj, s)
            children = d.items()
        else:
            continue
        for k, v in children:
            if isinstance(v, (str, bytes, int, float, bool, type(None))):
                continue
            sep = "" if k.startswith("[") else "."
            queue.append((v, f"{path}{sep}{k}", depth + 1))


def take_census(
    module: torch.nn.Module,
    optimizer: Any,
    engine: Any | None = None,
    exclude: Iterable[torch.Tensor] = (),
    gc_sweep: bool = True,
) -> Census:
    """Census of this rank. `optimizer` is the ZeRO optimizer for DeepSpeed (engine.optimizer)
    or the torch optimizer; its inner torch optimizer (`.optimizer`) holds the Adam state."""
    gc.collect()
    c = _Claims(exclude)
    named = list(module.named_parameters())

    # params, then grads: what the module's parameters hold, then the DeepSpeed partitions
    for part, parts_of, attrs in (("params", _param_parts, _DS_PARAM_ATTRS), ("grads", _grad_parts, _DS_GRAD_ATTRS)):
        for name, p in named:
            for suffix, t in parts_of(p):
                c.claim(part, name + suffix, t)
        for attr in attrs:
            for path, t in iter_tensors(getattr(optimizer, attr, None), f"optimizer.{attr}"):
                c.claim(part, path, t)

    for attr in _DS_MASTER_ATTRS:
        for path, t in iter_tensors(getattr(optimizer, attr, None), f"optimizer.{attr}"):
            c.claim("master_params", path, t)

    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and getattr(inner, "optimizer", None) is not None:
        inner = inner.optimizer  # DeepSpeed's ZeRO optimizer wraps the basic torch optimizer
    if isinstance(inner, torch.optim.Optimizer):
        for i, st in enumerate(inner.state.values()):
            for path, t in iter_tensors(st, f"optimizer.state[{i}]"):
                c.claim("optimizer_states", path, t)

    roots = {"engine": engine, "optimizer": optimizer, "module": module}
    for path, t in walk_graph({k: v for k, v in roots.items() if v is not None}):
        c.claim("other", path, t)
    if gc_sweep:
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                c.claim("other", f"<gc {tuple(obj.shape)} {obj.dtype}>", obj)
    return c.census
