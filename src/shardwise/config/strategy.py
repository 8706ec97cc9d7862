"""The strategies a run may name and their engine knobs: one table of what each strategy
shards and offloads (`STRATEGIES`), and the DeepSpeed, FSDP2 and DDP settings that change
memory or traffic. The training YAML's `strategy:` section, `plan`'s flags and the planner's
`Strategy` all read these classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from shardwise.config.base import Spec
from shardwise.config.fields import DTYPE_BYTES
from shardwise.errors import ShardwiseError

Engine = Literal["ddp", "deepspeed", "fsdp2"]
FsdpSharding = Literal["full", "grad-op", "hybrid"]
# Which FSDP2 units free their params after forward (and gather them again in backward): "all"
# (stock `fully_shard(reshard_after_forward=True)` on every layer and on the root, as torchtune
# ran it before its commit cdde80e: the root is then gathered again in backward too,
# Strategy.reshards_root), "layers" (every decoder layer, the root kept: FSDP1's FULL_SHARD, whose
# `_post_forward_reshard` never frees the root's flat parameter; torchtune's shard_model since,
# which passes reshard_after_forward=False to the root), "not-last" (every layer but the last, the first that
# backward needs: torchtitan's and shardwise's trainer's), "none" (every layer stays gathered
# from forward to backward: ZeRO-2's parameter memory; the fsdp-grad-op strategy). Except under
# "all", the root keeps its params gathered after forward (the trainer passes False; torch does
# the same for a root left None: `_fsdp_state.py` `_lazy_init`).
Resharding = Literal["all", "layers", "not-last", "none"]
# The implementation of a zero1 row's sharded optimizer (Strategy.zero_impl): DeepSpeed's ZeRO
# stage 1 (the trainer's), or Megatron-Core's distributed optimizer (`--use-distributed-optimizer`:
# a gradient buffer the size of the model, fp32 for bf16 runs, reduce-scattered into the shards
# whose fp32 main params and Adam states each rank keeps; the updated params all-gathered into
# the module's own buffer). Plan-only: the published Megatron-LM and Megatron-SWIFT runs.
ZeroImpl = Literal["deepspeed", "megatron"]
# The pipeline schedules (strategy.pp_schedule): torch.distributed.pipelining's ScheduleGPipe,
# Schedule1F1B and ScheduleInterleaved1F1B (shardwise.specs.pipeline).
PPSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
PP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")
# How context parallelism (strategy.cp) exchanges keys and values (shardwise.plan.context):
# "torch" (torch.distributed.tensor.experimental.context_parallel, torchtitan's and accelerate's),
# "ring" (a p2p ring overlapped with each chunk's attention: Megatron-Core/Transformer Engine,
# ring-flash-attn), "allgather" (the Llama 3 paper's: K/V all-gathered, their gradients
# reduce-scattered; ring-flash-attn's llama3 varlen), "ulysses" (DeepSpeed Ulysses: all-to-alls
# that trade the sequence split for a head split around attention); "auto": the engine's own
# (DeepSpeed: ulysses, torch's engines: torch).
CPImpl = Literal["auto", "torch", "ring", "allgather", "ulysses"]
CP_IMPLS: tuple[str, ...] = ("auto", "torch", "ring", "allgather", "ulysses")


def virtual_refusal(schedule: str, virtual: int) -> str | None:
    """Why `schedule` does not run `virtual` stages per pipeline rank (None: it does): several
    stages a rank are interleaved 1F1B's, which runs at least 2; gpipe and 1f1b run one."""
    if schedule not in PP_SCHEDULES:
        return f"pp_schedule {schedule!r}: expected one of {', '.join(PP_SCHEDULES)}"
    if virtual > 1 and schedule != "interleaved-1f1b":
        return (f"pp_virtual_stages {virtual} with pp_schedule {schedule!r}: virtual stages (several stages per "
                "rank) are interleaved 1F1B's")
    if schedule == "interleaved-1f1b" and virtual < 2:
        return "pp_schedule 'interleaved-1f1b' runs at least 2 stages per rank: set pp_virtual_stages ≥ 2"
    return None



@dataclass(frozen=True, slots=True)
class StrategyFacts:
    """One row of the strategy table.

    shards_*: whether that model state is split over the data-parallel shard group (else every
    rank holds all of it). zero_equivalent: the ZeRO stage with the same sharding (FSDP grad-op
    keeps params unsharded between forward and backward: 2; full/hybrid: 3). simplicity: rank
    for the recommender's near-tie rule (fewer moving parts, fewer knobs, easier checkpoints
    first). combines_with_pp: DeepSpeed's PipelineEngine refuses ZeRO-2/3
    (deepspeed/runtime/pipe/engine.py asserts `zero_optimization_stage() < 2`); DDP, ZeRO-0/1
    and FSDP2 (torchtitan) run under pipeline stages. trainer: `shardwise train` runs it.
    """

    engine: Engine
    zero_stage: int | None
    fsdp_sharding: FsdpSharding | None
    offload_optimizer: bool
    offload_params: bool
    shards_optimizer: bool
    shards_grads: bool
    shards_params: bool
    zero_equivalent: int
    simplicity: int
    combines_with_pp: bool
    trainer: bool = True


