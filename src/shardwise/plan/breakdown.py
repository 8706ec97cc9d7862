"""The memory vocabulary shared by the planner, the trainer's summary and the benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes per GPU at the step's peak, by part.

    params/grads/master_params/optimizer_states are the model states held across the step
    (what a per-rank tensor census sees after backward). step_buffers exist only inside the
    optimizer step (DeepSpeed's fp32 gradient partition, foreach temporaries, FSDP2's root
    reduce-scatter at the end of backward). engine_buffers are the engine's own, resident
    through forward and backward (ZeRO-3 live/prefetched params and its reduce bucket, FSDP2
    unsharded params); grad_buffers exist only during backward (DeepSpeed ZeRO-1/2 reduce
    buckets, FSDP2 unsharded layer grads and their reduce-scatter copy, lm_head's grad).
    """

    params: float = 0.0
    grads: float = 0.0
    master_params: float = 0.0
    optimizer_states: float = 0.0
    step_buffers: float = 0.0
    activations: float = 0.0
    recompute: float = 0.0  # checkpointing: one layer re-materialised during backward
    logits: float = 0.0
    engine_buffers: float = 0.0
    grad_buffers: float = 0.0
    runtime_overhead: float = 0.0
    grads_held: bool = False  # grads survive into the next forward (accumulation): they coexist

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.master_params + self.optimizer_states

    @property
    def total(self) -> float:
        """The step's peak, not the sum of the parts: activations peak at the end of forward and
        stay while the loss backward peaks (logits) and then while the last layers' gradient
        buffers exist (the logits are freed by then: max, not sum); gradients peak at the end of
        backward when the activations are gone, step buffers inside the optimizer step.
        Gradients of the previous micro-batch are held during forward only under accumulation
        (step k's grads are freed before step k+1). Traced against FSDPMemTracker at 7-13B:
        benchmarks/results/fsdp_trace.json."""
        always = self.params + self.master_params + self.optimizer_states + self.engine_buffers
        forward = (self.activations + self.recompute + max(self.logits, self.grad_buffers)
                   + (self.grads if self.grads_held else 0.0))
        backward = self.grads + self.step_buffers
        return always + max(forward, backward) + self.runtime_overhead

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("grads_held")
        d["total"] = self.total
        return d


@dataclass(frozen=True, slots=True)
class HostBreakdown:
    """Bytes of host (CPU) memory per node for offload strategies."""

    params: float = 0.0
    grads: float = 0.0
    master_params: float = 0.0
    optimizer_states: float = 0.0
    pinned_buffers: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d
