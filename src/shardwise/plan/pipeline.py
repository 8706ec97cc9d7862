"""Pipeline ranks and schedules as the trainer runs them (pure, no torch): what each pipeline rank
holds, the order in which it runs its forwards and backwards, and what follows from that order —
the saved activations a rank holds at its peak and the share of the step the ranks sit idle.

**What a rank holds** is shardwise.specs.pipeline's split, the one the trainer cuts the model by:
`pp × virtual` stages of consecutive decoder layers (lengths differing by at most one, the longer
first), rank r running stages r, r + pp, …; the embedding sits with stage 0 (rank 0), the final
norm and lm_head with the last stage (rank pp − 1).

**The order** is torch 2.13's (torch/distributed/pipelining/schedules.py), rebuilt here from its
rules without importing torch; m micro-batches (the run's grad_accum), p ranks, v stages each:

- GPipe (`ScheduleGPipe._step_microbatches`): every micro-batch's forward, then every backward.
- 1F1B (`Schedule1F1B._step_microbatches`): rank r first runs `warmup_chunks` = min(m, p − r)
  forwards, then one backward and one forward at a time, then the remaining backwards.
- Interleaved 1F1B (`ScheduleInterleaved1F1B._calculate_single_rank_operations`, its
  `_get_warmup_ops` and `_get_1f1b_rank_ops`): the micro-batches run in rounds of
  `microbatches_per_round` = m // max(1, m // p); rank r's warmup is (v − 1)·mpr + 2·(p − 1 − r)
  forwards (at most v·m), the forward of step k on local stage (k // mpr) mod v, the backward of
  step k on local stage v − 1 − ((k − warmup) // mpr) mod v; then one forward and one backward
  per step, then the remaining backwards.

The runtime executes a rank's actions in this order (the schedule's slots without an action are
waits, not work), so the order alone fixes what a rank holds. The order of a real step is recorded
and compared with this one on 2 gloo ranks (tests/accuracy/test_measured_pipeline.py), with each
rank's saved activations and the bubble.

**Activations in flight** (`in_flight_peak`): the peak, over a rank's order, of the saved bytes of
every (stage, micro-batch) whose forward has run and whose backward has not. GPipe holds all m
micro-batches at the end of forward; 1F1B holds min(m, p − r) on rank r (the first rank the most);
interleaved 1F1B holds what its order says (pp 2, v 2, m 4: five stage-forwards on rank 0, three
on rank 1).

**The bubble** (`pipeline_idle`): each rank's order run with each action starting when its rank is
free and its input is ready (a forward after the previous stage's forward of that micro-batch, a
backward after the next stage's backward), forwards taking a stage's layers' share of the time and
backwards `backward_ratio` times that, communication free. For equal stages this gives GPipe's and
1F1B's (p − 1)/(m + p − 1) and interleaved 1F1B's (p − 1)/(v·m + p − 1) of the step (Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
arXiv:2104.04473, §2.2.1-2.2.2; tests/plan/test_pipeline_plan.py checks both); for stages of
unequal length it counts what the order leaves idle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple

from shardwise.errors import ShardwiseError
from shardwise.specs.pipeline import rank_stages, stage_layers

Kind = Literal["F", "B"]


class Action(NamedTuple):
    """One compute action of a rank: a forward ("F") or full backward ("B") of one micro-batch
    through one stage."""

    kind: Kind
    stage: int
    micro_batch: int


@dataclass(frozen=True, slots=True)
class PipelineRank:
    """One pipeline rank's share of the model: its stages (in order) and each stage's decoder
    layers; whether it holds the embedding (stage 0) and the head (the last stage: final norm and
    lm_head). At pp 1 the one rank holds everything."""

    index: int
    stages: tuple[int, ...]
    stage_layers: tuple[tuple[int, ...], ...]
    embedding: bool
    head: bool
    last_stage: int  # the pipeline's last stage (pp × virtual − 1)

    @property
    def layers(self) -> tuple[int, ...]:
        """Every decoder layer this rank holds, in order (the union of its stages')."""
        return tuple(i for layers in self.stage_layers for i in layers)


@lru_cache(maxsize=1024)
def pipeline_ranks(num_layers: int, pp: int, virtual: int = 1) -> tuple[PipelineRank, ...]:
    """Every pipeline rank's share, rank 0 first (specs.pipeline's split)."""
    n = pp * virtual
    ranges = stage_layers(num_layers, n)
    out = []
    for r in range(pp):
        stages = tuple(rank_stages(r, pp, virtual))
        out.append(PipelineRank(r, stages, tuple(tuple(ranges[s]) for s in stages), embedding=0 in stages,
                                head=n - 1 in stages, last_stage=n - 1))
    return tuple(out)


def _interleaved(rank: int, pp: int, virtual: int, m: int) -> list[Action]:
    """ScheduleInterleaved1F1B's compute actions of `rank`, in order (its slots without an action
    left out). Torch refuses m that the rounds do not divide; so does this."""
    rounds = max(1, m // pp)
    if m % rounds:
        raise ShardwiseError(f"interleaved 1F1B runs the micro-batches in {rounds} rounds (torch's "
                             f"ScheduleInterleaved1F1B); grad_accum {m} must be a multiple of {rounds}")
    per_round = m // rounds
    ops = virtual * m
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), ops)

    def forward_stage(step: int) -> int:
        return (step // per_round) % virtual * pp + rank

    def backward_stage(step: int) -> int:
        return (virtual - 1 - ((step - warmup) // per_round) % virtual) * pp + rank

    fwd: dict[int, int] = {}
    bwd: dict[int, int] = {}
    out: list[Action] = []

    def add(kind: Kind, stage: int, seen: dict[int, int]) -> None:
        out.append(Action(kind, stage, seen.get(stage, 0)))
        seen[stage] = seen.get(stage, 0) + 1

    for step in range(ops + warmup):  # warmup forwards, (forward, backward) pairs, cooldown backwards
        if step < ops:
            add("F", forward_stage(step), fwd)
        if step >= warmup:
            add("B", backward_stage(step), bwd)
    return out


@lru_cache(maxsize=4096)
def rank_actions(schedule: str, pp: int, virtual: int, micro_batches: int, rank: int) -> tuple[Action, ...]:
    """The compute actions pipeline rank `rank` runs in one step, in torch's order (module
    docstring). pp 1: each micro-batch's forward then its backward."""
    m = micro_batches
    if pp == 1:
        return tuple(a for i in range(m) for a in (Action("F", 0, i), Action("B", 0, i)))
    if schedule == "gpipe":
        return tuple([Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)])
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        out = [Action("F", rank, i) for i in range(warmup)]
        for i in range(m):
            out.append(Action("B", rank, i))
            if warmup + i < m:
                out.append(Action("F", rank, warmup + i))
        return tuple(out)
    if schedule == "interleaved-1f1b":
        return tuple(_interleaved(rank, pp, virtual, m))
    raise ShardwiseError(f"pp_schedule {schedule!r}: expected gpipe, 1f1b or interleaved-1f1b")


def in_flight_peak(actions: Sequence[Action], stage_bytes: Mapping[int, float],
                   per_micro_batch: float = 0.0) -> float:
    """The peak, over `actions` (one rank's order), of the bytes held for backward: each (stage,
    micro-batch) whose forward has run and whose backward has not holds `stage_bytes[stage]`, and
    each micro-batch with any such stage holds `per_micro_batch` once (what all its stages on the
    rank share, e.g. a dense attention mask)."""
    live = peak = 0.0
    stages_of: dict[int, int] = {}
    for a in actions:
        if a.kind == "F":
            live += stage_bytes[a.stage]
            if not stages_of.get(a.micro_batch):
                live += per_micro_batch
            stages_of[a.micro_batch] = stages_of.get(a.micro_batch, 0) + 1
            peak = max(peak, live)
        else:
            live -= stage_bytes[a.stage]
            stages_of[a.micro_batch] -= 1
            if not stages_of[a.micro_batch]:
                live -= per_micro_batch
    return peak


def stage_in_flight(actions: Sequence[Action], stage: int) -> int:
    """The most micro-batches of `stage` held at once in `actions` (forward run, backward not)."""
    return round(in_flight_peak([a for a in actions if a.stage == stage], {stage: 1.0}))


@lru_cache(maxsize=1024)
def pipeline_idle(schedule: str, pp: int, virtual: int, micro_batches: int,
                  stage_work: tuple[float, ...], backward_ratio: float = 2.0) -> float:
    """Idle time of the step per unit of the busiest rank's compute: (step − busiest rank's work)
    / its work, the step being the simulated order's makespan (module docstring). `stage_work`:
    each stage's forward time (any unit: its decoder layers); a backward takes `backward_ratio`
    times its forward. 0 at pp 1."""
    if pp == 1:
        return 0.0
    n, m = pp * virtual, micro_batches
    orders = [rank_actions(schedule, pp, virtual, m, r) for r in range(pp)]
    # an action as one integer (stage, micro-batch, kind), finish times in a flat list
    finish = [-1.0] * (2 * n * m)

    def key(kind: str, stage: int, mb: int) -> int:
        return 2 * (stage * m + mb) + (kind == "B")

    plans = [[(key(*a), key("F", a.stage - 1, a.micro_batch) if a.kind == "F" and a.stage > 0 else
               key("B", a.stage + 1, a.micro_batch) if a.kind == "B" and a.stage < n - 1 else
               key("F", a.stage, a.micro_batch) if a.kind == "B" else -1,
               stage_work[a.stage] * (1.0 if a.kind == "F" else backward_ratio)) for a in order] for order in orders]
    clock = [0.0] * pp
    busy = [0.0] * pp
    nxt = [0] * pp
    waiting: dict[int, int] = {}
    ready = list(range(pp))
    while ready:
        r = ready.pop()
        plan, t, i = plans[r], clock[r], nxt[r]
        while i < len(plan):
            k, dep, d = plan[i]
            if dep >= 0:
                if finish[dep] < 0:
                    waiting[dep] = r
                    break
                t = max(t, finish[dep])
            t += d
            busy[r] += d
            finish[k] = t
            i += 1
            if k in waiting:
                ready.append(waiting.pop(k))
        clock[r], nxt[r] = t, i
    if any(nxt[r] < len(plans[r]) for r in range(pp)):  # the orders are torch's: never reached
        raise ShardwiseError(f"pipeline schedule {schedule} (pp {pp}, v {virtual}, m {m}) deadlocks")
    return max(clock) / max(busy) - 1.0


def bubble_share(schedule: str, pp: int, virtual: int, micro_batches: int, stage_work: tuple[float, ...],
                 backward_ratio: float = 2.0) -> float:
    """The bubble's share of the step: idle / (work + idle), the busiest rank's (`pipeline_idle`)."""
    idle = pipeline_idle(schedule, pp, virtual, micro_batches, stage_work, backward_ratio)
    return idle / (1.0 + idle)
