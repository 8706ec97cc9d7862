"""Pipeline stages, shared by the planner and the trainer (torch-free): which decoder layers each
stage holds, which stages each pipeline rank runs, and what a schedule needs of the step.

`pp` ranks run `pp × virtual` stages (`strategy.pp_virtual_stages`, interleaved 1F1B only); the
model's decoder layers are split into that many consecutive runs of near-equal length (the first
`L mod S` stages one layer longer, as `numpy.array_split` splits), the embedding with stage 0 and
the final norm and lm_head with the last. Rank r runs stages r, r + pp, r + 2·pp, … (the "loop"
assignment of torch.distributed.pipelining's interleaved schedules and torchtitan's
`stage_ids_this_rank`). The micro-batches of a pipeline step are the run's gradient-accumulation
micro-batches.
"""

from __future__ import annotations

from shardwise.config.strategy import PP_SCHEDULES
from shardwise.errors import ShardwiseError


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The decoder layers of each of `stages` stages, in order: consecutive, lengths differing by
    at most one, the longer ones first."""
    if stages > num_layers:
        raise ShardwiseError(f"{stages} pipeline stages need at least one decoder layer each; the model has "
                             f"{num_layers}")
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for i in range(stages):
        n = base + (1 if i < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def rank_stages(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs (one without virtual stages)."""
    return [pp_rank + k * pp for k in range(virtual)]


def schedule_refusal(pp: int, schedule: str, virtual: int, micro_batches: int, num_layers: int) -> str | None:
    """Why torch's schedule cannot run this pipeline (None: it can): the number of micro-batches
    (the run's grad_accum) each schedule needs, virtual stages only where interleaved, a layer per
    stage. The trainer's run bridge and the planner ask here."""
    if pp == 1:
        if virtual != 1:
            return f"pp_virtual_stages {virtual} needs pipeline parallelism (pp > 1)"
        return None
    if schedule not in PP_SCHEDULES:
        return f"pp_schedule {schedule!r}: expected one of {', '.join(PP_SCHEDULES)}"
    if virtual > 1 and schedule != "interleaved-1f1b":
        return (f"pp_virtual_stages {virtual} with pp_schedule {schedule!r}: virtual stages (several stages per "
                "rank) are interleaved 1F1B's")
    if schedule == "interleaved-1f1b" and virtual < 2:
        return "pp_schedule 'interleaved-1f1b' runs at least 2 stages per rank: set pp_virtual_stages ≥ 2"
    if pp * virtual > num_layers:
        return (f"pp {pp} × pp_virtual_stages {virtual} = {pp * virtual} stages need a decoder layer each; the "
                f"model has {num_layers}")
    if schedule == "1f1b" and micro_batches < pp:
        return (f"1F1B needs at least as many micro-batches as stages: grad_accum {micro_batches} < pp {pp} "
                "(torch's Schedule1F1B refuses it)")
    rounds = max(1, micro_batches // pp)
    if schedule == "interleaved-1f1b" and micro_batches % rounds:
        return (f"interleaved 1F1B runs the micro-batches in rounds of about pp (torch's ScheduleInterleaved1F1B: "
                f"{rounds} rounds); grad_accum {micro_batches} must be a multiple of {rounds}")
    return None
