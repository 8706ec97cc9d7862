"""One planned configuration: memory, communication and time together."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.errors import ShardwiseError
from shardwise.plan.comm import CommBreakdown, ideal_comm, plan_comm
from shardwise.plan.memory import MemoryPlan, plan_memory
from shardwise.plan.stage import replica_params
from shardwise.plan.timing import TimeBreakdown, step_time
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec
from shardwise.specs.layout import ParallelLayout


@dataclass(frozen=True, slots=True)
class Evaluation:
    train: TrainSpec
    memory: MemoryPlan
    comm: CommBreakdown
    ideal: CommBreakdown
    time: TimeBreakdown
    model: ModelSpec | None = None  # what was planned (the recommender's TP checks read its shape)

    @property
    def strategy(self) -> Strategy:
        return self.memory.strategy

    @property
    def fits(self) -> bool:
        return self.memory.fits


def memory_as_run(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
                  accounting: str = "engine", margin: float | None = None) -> MemoryPlan:
    """The memory plan of what the engines run: FSDP2 with a one-rank shard group is planned as
    the DDP it runs as, where it does (`single_rank_runs_as`; the plan names it in `runs_as`)."""
    ddp = None
    if accounting == "engine" and strategy.single_rank_ddp(hw.world_size, hw.gpus_per_node):
        ddp = single_rank_runs_as(model, hw, train, strategy, margin)
    return plan_memory(model, hw, train, strategy, accounting=accounting, margin=margin, runs_as=ddp)


def evaluate(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
             accounting: str = "engine", margin: float | None = None) -> Evaluation:
    train = train.for_engine(strategy.engine)
    if train.optimizer_in_backward:
        layout = ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
        why = strategy.in_backward_refusal(layout.dp)
        if why:
            raise ShardwiseError(f"--optimizer-in-backward with {strategy.name}: {why}")
    mem = memory_as_run(model, hw, train, strategy, accounting=accounting, margin=margin)
    runs = mem.engine_strategy  # FSDP2 with a one-rank shard group may run as DDP
    comm = plan_comm(model, hw, train, runs, mem.layout)
    psi = replica_params(model, runs, mem.layout)
    ideal = ideal_comm(psi, runs, train.compute_bytes) if mem.layout.dp > 1 else CommBreakdown()
    return Evaluation(train, mem, comm, ideal, step_time(model, hw, train, runs, mem.layout, comm), model)


def single_rank_runs_as(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
                        margin: float | None = None) -> Strategy | None:
    """The DDP strategy an FSDP2 strategy runs as when its shard group is one rank, or None
    when it runs `fully_shard` (FSDPKnobs.single_rank). "auto" takes DDP where its plan fits and
    is planned at least as fast as fully_shard, or where only DDP fits: sharding over one rank
    only saves the bf16 weights resharding frees, at a cast and a copy per parameter and
    gather (docs/reference.md "One-rank shard groups"). The trainer's engine factory asks the
    same question of the same specs, so what is planned is what runs."""
    ddp = strategy.single_rank_ddp(hw.world_size, hw.gpus_per_node)
    if ddp is None or strategy.fsdp.single_rank == "ddp" or strategy.tp > 1:  # TP alone: never fully_shard
        return ddp
    as_ddp = evaluate(model, hw, train, ddp, margin=margin)
    if not as_ddp.fits:
        return None
    sharded = strategy.model_copy(update={"fsdp": strategy.fsdp.model_copy(update={"single_rank": "fsdp"})})
    kept = evaluate(model, hw, train, sharded, margin=margin)
    return ddp if not kept.fits or as_ddp.time.step_s <= kept.time.step_s else None
