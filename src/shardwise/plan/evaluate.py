"""One planned configuration: memory, communication and time together."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.plan.comm import CommBreakdown, ideal_comm, plan_comm
from shardwise.plan.memory import DEFAULT_MARGIN, MemoryPlan, plan_memory, stage_params
from shardwise.plan.timing import TimeBreakdown, step_time
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec


@dataclass(frozen=True, slots=True)
class Evaluation:
    train: TrainSpec
    memory: MemoryPlan
    comm: CommBreakdown
    ideal: CommBreakdown
    time: TimeBreakdown

    @property
    def strategy(self) -> Strategy:
        return self.memory.strategy

    @property
    def fits(self) -> bool:
        return self.memory.fits


def evaluate(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
             accounting: str = "engine", margin: float = DEFAULT_MARGIN) -> Evaluation:
    mem = plan_memory(model, hw, train, strategy, accounting=accounting, margin=margin)
    comm = plan_comm(model, hw, train, strategy, mem.layout)
    psi = stage_params(model, mem.layout.tp, mem.layout.pp)
    ideal = ideal_comm(psi, strategy, train.compute_bytes) if mem.layout.dp > 1 else CommBreakdown()
    return Evaluation(train, mem, comm, ideal, step_time(model, hw, train, strategy, mem.layout, comm))