def _row(engine: Engine, stage: int | None, fsdp: FsdpSharding | None, off_opt: bool, off_par: bool,
         simplicity: int) -> StrategyFacts:
    zero = stage if stage is not None else {"full": 3, "hybrid": 3, "grad-op": 2}[fsdp] if fsdp else 0
    return StrategyFacts(
        engine=engine, zero_stage=stage, fsdp_sharding=fsdp, offload_optimizer=off_opt, offload_params=off_par,
        shards_optimizer=zero >= 1, shards_grads=zero >= 2, shards_params=zero >= 3 or fsdp is not None,
        zero_equivalent=zero, simplicity=simplicity, combines_with_pp=zero <= 1 or engine == "fsdp2",
    )


# name -> facts; `simplicity` is the recommender's near-tie order (simpler first).
STRATEGIES: dict[str, StrategyFacts] = {
    "ddp": _row("ddp", None, None, False, False, 0),
    "zero0": _row("deepspeed", 0, None, False, False, 1),
    "zero1": _row("deepspeed", 1, None, False, False, 2),
    "zero2": _row("deepspeed", 2, None, False, False, 3),
    "zero3": _row("deepspeed", 3, None, False, False, 6),
    "fsdp": _row("fsdp2", None, "full", False, False, 5),
    "fsdp-grad-op": _row("fsdp2", None, "grad-op", False, False, 4),
    "fsdp-hybrid": _row("fsdp2", None, "hybrid", False, False, 7),
    "zero1+opt-offload": _row("deepspeed", 1, None, True, False, 8),
    "zero2+opt-offload": _row("deepspeed", 2, None, True, False, 9),
    "zero3+opt-offload": _row("deepspeed", 3, None, True, False, 10),
    "zero3+full-offload": _row("deepspeed", 3, None, True, True, 12),
    # CPUOffloadPolicy moves params, grads and the optimizer step to the host
    "fsdp+offload": _row("fsdp2", None, "full", True, True, 11),
}
STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)


# DeepSpeed's own cap on a leaf it picks by granularity (parameter_offload.py Z3_MAX_LEAF_SIZE):
# a larger leaf would hold too many gathered parameters at once.
Z3_MAX_LEAF_PARAMS = 1_000_000_000
# The largest element count a knob takes: past any model (the largest trained have ~2e12
# parameters), small enough that its bytes stay exact in a float (2^53 ≈ 9e15).
MAX_KNOB_ELEMENTS = 10**15
# Every knob is finite: NaN or ±inf is no bucket size (a flag, a --from file and a YAML alike).
FINITE = ConfigDict(allow_inf_nan=False)


