"""The memory vocabulary shared by the planner, the trainer's summary and the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes per GPU, by part, and the step's peak as the max over its phases.

    Model states (what a per-rank tensor census sees after backward): params, grads,
    master_params, optimizer_states. Transient parts, by the phase they live in:

    - engine_buffers: resident in every phase (DeepSpeed ZeRO-3's reduce bucket, DDP's
      bucket copy without `gradient_as_bucket_view`).
    - gathered_params: forward and backward only (FSDP2's unsharded layers and root, the
      parameters ZeRO-3 keeps gathered from forward to backward).
    - held_grads: forward and backward, gradients carried between the micro-batches of one
      step outside `grads` (FSDP2's unsharded grads in reduce_dtype while sync is off).
    - activations (saved for backward, peak at the end of forward), logits (the loss's peak),
      recompute (one layer re-materialised in backward), grad_buffers (backward only: reduce
      buckets, a layer's unsharded grads and their reduce copy, lm_head's unsharded grad).
    - step_buffers: end of backward and the optimizer step only (DeepSpeed's fp32 gradient
      partition, the optimizer's temporaries by implementation, FSDP2's root reduce-scatter).

    - ref_params: a preference objective's frozen reference model (plan/preference.py),
      resident in every phase; ref_forward: its no-grad forward's transient (its logits beside
      the policy's, its gathered weights where sharded), at the end of forward with the saved
      activations, before the loss's backward.

    grads_persist: the gradient storage is live in every phase (DDP's buckets, which the
    grads alias; ZeRO-3's flat gradient partition; accumulation into sharded grads).

    Outside the allocator's live bytes: cuda_context and nccl (not PyTorch allocations) and
    allocator_slack (reserved − allocated, the caching allocator's cached-but-free blocks), of
    which allocator_unreclaimable is what a cache flush cannot return (free blocks inside segments
    that still hold live ones); the rest is cache the allocator frees and retries with before it
    raises out-of-memory.
    """

    params: float = 0.0
    grads: float = 0.0
    master_params: float = 0.0
    optimizer_states: float = 0.0
    step_buffers: float = 0.0
    activations: float = 0.0
    recompute: float = 0.0
    logits: float = 0.0
    engine_buffers: float = 0.0
    gathered_params: float = 0.0
    held_grads: float = 0.0
    grad_buffers: float = 0.0
    cuda_context: float = 0.0
    nccl: float = 0.0
    allocator_slack: float = 0.0
    allocator_unreclaimable: float = 0.0  # of allocator_slack: not returned by a cache flush
    ref_params: float = 0.0
    ref_forward: float = 0.0
    grads_persist: bool = False
    # Of `grads`, the bytes not yet produced at the end-of-backward peak (FSDP2: the first
    # layer's and the root group's shards, reduce-scattered last); not a term of its own
    grads_pending: float = 0.0
    # Of `gathered_params` (backward's), the bytes not gathered while the loss runs: nothing is
    # prefetched yet, and units that reshard after forward are gathered again as backward starts
    # (FSDP2: plan.stage.fsdp_gathered_at_loss); not a term of its own
    gathered_free_at_loss: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.master_params + self.optimizer_states

    @property
    def resident(self) -> float:
        """Allocated in every phase: the weights and optimizer states, the engines' resident
        buffers, a reference model."""
        return self.params + self.master_params + self.optimizer_states + self.engine_buffers + self.ref_params

    @property
    def phases(self) -> dict[str, float]:
        """Allocated bytes at the peak of each phase (terms that never coexist are not summed).

        forward: the end of forward through the loss and the backward of the last layers. The
        loss's peak (logits) is over before backward reaches the layers, where a recomputed
        layer and the gradient buffers live: max(logits, recompute + grad_buffers); what
        backward gathers and the loss does not hold (`gathered_free_at_loss`: the prefetched
        unit, units resharded after forward) counts with the second only.
        backward: the end of backward, the first layer's recompute, gathered params and gradient
        buffers beside the complete gradients of the later layers (with full checkpointing the
        sharded grads outgrow the checkpoints: llama-2-7b 4096 × 2 on 8 ranks, −6.8% without it).
        step: the end of backward and the optimizer step, when activations, gathered params
        and backward buffers are gone and the gradients are complete.
        Traced against FSDPMemTracker (benchmarks/results/fsdp_trace.json) and measured on one
        H200 (docs/accuracy.md)."""
        always = self.resident
        free = self.gathered_free_at_loss
        forward = (always + self.gathered_params - free + self.held_grads
                   + (self.grads if self.grads_persist else 0.0) + self.activations
                   + max(self.logits, free + max(self.ref_forward, self.recompute + self.grad_buffers)))
        # the end of backward: the first layer's recompute and backward buffers (and what is
        # gathered for it) while the gradients of every later layer are already complete (or,
        # accumulating without sync, held unsharded)
        grads = self.held_grads if self.held_grads else self.grads - self.grads_pending
        backward = always + grads + self.gathered_params + self.recompute + self.grad_buffers
        step = always + self.grads + self.step_buffers
        return {"forward": forward, "backward": backward, "step": step}

    @property
    def allocated(self) -> float:
        """Predicted peak of torch.cuda.max_memory_allocated."""
        return max(self.phases.values())

    @property
    def parts(self) -> float:
        """Every allocated part above, summed as if all were live at once (they are not)."""
        return (self.model_states + self.step_buffers + self.activations + self.recompute + self.logits
                + self.engine_buffers + self.gathered_params + self.held_grads + self.grad_buffers
                + self.ref_params + self.ref_forward)

    @property
    def not_at_peak(self) -> float:
        """Of `parts`, the bytes not live at the allocated peak (the phases that never coexist:
        the step's buffers beside the activations, the logits beside the gradient buffers, the
        grads not yet produced): parts − not_at_peak + runtime_overhead = total."""
        return self.parts - self.allocated

    @property
    def reserved(self) -> float:
        """Predicted peak of torch.cuda.max_memory_reserved: allocated + allocator slack."""
        return self.allocated + self.allocator_slack

    @property
    def runtime_overhead(self) -> float:
        """Everything between allocated bytes and the device's used memory."""
        return self.cuda_context + self.nccl + self.allocator_slack

    @property
    def total(self) -> float:
        """Device memory at the peak (what nvidia-smi shows): reserved + CUDA context + NCCL.
        For display and for comparing with nvidia-smi; `required` decides "fits"."""
        return self.reserved + self.cuda_context + self.nccl

    @property
    def required(self) -> float:
        """Device memory that must exist for the step not to run out: the allocated peak, the
        allocator's slack that a cache flush cannot return, the CUDA context and NCCL. The rest
        of `reserved` is not an out-of-memory: before raising one, PyTorch's caching allocator
        frees its cached unused segments and retries the allocation (c10/cuda/
        CUDACachingAllocator.cpp `malloc`: `release_cached_blocks()` then `alloc_block` again).
        `fits` compares this with the GPU's usable memory."""
        return self.allocated + self.allocator_unreclaimable + self.cuda_context + self.nccl

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("grads_persist")
        d.pop("grads_pending")
        d.pop("gathered_free_at_loss")
        d["runtime_overhead"] = self.runtime_overhead
        d["not_at_peak"] = self.not_at_peak
        d["allocated"] = self.allocated
        d["reserved"] = self.reserved
        d["total"] = self.total
        d["required"] = self.required
        return d


