"""The recommender: sweep strategies × micro-batch × checkpointing × TP/PP (and the pipeline
schedule), drop what does not fit, rank by tokens/s per GPU, prefer the simpler strategy on
near-ties, explain in numbers.

Only configurations that `shardwise train` and `plan --emit` run exactly are ranked
(`runnable`: no or full activation checkpointing; at tp 1 or with TP on a family the trainer's
TP plan covers: FSDP2 without offload through DTensor with sequence parallelism
(shardwise.train.model.tensor_parallel), ZeRO-1/2 without offload through DeepSpeed's AutoTP,
each planned as its own TP scheme, specs.strategy.TP_SCHEMES; at pp 1 or with FSDP2 stages
without offload where the model, the run and the schedule allow it,
specs.pipeline.trainer_pp_gap). The others are plan-only: when one would be faster (or is the
only thing that fits) it is named as an `Alternative`, with the tool that runs it and the
numbers. A user who pins a strategy or a `--tp`/`--pp` layout the trainer does not run gets the
best of those, marked plan-only, and the best runnable configuration at that layout beside it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from shardwise.config.strategy import STRATEGIES, STRATEGY_NAMES, StrategyKnobs
from shardwise.errors import ShardwiseError
from shardwise.numfmt import rate
from shardwise.plan.evaluate import Evaluation, evaluate
from shardwise.plan.planner import check_margin
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec
from shardwise.specs.hardware import GIB
from shardwise.specs.layout import trainer_tp_gap
from shardwise.specs.pipeline import schedule_refusal, stage_engine_refusal, trainer_pp_gap

NEAR_TIE = 0.03  # within 3% tokens/s, the simpler strategy wins
TRAINER = "shardwise train"
# What runs each plan-only configuration (docs/planner.md "The recommender").
MEGATRON = "Megatron-LM"
MEGATRON_DS = "Megatron-DeepSpeed"
TORCHTITAN = "torchtitan"
DS_PIPE = "DeepSpeed's pipeline engine (deepspeed.pipe)"
# context parallelism outside torchtitan: ring-flash-attn under axolotl (context_parallel_size),
# DeepSpeed's Ulysses through HF accelerate's ParallelismConfig sp_size (ALST)
RING_FLASH = "axolotl (ring-flash-attn)"
DS_ULYSSES = "DeepSpeed Ulysses (accelerate sp_size)"
DS_AUTOTP = "DeepSpeed AutoTP training (tensor_parallel.autotp_size)"
# DeepSpeed itself runs what its engine under shardwise does not: pure bf16 through
# bf16.bf16_master_weights_and_grads + bf16_optimizer_states, a low-bit AdamW as a client optimizer.
DS_OWN = "DeepSpeed with a config of its own (bf16 master weights, a client optimizer)"
TRAINER_CHECKPOINTING = ("none", "full")  # what `shardwise train` offers (checkpointing.activation)
# QLoRA with sharded parameters: bitsandbytes' 4-bit weights stored in a float dtype
# (`bnb_4bit_quant_storage`) so FSDP can flatten them: HF accelerate/Trainer (Answer.AI's FSDP-QLoRA).
QLORA_SHARDED = "QLoRA with sharded parameters"
FSDP_QLORA = "HF accelerate (FSDP-QLoRA, bnb_4bit_quant_storage)"
TRL = "TRL (DPOTrainer, ORPOTrainer, KTOTrainer, CPOTrainer)"  # the preference objectives' trainers


def trainer_gaps(strategy: Strategy, train: TrainSpec, model: ModelSpec | None = None,
                 runs: Strategy | None = None) -> list[str]:
    """What `shardwise train` (and `plan --emit`) lacks to run this configuration exactly; empty
    when it runs it. The sweep's own choices only: settings the user gave (precision, optimizer,
    LoRA, ...) are theirs, and --emit notes how it writes them."""
    gaps = []
    if not strategy.facts.trainer:
        gaps.append(f"the {strategy.name} engine")
    if strategy.tp > 1:
        scheme = strategy.tp_scheme.name
        if scheme == "megatron":
            gaps.append(f"Megatron's tensor parallelism (tp {strategy.tp})")
        elif not strategy.trainable:  # offload, or ZeRO-0 under AutoTP: the trainer runs FSDP2 and ZeRO-1/2
            gaps.append(f"tensor parallelism (tp {strategy.tp}) with {strategy.name}")
        elif model is not None and (why := trainer_tp_gap(model, strategy.tp, strategy.tp_scheme.vocab_parallel)):
            gaps.append(f"tensor parallelism (tp {strategy.tp}) for this model: {why}")
        if train.lora_rank:
            gaps.append(f"LoRA with tensor parallelism (tp {strategy.tp})")
    if strategy.pp > 1:
        if stage_engine_refusal(strategy):  # DeepSpeed, DDP, offload, another TP: the trainer runs FSDP2 stages
            gaps.append(f"pipeline parallelism (pp {strategy.pp}) with {strategy.name}")
        elif why := trainer_pp_gap(model, strategy, train):
            gaps.append(f"pipeline parallelism (pp {strategy.pp}) for this run: {why}")
    if strategy.cp > 1:
        gaps.append(f"context parallelism (cp {strategy.cp}, {strategy.cp_scheme})")
    if strategy.ep > 1:
        gaps.append(f"expert parallelism (ep {strategy.ep}; planned only)")
    if train.checkpointing not in TRAINER_CHECKPOINTING:
        gaps.append(f"{train.checkpointing} activation checkpointing")
    if train.fp8 != "none":
        gaps.append(f"fp8 linears ({train.fp8} scaling)")
    if train.objective != "sft":
        gaps.append(f"{train.objective.upper()} training ({TRAINER} runs SFT)")
    if train.base_quant == "nf4" and (strategy.shards_params or strategy.offload_params):
        gaps.append(QLORA_SHARDED)
    if strategy.engine == "deepspeed":  # DeepSpeed's engine keeps fp32 masters and builds its own AdamW
        if train.precision == "bf16-pure":
            gaps.append("pure bf16 under DeepSpeed")
        if train.optimizer != "adamw":
            gaps.append(f"{train.optimizer} under DeepSpeed")
    elif (runs or strategy).low_bit_refusal(train.optimizer, "cuda"):
        gaps.append(f"{train.optimizer} with {(runs or strategy).name}" + (f" tp {strategy.tp}" if strategy.tp > 1 else ""))
    return gaps


def runnable(e: Evaluation) -> bool:
    return not trainer_gaps(e.strategy, e.train, e.model, e.memory.engine_strategy)


def tool_for(strategy: Strategy, train: TrainSpec, model: ModelSpec | None = None,
             runs: Strategy | None = None) -> str:
    """The tool that runs a configuration: shardwise's trainer, or for plan-only ones
    torchtitan (FSDP2 with TP/PP/selective checkpointing), DeepSpeed's pipeline engine
    (ZeRO-0/1 with PP alone), Megatron-DeepSpeed (DeepSpeed ZeRO with Megatron's TP, or
    selective recompute), Megatron-LM (its DDP with TP/PP or selective recompute); context
    parallelism alone: axolotl's ring-flash-attn (ring, allgather) or DeepSpeed's Ulysses."""
    gaps = trainer_gaps(strategy, train, model, runs)
    if not gaps:
        return TRAINER
    if gaps == [QLORA_SHARDED]:
        return FSDP_QLORA
    if all(g.endswith(f"({TRAINER} runs SFT)") for g in gaps):
        return TRL
    if all(g.endswith(" under DeepSpeed") for g in gaps):
        return DS_OWN
    if strategy.cp > 1 and strategy.tp == 1 and strategy.pp == 1:
        if strategy.cp_scheme in ("ring", "allgather"):
            return RING_FLASH
        if strategy.cp_scheme == "ulysses" and strategy.engine == "deepspeed":
            return DS_ULYSSES
    if strategy.engine == "fsdp2":
        return TORCHTITAN
    if strategy.engine == "deepspeed":
        if strategy.tp == 1 and strategy.pp > 1 and train.checkpointing in TRAINER_CHECKPOINTING:
            return DS_PIPE
        if strategy.tp > 1 and strategy.tp_scheme.name == "autotp" and train.checkpointing in TRAINER_CHECKPOINTING:
            return DS_AUTOTP
        return MEGATRON_DS
    return MEGATRON


@dataclass(frozen=True, slots=True)
class Alternative:
    """A plan-only configuration worth knowing: faster than the recommendation, or the only
    kind that fits. `why` says it in numbers (tokens/s and memory)."""

    evaluation: Evaluation
    tool: str
    gaps: tuple[str, ...]
    speedup: float | None  # tokens/s relative to the recommendation (None: nothing runnable fits)
    why: str

    def as_dict(self) -> dict:
        e = self.evaluation
        lay = e.memory.layout
        return {
            "strategy": e.strategy.name, "tp": lay.tp, "pp": lay.pp, **schedule_of(e), "cp": lay.cp, "dp": lay.dp,
            "micro_batch": e.train.micro_batch, "grad_accum": e.train.grad_accum,
            "checkpointing": e.train.checkpointing, "tool": self.tool, "needs": list(self.gaps),
            "tokens_per_s_per_gpu": e.time.tokens_per_s_per_gpu, "memory_total": e.memory.gpu.total,
            "memory_required": e.memory.gpu.required, "usable_bytes": e.memory.usable_bytes, "speedup": self.speedup, "why": self.why,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Recommendation:
    best: Evaluation
    runner_up: Evaluation | None
    candidates: int
    fitting: int
    reason: str
    # plan-only configurations (other tools) that would be faster, best first, one per tool
    alternatives: tuple[Alternative, ...] = field(default=())
    # where `best` is plan-only (a pinned strategy or layout): the best runnable configuration at
    # its tp and pp (`runnable_equivalent`)
    equivalent: Evaluation | None = None

    @property
    def runnable(self) -> bool:
        """`shardwise train` and `plan --emit` run `best` as shown (False only when the user
        pinned a TP/PP layout they cannot run)."""
        return runnable(self.best)

    @property
    def tool(self) -> str:
        return tool_for(self.best.strategy, self.best.train, self.best.model, self.best.memory.engine_strategy)

    def setting(self) -> dict:
        """The recommended configuration, as `--json` prints it (`recommended_setting`)."""
        b = self.best
        return {
            "strategy": b.strategy.name, "tp": b.memory.layout.tp, "pp": b.memory.layout.pp,
            **schedule_of(b), "cp": b.memory.layout.cp, "micro_batch": b.train.micro_batch, "grad_accum": b.train.grad_accum,
            "checkpointing": b.train.checkpointing, "precision": b.train.precision, "optimizer": b.train.optimizer,
            "optimizer_in_backward": b.train.optimizer_in_backward, "activation_offload": b.train.activation_offload,
            "runnable": self.runnable, "tool": self.tool, "needs": trainer_gaps(b.strategy, b.train, b.model, b.memory.engine_strategy),
            "tokens_per_s_per_gpu": b.time.tokens_per_s_per_gpu, "memory_total": b.memory.gpu.total,
            "memory_required": b.memory.gpu.required,
            "runnable_equivalent": None if self.equivalent is None else equivalent_dict(self.equivalent),
        }  # fmt: skip


def schedule_of(e: Evaluation) -> dict:
    """The pipeline schedule of a configuration, as `--json` names it (at pp 1 too: 1f1b, 1)."""
    return {"pp_schedule": e.strategy.pp_schedule, "pp_virtual_stages": e.strategy.pp_virtual_stages}


def equivalent_dict(e: Evaluation) -> dict:
    """`recommended_setting.runnable_equivalent`: what shardwise train runs at a plan-only layout."""
    lay = e.memory.layout
    return {"strategy": e.strategy.name, "tp": lay.tp, "pp": lay.pp, **schedule_of(e), "cp": lay.cp, "dp": lay.dp,
            "micro_batch": e.train.micro_batch, "grad_accum": e.train.grad_accum,
            "checkpointing": e.train.checkpointing, "tokens_per_s_per_gpu": e.time.tokens_per_s_per_gpu,
            "memory_total": e.memory.gpu.total, "memory_required": e.memory.gpu.required}


class NothingFits(ShardwiseError):
    """No configuration the recommender may rank fits; `alternatives` are plan-only ones that do."""

    def __init__(self, message: str, alternatives: tuple[Alternative, ...] = ()):
        super().__init__(message)
        self.alternatives = alternatives


def _complexity(e: Evaluation) -> tuple:
    lay = e.memory.layout
    return (lay.tp * lay.pp, e.strategy.pp_virtual_stages, e.strategy.facts.simplicity,
            e.train.checkpointing != "none")


# The schedules the sweep tries for PP rows when none is pinned (StrategyKnobs.pp_schedule):
# 1F1B, and for FSDP2 stages (torch.distributed.pipelining's schedules, what the trainer runs)
# interleaved 1F1B over 2 stages a rank where that schedule runs the candidate's micro-batches.
SWEPT_SCHEDULES = ({"pp_schedule": "1f1b"}, {"pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2})


def _schedules(name: str, knobs: StrategyKnobs | None, pp: int, grad_accum: int, num_layers: int) -> list[dict]:
    """The schedule fields of the sweep's candidates of strategy `name` at `pp` (at pp 1, or
    pinned by `knobs`: the one `Strategy.with_knobs` applies)."""
    if pp == 1 or (knobs is not None and knobs.pp_schedule is not None):
        return [{}]
    facts = STRATEGIES.get(name.strip().lower())
    interleaved = facts is not None and facts.engine == "fsdp2"
    return [s for s in SWEPT_SCHEDULES if s["pp_schedule"] != "interleaved-1f1b" or (
        interleaved and not schedule_refusal(pp, s["pp_schedule"], s["pp_virtual_stages"], grad_accum, num_layers))]


def sweep(model: ModelSpec, hw: HardwareSpec, base: TrainSpec, *, strategies=None,
          micro_batches=(1, 2, 4, 8), checkpointing=("none", "selective", "full"),
          tps=None, pps=None, margin: float | None = None, knobs: StrategyKnobs | None = None,
          accounting: str = "engine", base_layout: tuple[int, int] = (1, 1)) -> list[Evaluation]:
    """Every combination; the global batch (micro-batch × accumulation × dp) of `base` is kept
    where it divides, so that candidates train the same thing: `base_layout` is the (tp, pp)
    `base`'s micro-batch and accumulation are given at (the table's, a file's), whose
    data-parallel degree makes the global batch. `accounting` (`plan --accounting`) decides the
    model states, so what fits and the recommendation's memory. With the optimizer step in
    backward (no accumulation) the micro-batch is the global batch's share of each data-parallel
    rank."""
    margin = check_margin(margin)
    tps = tps or tuple(t for t in (1, 2, 4, 8) if t <= hw.gpus_per_node)
    pps = pps or tuple(p for p in (1, 2, 4) if p <= model.num_layers and hw.world_size % p == 0)
    out = []
    global_samples = base.micro_batch * base.grad_accum * max(1, hw.world_size // (base_layout[0] * base_layout[1]))
    seen_mb: dict[tuple, set[int]] = {}
    for name, mb, ck, tp, pp in itertools.product(strategies or STRATEGY_NAMES, micro_batches,
                                                  checkpointing, tps, pps):
        dp = hw.world_size // (tp * pp)
        if base.optimizer_in_backward:  # one micro-batch per step: the micro-batch is the rank's share
            mb = global_samples // dp if dp and global_samples % dp == 0 else 0
            if mb < 1 or mb in seen_mb.setdefault((name, ck, tp, pp), set()):
                continue
            seen_mb[(name, ck, tp, pp)].add(mb)
        ga = global_samples // (mb * dp) if dp and global_samples % (mb * dp) == 0 else 0
        if ga < 1:
            continue
        train = base.model_copy(update={"micro_batch": mb, "grad_accum": ga, "checkpointing": ck})
        for schedule in _schedules(name, knobs, pp, ga, model.num_layers):
            try:
                s = Strategy.with_knobs(name, knobs, tp=tp, pp=pp, **schedule)
                out.append(evaluate(model, hw, train, s, accounting=accounting, margin=margin))
            except ShardwiseError:
                continue  # layout impossible for this model/hardware: not a candidate
    return out


def _rank(fitting: list[Evaluation]) -> Evaluation:
    """Fastest, or among those within NEAR_TIE of it the simplest."""
    top = max(e.time.tokens_per_s_per_gpu for e in fitting)
    near = [e for e in fitting if e.time.tokens_per_s_per_gpu >= top * (1 - NEAR_TIE)]
    return min(near, key=lambda e: (_complexity(e), -e.time.tokens_per_s_per_gpu))


def recommend(model: ModelSpec, hw: HardwareSpec, base: TrainSpec, *, savers: bool = True, **kw) -> Recommendation:
    """The best runnable configuration of the sweep (`sweep`'s keywords: `strategies`, `tps`,
    `pps`, ... restrict it), the runner-up, and the plan-only alternatives that beat it.

    When the sweep holds no runnable candidate at all (the caller pinned tp or pp above 1), the
    best of the pinned layouts is recommended and marked plan-only (`Recommendation.runnable`).
    Where nothing eligible fits, `savers` adds the memory savers (SAVERS) the trainer runs, the
    fewest that make a run fit, and says so in the reason; else raises `NothingFits` (with the
    plan-only configurations that do fit).
    """
    evals = sweep(model, hw, base, **kw)
    ours = [e for e in evals if runnable(e)]
    eligible, others = (ours, [e for e in evals if not runnable(e)]) if ours else (evals, [])
    fitting = [e for e in eligible if e.fits]
    if not fitting:
        alts = _alternatives(None, others)
        saved = with_savers(model, hw, base, **kw) if savers and ours else None
        if saved is not None:
            return saved
        raise NothingFits(_nothing_fits(model, hw, eligible, plan_only=not ours) + _alt_clause(alts), alts)
    best = _rank(fitting)
    rivals = [e for e in fitting if e.strategy.name != best.strategy.name]
    runner = max(rivals, key=lambda e: e.time.tokens_per_s_per_gpu) if rivals else None
    alts = _alternatives(best, others)
    reason = explain_choice(model, hw, best, runner, eligible)
    equivalent = None
    if not ours:
        reason += (f" Plan-only: shardwise train and --emit run data parallelism, tensor parallelism with FSDP2 "
                   f"or ZeRO-1/2 and pipeline parallelism with FSDP2 (no or full checkpointing); {_describe(best)} "
                   f"needs {' and '.join(trainer_gaps(best.strategy, best.train, model))}: "
                   f"run it with {tool_for(best.strategy, best.train, model)}.")
        equivalent = runnable_equivalent(model, hw, base, best, **kw)
        if equivalent is not None:
            t = equivalent.time.tokens_per_s_per_gpu
            reason += (f" shardwise train runs the same layout as {_describe(equivalent)}: {rate(t)} tokens/s per "
                       f"GPU ({t / best.time.tokens_per_s_per_gpu - 1:+.0%}), "
                       f"{equivalent.memory.gpu.total / GIB:.1f} GiB per GPU.")
    return Recommendation(best, runner, len(eligible), len(fitting), reason, alts, equivalent)


def runnable_equivalent(model: ModelSpec, hw: HardwareSpec, base: TrainSpec, e: Evaluation,
                        **kw) -> Evaluation | None:
    """The best fitting configuration `shardwise train` runs at the layout of the plan-only `e`
    (its tp and pp), over every strategy (`sweep`'s other keywords kept): what to run instead of a
    DeepSpeed or DDP pipeline, or of another tool's TP. None where none fits."""
    lay = e.memory.layout
    kw = kw | {"strategies": None, "tps": (lay.tp,), "pps": (lay.pp,)}
    fitting = [x for x in sweep(model, hw, base, **kw) if x.fits and runnable(x)]
    return _rank(fitting) if fitting else None


@dataclass(frozen=True, slots=True)
class Saver:
    """A memory saver the recommender may add when nothing fits: the TrainSpec fields it sets,
    and how the reason names it (its flag and YAML key)."""

    name: str
    fields: dict
    says: str


# Tried in this order, each on top of those before it (torchtune's ladder: optimizer step in
# backward, activation offloading, 8-bit AdamW, under pure bf16), the ones that keep the run's
# numbers first; paged 8-bit states replace the on-GPU ones last. What a fitting rung does not
# need is dropped again (`with_savers`).
SAVERS = (
    Saver("in_backward", {"optimizer_in_backward": True},
          "the optimizer step in backward (--optimizer-in-backward, YAML optimizer.in_backward: each parameter "
          "updated as soon as its gradient is final, so no step holds every gradient; no clipping by the global "
          "norm, one micro-batch per step)"),
    Saver("offload", {"activation_offload": True},
          "activation offloading (--activation-offload, YAML checkpointing.offload: the saved activations wait in "
          "pinned host memory, copied beside the compute)"),
    Saver("adamw8bit", {"optimizer": "adamw8bit"},
          "8-bit AdamW states (--optimizer adamw8bit, YAML optimizer.name: block-quantized moments, 2.03 bytes "
          "per parameter instead of 8)"),
    Saver("bf16-pure", {"precision": "bf16-pure"},
          "pure bf16 (--precision bf16-pure: weights, gradients and AdamW states in bf16, no fp32 master "
          "weights; updates below bf16's resolution are lost)"),
    Saver("paged", {"optimizer": "paged_adamw8bit"},
          "paged 8-bit AdamW states (--optimizer paged_adamw8bit: bitsandbytes keeps them in CUDA unified "
          "memory, paged to the host when the GPU needs the room)"),
)


def with_savers(model: ModelSpec, hw: HardwareSpec, base: TrainSpec, **kw) -> Recommendation | None:
    """What fits with the fewest memory savers (SAVERS, in order, each rung on top of the ones
    before; then each earlier rung the fitting one does not need is dropped), where nothing fits
    with the user's settings; None when the whole ladder does not fit either."""
    def attempt(rungs: list[Saver]) -> Recommendation | None:
        fields: dict = {}
        for r in rungs:
            fields |= r.fields
        if all(getattr(base, k) == v for k, v in fields.items()):
            return None  # the user's own settings: already swept
        try:
            rec = recommend(model, hw, base.model_copy(update=fields), savers=False, **kw)
        except (NothingFits, ShardwiseError):
            return None
        return rec if rec.runnable else None

    rungs: list[Saver] = []
    found = None
    for saver in SAVERS:
        rungs = [r for r in rungs if r.fields.keys() != saver.fields.keys()] + [saver]  # paged replaces 8-bit
        found = attempt(rungs)
        if found is not None:
            break
    if found is None:
        return None
    for r in list(rungs[:-1]):
        fewer = [x for x in rungs if x is not r]
        if (rec := attempt(fewer)) is not None:
            rungs, found = fewer, rec
    said = "; ".join(r.says for r in rungs)
    reason = f"{found.reason} It fits only with {said}: nothing fits with the settings as given."
    return replace(found, reason=reason)


def _nothing_fits(model: ModelSpec, hw: HardwareSpec, evals: list[Evaluation], plan_only: bool) -> str:
    smallest = min(evals, key=lambda e: e.memory.gpu.required) if evals else None
    need = ""
    if smallest:
        m = smallest.memory
        need = (f"; the smallest, {_describe(smallest)}, needs {m.gpu.required / GIB:.1f} GiB per GPU "
                f"(usable {m.usable_bytes / GIB:.1f}) and {m.host.peak / GIB:.0f} GiB of host memory per node "
                f"(have {m.host_capacity_bytes / GIB:.0f})")
    what = "" if plan_only else " that shardwise can train"
    return (f"no configuration of {model.name}{what} fits {hw.world_size}× {hw.gpu.name} "
            f"({hw.gpu.memory_bytes / GIB:.0f} GiB){need}: add GPUs, use LoRA, or a larger GPU")


def _alt_clause(alts: tuple[Alternative, ...]) -> str:
    if not alts:
        return ""
    return "; plan-only configurations that fit: " + "; ".join(a.why for a in alts)


def _alternatives(best: Evaluation | None, others: list[Evaluation]) -> tuple[Alternative, ...]:
    """The fastest fitting plan-only configuration of each tool that beats `best` by more than
    NEAR_TIE (all tools' fastest when `best` is None: nothing runnable fits), fastest first."""
    by_tool: dict[str, list[Evaluation]] = {}
    for e in others:
        if e.fits:
            by_tool.setdefault(tool_for(e.strategy, e.train, e.model, e.memory.engine_strategy), []).append(e)
    out = []
    for tool, group in by_tool.items():
        e = _rank(group)
        t = e.time.tokens_per_s_per_gpu
        speedup = t / best.time.tokens_per_s_per_gpu if best else None
        if speedup is not None and speedup <= 1 + NEAR_TIE:
            continue
        gaps = tuple(trainer_gaps(e.strategy, e.train, e.model, e.memory.engine_strategy))
        m = e.memory
        vs = ""
        if best is not None and speedup is not None:
            vs = (f" ({speedup - 1:+.0%} vs the recommended {rate(best.time.tokens_per_s_per_gpu)}, which uses "
                  f"{best.memory.gpu.total / GIB:.1f} GiB)")
        why = (f"{_describe(e)} with {tool}: {rate(t)} tokens/s per GPU{vs}, {m.gpu.total / GIB:.1f} of "
               f"{m.usable_bytes / GIB:.1f} usable GiB per GPU; plan-only because shardwise train lacks "
               f"{' and '.join(gaps)}")
        out.append(Alternative(e, tool, gaps, speedup, why))
    out.sort(key=lambda a: -a.evaluation.time.tokens_per_s_per_gpu)
    return tuple(out)


def _describe(e: Evaluation) -> str:
    lay, s = e.memory.layout, e.strategy
    schedule = s.pp_schedule + (f"×{s.pp_virtual_stages}" if s.pp_virtual_stages > 1 else "")
    extra = (f" tp{lay.tp}" if lay.tp > 1 else "") + (f" cp{lay.cp}" if lay.cp > 1 else "") + (
        f" pp{lay.pp} {schedule}" if lay.pp > 1 else "")
    return (f"{e.strategy.name}{extra} (micro-batch {e.train.micro_batch} × accum {e.train.grad_accum}, "
            f"checkpointing {e.train.checkpointing})")


def describe(e: Evaluation) -> str:
    """`zero2 (micro-batch 2 × accum 4, checkpointing full)`: how the reason names a configuration."""
    return _describe(e)


def explain_choice(model: ModelSpec, hw: HardwareSpec, best: Evaluation, runner: Evaluation | None,
                   evals: list[Evaluation]) -> str:
    m, t = best.memory, best.time
    lines = [
        f"{_describe(best)}: {rate(t.tokens_per_s_per_gpu)} tokens/s per GPU, MFU {t.mfu:.0%}, "
        f"{m.gpu.total / GIB:.1f} of {m.capacity_bytes / GIB:.1f} GiB per GPU.",
    ]
    if t.exposed_fraction > 0.3:
        lines.append(f"Binding constraint: communication — {t.exposed_comm_s:.2f} s of the {t.step_s:.2f} s step "
                     f"is exposed ({best.comm.total / 1e9:.1f} GB moved per GPU per step).")
    elif t.offload_s > 0.3 * t.step_s:
        lines.append(f"Binding constraint: offload — {t.offload_s:.2f} s of the {t.step_s:.2f} s step is "
                     f"PCIe transfers and the CPU optimizer.")
    else:
        lines.append(f"Binding constraint: compute ({t.compute_s:.2f} s of a {t.step_s:.2f} s step); memory leaves "
                     f"{(m.usable_bytes - m.gpu.required) / GIB:.1f} GiB of head room.")
    non_fit = {e.strategy.name for e in evals} - {e.strategy.name for e in evals if e.fits}
    if non_fit:
        lines.append(f"Do not fit in any swept setting: {', '.join(sorted(non_fit, key=lambda n: STRATEGIES[n].simplicity))}.")
    if runner:
        r = runner.time
        lines.append(f"Runner-up: {_describe(runner)} at {rate(r.tokens_per_s_per_gpu)} tokens/s per GPU "
                     f"({r.tokens_per_s_per_gpu / t.tokens_per_s_per_gpu - 1:+.1%}).")
        lines.append(_what_flips(model, hw, best, runner))
    return " ".join(lines)


def _scaled_links(hw: HardwareSpec, factor: float) -> HardwareSpec:
    return hw.model_copy(update={
        link: getattr(hw, link).model_copy(update={"bus_bytes_per_s": getattr(hw, link).bus_bytes_per_s * factor})
        for link in ("intra", "inter")
    })


def _what_flips(model: ModelSpec, hw: HardwareSpec, best: Evaluation, runner: Evaluation) -> str:
    """Scale the interconnect bandwidth (up first, then down) until the runner-up overtakes."""
    for factor in (2, 4, 8, 16, 0.5, 0.25, 0.1):
        scaled = _scaled_links(hw, factor)
        b = evaluate(model, scaled, best.train, best.strategy).time.tokens_per_s_per_gpu
        r = evaluate(model, scaled, runner.train, runner.strategy).time.tokens_per_s_per_gpu
        if r > b:
            return (f"With {factor:g}× the bandwidth, {runner.strategy.name} would win "
                    f"({rate(r)} vs {rate(b)} tokens/s per GPU).")
    return "No bandwidth between 0.1× and 16× flips the ranking."