class DeepSpeedKnobs(Spec):
    """DeepSpeed ZeRO config keys that change memory or traffic. Defaults are DeepSpeed's own
    (`deepspeed/runtime/zero/config.py` DeepSpeedZeroConfig; tests/run/test_run_bridge.py checks
    them against the installed DeepSpeed), except `fetch_unit`, which shardwise chooses."""

    model_config = FINITE

    reduce_bucket_size: int = Field(500_000_000, gt=0, le=MAX_KNOB_ELEMENTS, description="gradient reduce bucket (elements)")
    allgather_bucket_size: int = Field(500_000_000, gt=0, le=MAX_KNOB_ELEMENTS, description="ZeRO-1/2 param all-gather bucket")
    overlap_comm: bool | None = Field(None, description="None = DeepSpeed's default: on for stage 3 only")
    contiguous_gradients: bool = Field(True, description="copy grads into one contiguous buffer")
    reduce_scatter: bool = Field(True, description="ZeRO-1/2: reduce-scatter instead of all-reduce")
    use_multi_rank_bucket_allreduce: bool = Field(True, description="ZeRO-1/2: all-reduce buckets "
                                                  "(false: reduce to the owning rank)")
    prefetch_bucket_size: int = Field(50_000_000, ge=0, le=MAX_KNOB_ELEMENTS, description="ZeRO-3 prefetch (elements)")
    max_live_parameters: int = Field(1_000_000_000, ge=0, le=MAX_KNOB_ELEMENTS, description="ZeRO-3 gathered params cap")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, le=MAX_KNOB_ELEMENTS, description="ZeRO-3: keep params reused within")
    param_persistence_threshold: int = Field(100_000, ge=0, le=MAX_KNOB_ELEMENTS, description="ZeRO-3: smaller params stay whole")
    # "auto" = DeepSpeed's default, the parameter dtype (bf16 under bf16 mixed precision);
    # shardwise's trainer defaults to "fp32" for loss parity (docs/training.md).
    communication_data_type: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="gradient reduction dtype")
    # ZeRO-3's fetch/release unit. DeepSpeed's default hooks every submodule (each Linear and
    # norm, ~12 per decoder layer), each hook a Python fetch/release with its trace bookkeeping.
    # "layer" flags each decoder layer a ZeRO-3 leaf (`zero_optimization.leaf_module`): one
    # fetch per layer and pass, FSDP2's unit. "auto": layer when a layer fits both the
    # gathered-parameter cap and DeepSpeed's leaf cap, else module (docs/reference.md "ZeRO-3's fetch unit").
    fetch_unit: Literal["auto", "layer", "module"] = Field(
        "auto", description="ZeRO-3 fetch unit: decoder layer or every submodule (DeepSpeed's default)")

    def overlap(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    def zero3_unit(self, layer_params: float) -> Literal["layer", "module"]:
        """The fetch unit ZeRO-3 runs with for decoder layers of `layer_params` parameters each
        (per tensor-parallel rank), against the caps."""
        if self.fetch_unit != "auto":
            return self.fetch_unit
        return "layer" if layer_params <= min(self.max_live_parameters, Z3_MAX_LEAF_PARAMS) else "module"

    def reduce_bytes(self, compute_bytes: int) -> int:
        """Bytes per gradient element DeepSpeed reduces in."""
        dtype = self.communication_data_type
        return compute_bytes if dtype == "auto" else DTYPE_BYTES[dtype]


class FSDPKnobs(Spec):
    """FSDP2 settings that change memory or traffic (`fully_shard` / `MixedPrecisionPolicy`)."""

    model_config = FINITE

    # torch's default reduce_dtype is the param dtype; fp32 keeps the reduce-scatter of bf16
    # grads from rounding every partial sum (shardwise's default, the planner counts 4 bytes).
    reduce_dtype: Literal["fp32", "param"] = Field("fp32", description="gradient reduce-scatter dtype")
    # torch's default (`set_requires_gradient_sync` left on) reduce-scatters every micro-batch
    # into the sharded grads (true); false turns sync off on all but the last micro-batch: one
    # reduce-scatter per step, unsharded reduce_dtype grads held in between (accelerate's and HF
    # Trainer's no_sync). "auto" holds them only where that plan fits and is planned faster
    # (shardwise.plan.grad_sync: the planner and the trainer decide there, with the same specs).
    reduce_every_micro_batch: Literal["auto"] | bool = Field(
        "auto", description="with accumulation: reduce-scatter every micro-batch (true: torch's default) or hold "
        "the unsharded grads and reduce once per step (false); auto holds them where that fits and is faster")
    # Resharding (above). fsdp-grad-op is "none" by definition; an explicit other value there
    # is refused (Strategy._check).
    reshard_after_forward: Resharding = Field(
        "not-last", description="units freed after forward: all (stock fully_shard: every layer and the root), "
        "layers (every decoder layer, the root kept: FSDP1 FULL_SHARD), not-last (the trainer's: the last layer "
        "and the root stay gathered for backward) or none (fsdp-grad-op)")
    # The root unit (embeddings, final norm and lm_head: what fsdp.wrap_embeddings leaves of them)
    # after forward. "auto" follows reshard_after_forward: freed under "all" only. true frees it
    # beside any layer policy, as torchtitan does at pp 1 (`fully_shard(model,
    # reshard_after_forward=not pp_enabled)` after its not-last layers: parallelize_llama.py
    # apply_fsdp at 9dec370); it is gathered again as backward starts, and a loss computed on the
    # returned logits runs without it. false keeps it gathered from forward into backward.
    reshard_root: Literal["auto"] | bool = Field(
        "auto", description="the root unit after forward: freed (true, torchtitan's), kept (false), or auto "
        "(freed under reshard_after_forward all only)")

    # The token embedding and the head (final norm + lm_head) as FSDP2 units of their own, out of
    # the root: each is gathered only around its own forward and backward, and lm_head's
    # gradient is reduce-scattered as soon as its backward ends instead of at the end of
    # backward (torchtune's `custom_sharded_layers: ['tok_embeddings', 'output']` in its full
    # fine-tuning configs; accelerate 1.16's `fsdp2_prepare_model`, which keeps the head gathered
    # after forward). The embedding unit reshards after forward as the decoder layers do, the
    # head as the root does. Tied embeddings stay in the root (one parameter, one unit); under
    # pipeline parallelism each stage keeps its root whole.
    wrap_embeddings: bool = Field(
        False, description="embeddings and the head (final norm + lm_head) as fully_shard units of their own "
        "(torchtune's custom_sharded_layers); untied models at pp 1")

    # A shard group of one rank (one GPU, or fsdp-hybrid with shard_group 1) shards nothing, yet
    # `fully_shard` still casts and copies every parameter into its unsharded buffer at each
    # all-gather and copies each gradient through its reduce-scatter buffer (torch 2.13
    # `_fsdp_param_group.wait_for_unshard`, `foreach_reduce`), and pays its hooks per layer.
    # "ddp": run such a group as DDP does (fp32 module under autocast, gradients all-reduced
    # over the replicas), as torchtitan does with dp_shard 1. "fsdp": fully_shard anyway
    # (its resharding frees the bf16 weights between forward and backward). "auto": ddp where
    # that plan fits and is planned no slower, else fsdp (docs/reference.md "One-rank shard groups").
    single_rank: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="a one-rank shard group runs as: ddp (no fully_shard), fsdp, or auto (ddp where it fits)")

    def reduce_bytes(self, param_bytes: int) -> int:
        return 4 if self.reduce_dtype == "fp32" else param_bytes