@dataclass(frozen=True, slots=True)
class LoadBreakdown:
    """Host bytes of the fullest rank while the checkpoint is read, and of one node
    (shardwise.plan.load: the trainer's load paths)."""

    path: str = "sharded"  # "sharded" | "zero3" | "whole"
    resident: float = 0.0  # the rank's part of the model that lives on the host
    read: float = 0.0  # file pages mapped and tensors read, in flight
    process: float = 0.0  # the interpreter and its libraries
    ranks_per_node: int = 1

    @property
    def per_rank(self) -> float:
        return self.resident + self.read + self.process

    @property
    def per_node(self) -> float:
        return self.per_rank * self.ranks_per_node

    def as_dict(self) -> dict[str, float | str]:
        d: dict[str, float | str] = dict(asdict(self))
        d["per_rank"] = self.per_rank
        d["per_node"] = self.per_node
        return d


@dataclass(frozen=True, slots=True)
class HostBreakdown:
    """Bytes of host (CPU) memory per node: what offload strategies keep there while training
    (`total`), and the load phase before training (`load`, per rank and per node). `peak` is the
    larger of the two phases (the load ends before the first step)."""

    params: float = 0.0
    grads: float = 0.0
    master_params: float = 0.0
    optimizer_states: float = 0.0
    pinned_buffers: float = 0.0
    activations: float = 0.0  # saved-for-backward tensors offloaded to pinned host memory
    load: LoadBreakdown = field(default_factory=LoadBreakdown)

    @property
    def total(self) -> float:
        """The training phase's offloaded bytes per node."""
        return (self.params + self.grads + self.master_params + self.optimizer_states + self.pinned_buffers
                + self.activations)

    @property
    def training(self) -> float:
        """The training phase per node: the offloaded bytes and every rank's process."""
        return self.total + self.load.process * self.load.ranks_per_node

    @property
    def peak(self) -> float:
        return max(self.training, self.load.per_node)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "load"}
        d["total"] = self.total
        d["training"] = self.training
        d["load"] = self.load.as_dict()
        d["peak"] = self.peak
        return d
