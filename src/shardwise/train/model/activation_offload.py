"""Activation offloading (`checkpointing.offload`): the tensors a micro-batch's forward saves for
backward are copied to host memory as they are saved and copied back when backward reads them,
through `torch.autograd.graph.saved_tensors_hooks` (as torchtune's `OffloadActivations` and
torch's `save_on_cpu` do; why not those: docs/architecture.md, "Library or hand-written").

`offloaded(model, device, train)` is opened around the model call of every engine's forward
(engines.base.forward_loss_sum); a saved tensor keeps the unpack hook it was packed with, so the
engine's backward, wherever it runs, brings the tensors back.

What moves: each storage that a saved tensor on the compute device views, of at least
MIN_BYTES, copied once per forward however many saved tensors view it (the q, k and v
projections' views of one normed input; every layer's view of the rotary cos and sin), as long
as the saved tensor is not a parameter, a view of one, a cast of one (autocast's cached weight
copies) or a leaf that gets a gradient. DTensors (tensor parallelism) move their local tensor
and are rebuilt around it. What stays: those; what the last decoder layer saves (backward reads
it first: moving it would only make backward wait for its copy back; one layer's saved set on
the device, as the planner books it, plan.activations.offload_kept); and what the output layer
saves (lm_head's input, as torchtune keeps its output layer; the chunked loss's LossHead saves
nothing through hooks, its gradients are on its autograd context). The standard loss
(`token_loss_sum`) runs after the model call, outside the hooks. With activation checkpointing
each checkpointed layer saves only its inputs under these hooks (torch's checkpoint saves them
before it pushes its own hooks, which then keep the layer's inner tensors as recompute
placeholders; docs/training.md).

CUDA: each storage is copied into pinned host memory on a side stream once the compute stream
has produced it; the device tensor is kept alive until that copy's event has completed, at most
MAX_IN_FLIGHT at once (then the compute stream waits for the oldest copy before it reuses the
memory; no host sync): the copies overlap the forward's compute. Backward copies each storage
back on the side stream, which the compute stream waits for; the copy is marked as used by the
compute stream (record_stream). CPU: a synchronous copy out and back, so the path runs and is
tested on CPU ranks, saving nothing there (host memory is the compute device's memory).

Counted per model (`stats`): the bytes moved out in the last micro-batch and the peak of bytes
held on the host at once (a host copy is freed when autograd frees the saved tensors packed
onto it), and their largest values over the run; `process_totals` for the run's summary.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

MIN_BYTES = 1024  # below this a copy costs more than it saves (torchtune's min_offload_size)
MAX_IN_FLIGHT = 5  # CUDA: device tensors kept alive while their copy runs (torchtune's max_fwd_stash_size)


@dataclass
class OffloadStats:
    micro_batches: int = 0  # forward passes run under the hooks
    last_bytes: int = 0  # bytes moved to the host by the last micro-batch's forward
    last_peak_bytes: int = 0  # the most bytes held on the host at once during the last micro-batch
    max_bytes: int = 0  # the largest `last_bytes` of the run
    max_peak_bytes: int = 0  # the largest `last_peak_bytes` of the run
    host_bytes: int = 0  # held on the host now (saved tensors autograd has not freed yet)


class _Stored:
    """One device storage moved to the host: every saved tensor viewing it (the q, k and v
    projections' views of one normed input, each layer's view of the rotary cos and sin) is
    rebuilt from this one copy, as it was one storage on the device. Backward brings it back
    once, for all of them; the device copy is dropped here when the last view has been handed
    back (autograd's own references keep it while its nodes need it)."""

    __slots__ = ("__weakref__", "device", "host", "on_device", "version", "views")

    def __init__(self, host: torch.Tensor, device: torch.device, version: int):
        self.host, self.device, self.version = host, device, version
        self.views = 0  # saved tensors packed onto this storage, not yet unpacked
        self.on_device: torch.Tensor | None = None


class _View:
    """What a pack hook returns for an offloaded tensor: where it lies in its storage's copy, and
    for a DTensor (tensor parallelism) its mesh, placements and global shape, around that local
    tensor."""

    __slots__ = ("dtensor", "dtype", "offset", "size", "stored", "stride")

    def __init__(self, stored: _Stored, t: torch.Tensor, dtensor: tuple[Any, ...] | None):
        self.stored, self.dtype = stored, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()
        self.dtensor = dtensor


def _bytes_of(storage: Any, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class ActivationOffloader:
    """The pack/unpack hooks of one model on one compute device, and what they moved."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.stats = OffloadStats()
        _ALL_STATS.append(self.stats)
        self._active = False
        self._kept = 0  # > 0 inside the last decoder layer or the output layer: nothing moves
        # this forward's storages already on the host: id(storage) -> (weakref to it, its copies)
        self._seen: dict[int, tuple[weakref.ref, list[_Stored]]] = {}
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self._in_flight: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        for module in _kept_modules(model):
            module.register_forward_pre_hook(self._enter_kept)
            module.register_forward_hook(self._leave_kept)

    def _enter_kept(self, *_: Any) -> None:
        if self._active:
            self._kept += 1

    def _leave_kept(self, *_: Any) -> None:
        if self._active and self._kept:
            self._kept -= 1

    # ------------------------------------------------------------------ one forward
    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around one micro-batch's forward (its backward brings the tensors back)."""
        s = self.stats
        s.micro_batches += 1
        s.last_bytes, s.last_peak_bytes = 0, s.host_bytes
        self._active, self._kept = True, 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active, self._kept = False, 0  # (a forward that raised left its module unbalanced)
            self._seen.clear()
            if self.cuda:  # the last layer's compute has covered the copies: the compute stream waits (no host sync)
                self._drain(torch.cuda.current_stream(self.device))
            s.max_bytes = max(s.max_bytes, s.last_bytes)
            s.max_peak_bytes = max(s.max_peak_bytes, s.last_peak_bytes)

    def _moves(self, t: torch.Tensor) -> bool:
        if self._kept or t.device != self.device or type(t) not in (torch.Tensor, self._dtensor):
            return False  # tensor subclasses other than DTensor (an NF4 weight, a collective's future) stay
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return False  # a weight (a DTensor parameter is of type DTensor), or a view of one (weight.t())
        if t.is_leaf and t.requires_grad:
            return False  # a leaf that gets a gradient
        fn = t.grad_fn
        # a cast of a weight (autocast's cached copy): as long-lived as the weight, not an activation
        return not (fn is not None and type(fn).__name__ == "ToCopyBackward0"
                    and any(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None))

    def _pack(self, saved: torch.Tensor) -> Any:
        if not self._moves(saved):
            return saved
        t, dtensor = saved, None
        if type(saved) is self._dtensor:  # its local tensor moves; the DTensor is rebuilt around it
            with torch.no_grad():
                t = saved.to_local()
            if type(t) is not torch.Tensor:
                return saved
            dtensor = (saved.device_mesh, saved.placements, saved.shape, saved.stride())
        storage = t.untyped_storage()
        if storage.nbytes() < MIN_BYTES:
            return saved
        ref, copies = self._seen.get(id(storage), (None, []))
        if ref is None or ref() is not storage:
            ref, copies = weakref.ref(storage), []
            self._seen[id(storage)] = (ref, copies)
        stored = next((c for c in copies if c.version == t._version), None)
        if stored is None:  # first saved view of this storage (in this state): copy all of it once
            src = _bytes_of(storage, t.device)
            if self.cuda:
                host = self._copy_out(t, src)
            else:
                host = torch.empty_like(src, device="cpu")
                host.copy_(src)
            stored = _Stored(host, t.device, t._version)
            copies.append(stored)
            nbytes = src.numel()
            s = self.stats
            s.last_bytes += nbytes
            s.host_bytes += nbytes
            s.last_peak_bytes = max(s.last_peak_bytes, s.host_bytes)
            weakref.finalize(stored, _freed, s, nbytes)
        stored.views += 1
        return _View(stored, t, dtensor)

    def _copy_out(self, t: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        while self._in_flight and (len(self._in_flight) >= MAX_IN_FLIGHT or self._in_flight[0][1].query()):
            _, done = self._in_flight.popleft()
            compute.wait_event(done)  # the compute stream reuses the block only after the copy read it
        self.stream.wait_stream(compute)  # the copy starts once the compute stream has produced `t`
        with torch.cuda.stream(self.stream):
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)  # torch's caching host allocator
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._in_flight.append((t, event))
        return host

    def _drain(self, compute: Any) -> None:
        """Drop the device tensors of every copy out; the compute stream waits for those copies
        before it runs anything queued after this (what reuses their memory)."""
        while self._in_flight:
            _, done = self._in_flight.popleft()
            compute.wait_event(done)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _View):
            return packed
        stored = packed.stored
        flat = stored.on_device
        if flat is None:
            flat = self._copy_in(stored)
        stored.views -= 1
        stored.on_device = flat if stored.views > 0 else None
        out = torch.empty(0, dtype=packed.dtype, device=stored.device).set_(
            flat.untyped_storage(), packed.offset, packed.size, packed.stride)
        if packed.dtensor is None:
            return out
        mesh, placements, shape, stride = packed.dtensor
        with torch.no_grad():  # a wrapper around the local tensor: no collective, no autograd node
            return self._dtensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _copy_in(self, stored: _Stored) -> torch.Tensor:
        if not self.cuda:
            flat = torch.empty_like(stored.host, device=stored.device)
            flat.copy_(stored.host)
            return flat
        compute = torch.cuda.current_stream(stored.device)
        self._drain(compute)
        with torch.cuda.stream(self.stream):  # after this storage's copy out (same stream)
            flat = stored.host.to(stored.device, non_blocking=True)
        compute.wait_stream(self.stream)
        flat.record_stream(compute)  # allocated on the side stream, read on the compute stream
        return flat


def _freed(stats: OffloadStats, nbytes: int) -> None:
    stats.host_bytes -= nbytes


def _kept_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Whose saved tensors stay on the device: the last decoder layer (backward's first, as the
    planner keeps one layer's saved set: plan.activations.offload_kept) and the output layer(s),
    lm_head or its LossHead, and the trainable copies under PEFT's `modules_to_save`."""
    from shardwise.errors import ShardwiseError
    from shardwise.train.model.hf import decoder_layers

    try:
        out = decoder_layers(model)[-1:]
    except ShardwiseError:
        out = []
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None:
        copies = getattr(head, "modules_to_save", None)
        out += [head, *(copies.values() if copies is not None else ())]
    return out


_OFFLOADERS: weakref.WeakKeyDictionary[torch.nn.Module, ActivationOffloader] = weakref.WeakKeyDictionary()
_ALL_STATS: list[OffloadStats] = []  # every offloader's counts, kept past its model (the run's summary)


def offloader(model: torch.nn.Module, device: torch.device) -> ActivationOffloader:
    """The offloader of `model` (the unwrapped HF CausalLM an engine trains), made on first use."""
    found = _OFFLOADERS.get(model)
    if found is None or found.device != device:
        found = _OFFLOADERS[model] = ActivationOffloader(model, device)
    return found


def stats(model: torch.nn.Module) -> OffloadStats | None:
    """What `model`'s offloader moved (None: it never ran)."""
    found = _OFFLOADERS.get(model)
    return found.stats if found is not None else None


def process_totals() -> dict[str, int] | None:
    """The largest per-micro-batch counts of every offloader of this process (None: none ran)."""
    found = [s for s in _ALL_STATS if s.micro_batches]
    if not found:
        return None
    return {"micro_batches": sum(s.micro_batches for s in found),
            "bytes_per_micro_batch": max(s.max_bytes for s in found),
            "peak_host_bytes": max(s.max_peak_bytes for s in found)}


def offloaded(model: torch.nn.Module, device: torch.device, train: Any) -> contextlib.AbstractContextManager[Any]:
    """Around a model call: the offloading hooks where `train.activation_offload` and grad mode
    are on (an evaluation saves nothing), else nothing."""
    if not (getattr(train, "activation_offload", False) and torch.is_grad_enabled()):
        return contextlib.nullcontext()
    return offloader(model, device).forward()
