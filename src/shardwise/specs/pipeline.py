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

from typing import Any

from shardwise.config.strategy import virtual_refusal
from shardwise.errors import ShardwiseError

# The families whose decoder forward a pipeline stage reuses (shardwise.train.model.pipeline:
# transformers' <Family>Model.forward over the stage's layers, `inputs_embeds` between stages).
TRAINER_PP_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


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
    why = virtual_refusal(schedule, virtual)
    if why:
        return why
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


def stage_engine_refusal(strategy: Any) -> str | None:
    """Why the trainer's pipeline stages do not run `strategy` (a shardwise.specs.Strategy) at its
    pp, or None where they do (and at pp 1): FSDP2 inside each stage without offload, TP inside a
    stage DTensor's (FSDP2 × TP × PP on one mesh). `Strategy.trainable` and `trainer_pp_gap` ask here."""
    if strategy.pp == 1:
        return None
    where = "pipeline stages run with FSDP2 inside each stage (strategy fsdp, fsdp-grad-op or fsdp-hybrid)"
    if strategy.engine == "deepspeed":
        return (f"{where}: DeepSpeed's pipeline engine needs the model rewritten as its PipelineModule of LayerSpecs "
                "and saves pickled checkpoints (docs/architecture.md, \"Pipeline parallelism\")")
    if strategy.engine != "fsdp2":
        return f"{where}: DDP replicates the whole model; the stages' data-parallel ranks are FSDP2's"
    if strategy.offload_params or strategy.offload_optimizer:
        return f"{where}: offloading to the host is not built under pipeline stages"
    if strategy.tp > 1 and strategy.tp_scheme.name != "dtensor":
        return (f"tensor parallelism inside a pipeline stage is DTensor's (tp_impl dtensor), not "
                f"{strategy.tp_scheme.name}'s")
    return None


def trainer_pp_gap(model: Any, strategy: Any, train: Any) -> str | None:
    """Why `shardwise train` does not run `strategy` at its pp for this model and run (None: it
    does, and at pp 1): the strategy itself (`stage_engine_refusal`), the model's family and tied
    embeddings, the run's precision, activation offloading and optimizer, and the schedule's needs
    (`schedule_refusal`: the run's grad_accum micro-batches). `model` (a ModelSpec) None: the
    strategy and the run only. The run bridge's check (shardwise.run.resolve.check_pipeline) and
    the recommender (shardwise.plan.recommend.trainer_gaps) both ask here."""
    if strategy.pp == 1:
        return None
    why = stage_engine_refusal(strategy)
    if why:
        return why
    if model is not None:
        if model.family not in TRAINER_PP_FAMILIES:
            return (f"the trainer's pipeline stages run transformers' decoder forward of families "
                    f"{', '.join(TRAINER_PP_FAMILIES)}, not {model.family!r}")
        if model.tie_embeddings:
            return (f"{model.name} ties lm_head to the input embedding, and the two sit on the first and the last "
                    "stage (untie them: tie_word_embeddings false)")
    if train.compute_dtype == "fp16":
        return ("fp16-mixed under pipeline stages is not supported (each stage's loss scaler would decide its own "
                "skips); use precision bf16-mixed")
    if train.activation_offload:
        return ("activation offloading (checkpointing.offload) under pipeline stages is not built (its hooks are "
                "opened per engine call, and a schedule interleaves the micro-batches)")
    if train.optimizer != "adamw":
        return (f"optimizer {train.optimizer!r} under pipeline stages is not verified by shardwise's parity tests; "
                "use adamw")
    # without a model, only the micro-batches are checked: as many layers as stages
    layers = model.num_layers if model is not None else strategy.pp * strategy.pp_virtual_stages
    return schedule_refusal(strategy.pp, strategy.pp_schedule, strategy.pp_virtual_stages, train.grad_accum, layers)
