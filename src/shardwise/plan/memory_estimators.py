"""The two published accountings of model states (pure, no torch): the ZeRO paper's and
DeepSpeed's own estimators. `plan/memory.py` picks one by `accounting`; its default, "engine",
is what the installed engines allocate."""

from __future__ import annotations

from shardwise.plan.breakdown import HostBreakdown, MemoryBreakdown
from shardwise.specs.strategy import Strategy


def paper_model_states(psi: float, n: int, s: Strategy) -> MemoryBreakdown:
    """ZeRO paper §5: 2Ψ fp16 params + 2Ψ fp16 grads + KΨ (K = 12: fp32 params 4, Adam 8)."""
    stage = s.zero_equivalent
    opt_on_gpu = 0 if s.offload_optimizer else 1
    return MemoryBreakdown(
        params=2 * psi / (n if stage >= 3 else 1) * (0 if s.offload_params else 1),
        grads=2 * psi / (n if stage >= 2 else 1),
        master_params=4 * psi / (n if stage >= 1 else 1) * opt_on_gpu,
        optimizer_states=8 * psi / (n if stage >= 1 else 1) * opt_on_gpu,
    )


def deepspeed_estimator(model, psi, n, s: Strategy, layout, per_node) -> tuple[MemoryBreakdown, HostBreakdown]:
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs (zero_init=True), bucketed into parts.
    ZeRO-2: 2Ψ + 18Ψ/N, "18 = 2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 Adam"
    (stage_1_and_2.py). ZeRO-3: 4·largest_layer + 18Ψ/N (stage3.py); its 18 is not itemised:
    we book 2 fp16 params + 2 fp16 grads + 4 fp32 params + 8 Adam and the 2 left as step buffers.
    Host figures include the estimator's additional_buffer_factor 1.5."""
    nodes = max(1, layout.world_size // per_node)
    if s.zero_stage == 3:
        live = 4 * model.largest_module / layout.tp
        if s.offload_params:
            return MemoryBreakdown(engine_buffers=live), HostBreakdown(optimizer_states=psi * 18 / nodes * 1.5)
        if s.offload_optimizer:
            return (MemoryBreakdown(params=2 * psi / n, engine_buffers=live),
                    HostBreakdown(optimizer_states=psi * 16 / nodes * 1.5))
        return MemoryBreakdown(
            params=2 * psi / n, grads=2 * psi / n, master_params=4 * psi / n,
            optimizer_states=8 * psi / n, step_buffers=2 * psi / n, engine_buffers=live,
        ), HostBreakdown()
    if s.offload_optimizer:
        return MemoryBreakdown(params=2 * psi), HostBreakdown(optimizer_states=psi * max(4 * n, 16) * 1.5)
    return MemoryBreakdown(
        params=2 * psi, grads=2 * psi / n, step_buffers=4 * psi / n, master_params=4 * psi / n,
        optimizer_states=8 * psi / n,
    ), HostBreakdown()