# A DDP bucket past 1 TiB is no bucket (torch holds it as int bytes: int(mb * 2**20)).
MAX_DDP_BUCKET_MB = float(1 << 20)


class DDPKnobs(Spec):
    """torch DDP settings that change memory or traffic."""

    model_config = FINITE

    bucket_cap_mb: float = Field(25.0, gt=0, le=MAX_DDP_BUCKET_MB, description="all-reduce bucket size (MiB; torch's default 25)")
    gradient_as_bucket_view: bool = Field(True, description="grads alias the buckets (no second copy)")
    # One replica has nothing to all-reduce, but DistributedDataParallel still hooks every
    # parameter and keeps its gradient buckets allocated across steps. shardwise runs the bare
    # module there, as torchtitan (no replicate dim) and torchtune's single-device recipes do:
    # the grads then exist only from backward to the step. True keeps torch's wrapper.
    wrap_one_rank: bool = Field(False, description="wrap in DistributedDataParallel even with one replica")

    def wrapped(self, replicas: int) -> bool:
        """Whether the model runs inside DistributedDataParallel with `replicas` data-parallel ranks."""
        return replicas > 1 or self.wrap_one_rank


class StrategyKnobs(Spec):
    """The engine knobs of a plan, apart from the strategy name: what `shardwise plan --ds-*`
    flags set and what a sweep applies to every candidate."""

    shard_group: int | None = Field(None, gt=0)
    # "megatron": plan the TP rows of DeepSpeed and DDP strategies as Megatron-LM's / Megatron-DeepSpeed's
    # (FSDP2's stay DTensor's: torchtitan); "auto": each engine's own (Strategy.tp_scheme)
    tp_impl: Literal["auto", "megatron"] = "auto"
    # Which implementation runs the zero1 rows' sharded optimizer (Strategy.zero_impl; plan-only
    # for "megatron"): DeepSpeed's ZeRO stage 1, or Megatron-Core's distributed optimizer
    zero_impl: ZeroImpl = "deepspeed"
    # Megatron-Core's gradient buffer (and its reduce-scatter) in bf16 for a bf16 run (zero_impl
    # megatron only; Strategy.grad_reduce_in_bf16): None = Megatron-LM's default, fp32
    grad_reduce_in_bf16: bool | None = None
    # The schedule of the PP rows (Strategy.pp_schedule / pp_virtual_stages; at pp 1 nothing):
    # None = 1f1b in the table, and the sweep tries 1f1b and, where it runs, interleaved-1f1b
    # over 2 stages a rank (shardwise.plan.recommend.sweep)
    pp_schedule: PPSchedule | None = None
    pp_virtual_stages: int | None = Field(None, gt=0)
    # Context parallelism of every row (Strategy.cp / cp_impl); None: 1, and the engine's own
    cp: int | None = Field(None, gt=0)
    cp_impl: CPImpl | None = None
    cp_load_balance: bool | None = None
    # Expert parallelism of MoE models (Strategy.ep, ep_load_imbalance, etp; plan-only): None = 1,
    # and for etp the engine's (Strategy.expert_tp)
    ep: int | None = Field(None, gt=0)
    ep_load_imbalance: float | None = Field(None, ge=1.0, allow_inf_nan=False)
    etp: int | None = Field(None, gt=0)
    ep_overlap: bool | None = None
    ds: DeepSpeedKnobs = DeepSpeedKnobs()
    fsdp: FSDPKnobs = FSDPKnobs()
    ddp: DDPKnobs = DDPKnobs()

    @model_validator(mode="after")
    def _schedule(self) -> StrategyKnobs:
        if self.pp_schedule is not None or self.pp_virtual_stages is not None:
            why = virtual_refusal(self.pp_schedule or "1f1b", self.pp_virtual_stages or 1)
            if why:
                raise ShardwiseError(why)
        return self
