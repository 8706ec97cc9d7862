"""One planned configuration: memory, communication and time together."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardwise.errors import ShardwiseError
from shardwise.plan.comm import CommBreakdown, ideal_comm, plan_comm
from shardwise.plan.experts import rank_model
from shardwise.plan.grad_sync import GradSync, apart_figures, apart_words, applies, held_words, with_knob
from shardwise.plan.memory import MemoryPlan, plan_memory
from shardwise.plan.recompute import RecomputeChoice
from shardwise.plan.stage import replica_params
from shardwise.plan.timing import TimeBreakdown, step_time
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec
from shardwise.specs.hardware import GIB
from shardwise.specs.layout import ParallelLayout


@dataclass(frozen=True, slots=True)
class Evaluation:
    train: TrainSpec
    memory: MemoryPlan
    comm: CommBreakdown
    ideal: CommBreakdown
    time: TimeBreakdown
    model: ModelSpec | None = None  # what was planned (the recommender's TP checks read its shape)
    recompute: RecomputeChoice | None = None  # `checkpointing: auto`'s choice (`train` holds it); None where set

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
    if ddp is None and applies(strategy, train.for_engine(strategy.engine)) and strategy.pp > 1 \
            and strategy.fsdp.reduce_every_micro_batch is True:
        # torch's pipeline schedule holds the grads whatever the knob says: planned as it runs
        held = plan_memory(model, hw, train, with_knob(strategy, False), accounting=accounting, margin=margin)
        sync = GradSync(hold=True, auto=False, held_bytes=held.gpu.held_grads, grad_accum=train.grad_accum,
                        strategy=with_knob(strategy, False),
                        reason=f"strategy.fsdp.reduce_every_micro_batch: true, but torch's pipeline schedule turns "
                               f"gradient sync off on all but the last micro-batch: holding "
                               f"{held_words(held.gpu.held_grads)}")
        return replace(held, strategy=strategy, grad_sync=sync)
    if ddp is None and applies(strategy, train.for_engine(strategy.engine)) \
            and strategy.fsdp.reduce_every_micro_batch == "auto":
        # FSDP2 under accumulation: decided once (fsdp_grad_sync), then planned with the knob a bool
        sync = fsdp_grad_sync(model, hw, train, strategy, margin)
        return replace(plan_memory(model, hw, train, sync.strategy, accounting=accounting, margin=margin),
                       strategy=strategy, grad_sync=sync)
    return plan_memory(model, hw, train, strategy, accounting=accounting, margin=margin, runs_as=ddp)


def evaluate(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
             accounting: str = "engine", margin: float | None = None) -> Evaluation:
    train = train.for_engine(strategy.engine)
    recompute = checkpointing_choice(model, hw, train, strategy, accounting=accounting, margin=margin)
    if recompute is not None:
        train = train.model_copy(update={"checkpointing": recompute.checkpointing})
    if train.optimizer_in_backward:
        layout = ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
        why = strategy.in_backward_refusal(layout.dp)
        if why:
            raise ShardwiseError(f"--optimizer-in-backward with {strategy.name}: {why}")
    mem = memory_as_run(model, hw, train, strategy, accounting=accounting, margin=margin)
    runs = mem.engine_strategy  # FSDP2 with a one-rank shard group may run as DDP
    comm = plan_comm(model, hw, train, runs, mem.layout)
    psi = replica_params(rank_model(model, runs), runs, mem.layout)  # num_experts/ep experts under EP
    ideal = ideal_comm(psi, runs, train.compute_bytes) if mem.layout.dp > 1 else CommBreakdown()
    return Evaluation(train, mem, comm, ideal, step_time(model, hw, train, runs, mem.layout, comm), model, recompute)


def checkpointing_choice(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
                         accounting: str = "engine", margin: float | None = None) -> RecomputeChoice | None:
    """What `checkpointing: auto` runs for `strategy` on `hw` (plan/recompute.py): none where the
    plan without recomputation fits, else full, unless only the host's peak is short and
    recomputation does not lower it, or the strategy overlaps the EP all-to-alls (Megatron-Core
    refuses full recomputation there); None where `train` sets it."""
    if train.checkpointing != "auto":
        return None
    bare = memory_as_run(model, hw, train.model_copy(update={"checkpointing": "none"}), strategy,
                         accounting=accounting, margin=margin)
    if bare.fits or bare.gpu.required > bare.usable_bytes:
        need, usable = apart_figures(bare.gpu.required / GIB, bare.usable_bytes / GIB)
        full = not bare.fits and not strategy.ep_overlap
        return RecomputeChoice("full" if full else "none", strategy.name, need, f"{usable} usable")
    # the GPU fits, the host's peak does not: recomputation helps only where it lowers that peak
    full = memory_as_run(model, hw, train.model_copy(update={"checkpointing": "full"}), strategy,
                         accounting=accounting, margin=margin)
    lowers = full.host.peak < bare.host.peak
    return RecomputeChoice("full" if lowers else "none", strategy.name, f"{bare.host.peak / GIB:.1f}",
                           f"{bare.host_capacity_bytes / GIB:.0f} per node (host memory)", moot=not lowers)


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


def fsdp_grad_sync(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
                   margin: float | None = None) -> GradSync | None:
    """The gradient reduction `strategy` (as `fully_shard` runs it) uses under `train`'s
    accumulation on `hw`, with `margin` of GPU memory kept free (None: the memory model's
    default, as `plan` and the trainer's preflight take it); None where there is no choice (not
    FSDP2, or one micro-batch per step). The fit is the engines' (the "engine" accounting)."""
    train = train.for_engine(strategy.engine)
    if not applies(strategy, train):
        return None
    k = train.grad_accum
    if strategy.fsdp.reduce_every_micro_batch != "auto":  # set in the config: the plan records it
        if strategy.pp > 1:  # held whatever it says (memory_as_run)
            return memory_as_run(model, hw, train, strategy, margin=margin).grad_sync
        return plan_memory(model, hw, train, strategy, margin=margin).grad_sync
    hold_s = with_knob(strategy, False)
    held = plan_memory(model, hw, train, hold_s, margin=margin)
    held_bytes = held.gpu.held_grads
    size = held_words(held_bytes)
    if strategy.pp > 1:
        return GradSync(hold=True, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=hold_s,
                        reason=f"holding {size}: torch's pipeline schedule turns gradient sync off on all "
                               "but the last micro-batch")
    every_s = with_knob(strategy, True)
    if held.gpu.required > held.usable_bytes:  # the GPU's fit (the held grads are on the GPU, offloaded or not)
        return GradSync(hold=False, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=every_s,
                        reason=f"holding {size} would not fit: the plan would need "
                               f"{apart_words(held.gpu.required / GIB, held.usable_bytes / GIB)} usable")
    t_hold, t_every = (_step_s(model, hw, train, s, held.layout) for s in (hold_s, every_s))
    if t_hold < t_every:
        return GradSync(hold=True, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=hold_s,
                        reason=f"holding {size} fits and saves {k - 1} reduce-scatter{'s' if k > 2 else ''} "
                               f"per step: planned {t_hold:.4g} s vs {t_every:.4g} s a step")
    return GradSync(hold=False, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=every_s,
                    reason=f"holding {size} would fit but is planned no faster: {t_hold:.4g} s vs "
                           f"{t_every:.4g} s a step")


def _step_s(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, layout) -> float:
    comm = plan_comm(model, hw, train, strategy, layout)
    return step_time(model, hw, train, strategy, layout, comm).step_s


def resolved(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
             margin: float | None = None) -> Strategy:
    """`strategy` with `reduce_every_micro_batch` a bool (itself where it already is one)."""
    if strategy.fsdp.reduce_every_micro_batch != "auto":
        return strategy
    sync = fsdp_grad_sync(model, hw, train, strategy, margin)
    # no choice (not FSDP2, or no accumulation): every micro-batch is the step's one reduce-scatter
    return sync.strategy if sync else with_knob(strategy, True)
