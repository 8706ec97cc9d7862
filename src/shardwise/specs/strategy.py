"""Strategy: which engine, how it shards, what it offloads, and every engine knob that changes
memory or traffic. One table holds the facts of each named strategy; the planner, the layout,
the trainer and the emitters read its columns instead of re-deriving them from the engine name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, model_validator

from shardwise.errors import ShardwiseError, did_you_mean
from shardwise.specs.base import Spec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.train import DTYPE_BYTES

if TYPE_CHECKING:
    from shardwise.specs.model import ModelSpec

Engine = Literal["ddp", "deepspeed", "fsdp2"]
FsdpSharding = Literal["full", "grad-op", "hybrid"]
# Which decoder-layer units FSDP2 frees after forward (and gathers again in backward): "all"
# (stock `fully_shard(reshard_after_forward=True)`, what accelerate, HF Trainer and torchtune
# run), "not-last" (every layer but the last, the first that backward needs: torchtitan's and
# shardwise's trainer's), "none" (every layer stays gathered from forward to backward: ZeRO-2's
# parameter memory; the fsdp-grad-op strategy). The root unit never reshards after forward:
# torch forces it off (`_fsdp_state.py` `_lazy_init`, the root's `post_forward_mesh_info = None`).
Resharding = Literal["all", "not-last", "none"]


# How the TP dimension splits the model (`TPScheme`): "auto" takes the engine's own (`Strategy.tp_scheme`).
TPImpl = Literal["auto", "dtensor", "megatron", "autotp"]


@dataclass(frozen=True, slots=True)
class TPScheme:
    """What a tensor-parallel implementation splits, and how, as memory, traffic and time read it.

    sequence_parallel: the norms and residual stream are split over the TP ranks along the
    sequence (Korthikanti et al. 2022 §4.2.2), the blocks' all-reduces become all-gather +
    reduce-scatter pairs. vocab_parallel: the embedding and lm_head are split over the vocabulary
    and the loss reduces across the shards (Megatron's vocab-parallel cross-entropy, torch's
    `loss_parallel`); else they are whole on every TP rank, and so are the logits.
    saves_gathered_input: a column-parallel linear saves its all-gathered input (DTensor's
    ColwiseParallel) instead of its sequence-sharded one (Megatron-SP re-gathers it in backward).
    reduces_per_linear: backward all-reduces each column-parallel linear's input gradient on its
    own (AutoTP's `LinearLayer`: q, k, v, gate and up each), not once per block (Megatron's
    `copy_to_tensor_model_parallel_region` ahead of the fused projections)."""

    name: str
    sequence_parallel: bool
    vocab_parallel: bool
    saves_gathered_input: bool
    reduces_per_linear: bool


TP_SCHEMES: dict[str, TPScheme] = {
    # torch DTensor `parallelize_module` (shardwise.train.tensor_parallel, torchtitan's parallelize_llama)
    "dtensor": TPScheme("dtensor", sequence_parallel=True, vocab_parallel=True, saves_gathered_input=True,
                        reduces_per_linear=False),
    # Megatron-LM (and Megatron-DeepSpeed) with --sequence-parallel: the published Megatron rows
    "megatron": TPScheme("megatron", sequence_parallel=True, vocab_parallel=True, saves_gathered_input=False,
                         reduces_per_linear=False),
    # DeepSpeed AutoTP training (`tensor_parallel.autotp_size`, shardwise.run.deepspeed.autotp_section):
    # the decoder linears only; no sequence parallelism; embedding, norms and lm_head whole
    "autotp": TPScheme("autotp", sequence_parallel=False, vocab_parallel=False, saves_gathered_input=False,
                       reduces_per_linear=True),
}


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
    (`deepspeed/runtime/zero/config.py` DeepSpeedZeroConfig; tests/test_run_bridge.py checks
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
    # norm, ~12 per decoder layer), each hook a Python fetch/release with its trace bookkeeping:
    # on one H200, qwen2.5-0.5b under ZeRO-3 ran at a third of ZeRO-2's tokens/s, bound by them.
    # "layer" flags each decoder layer a ZeRO-3 leaf (`zero_optimization.leaf_module`): one
    # fetch per layer and pass, FSDP2's unit. "auto": layer when a layer fits both the
    # gathered-parameter cap and DeepSpeed's leaf cap, else module (docs/reference.md).
    fetch_unit: Literal["auto", "layer", "module"] = Field(
        "auto", description="ZeRO-3 fetch unit: decoder layer or every submodule (DeepSpeed's default)")

    def overlap(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    def zero3_unit(self, model: ModelSpec, tp: int = 1) -> Literal["layer", "module"]:
        """The fetch unit ZeRO-3 runs with for `model`'s decoder layers (their parameters per
        tensor-parallel rank against the caps)."""
        if self.fetch_unit != "auto":
            return self.fetch_unit
        return "layer" if model.params_per_layer / tp <= min(self.max_live_parameters, Z3_MAX_LEAF_PARAMS) else "module"

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
    # into the sharded grads; shardwise's trainer turns sync off on all but the last
    # micro-batch: one reduce-scatter per step, unsharded reduce_dtype grads held in between.
    reduce_every_micro_batch: bool = Field(False, description="with accumulation: reduce-scatter every "
                                           "micro-batch (torch's default) instead of once per step")
    # Resharding (above). fsdp-grad-op is "none" by definition; an explicit other value there
    # is refused (Strategy._check).
    reshard_after_forward: Resharding = Field(
        "not-last", description="decoder layers freed after forward: all (stock fully_shard), not-last "
        "(the trainer's: the last layer stays gathered for backward) or none (fsdp-grad-op)")

    # A shard group of one rank (one GPU, or fsdp-hybrid with shard_group 1) shards nothing, yet
    # `fully_shard` still casts and copies every parameter into its unsharded buffer at each
    # all-gather and copies each gradient through its reduce-scatter buffer (torch 2.13
    # `_fsdp_param_group.wait_for_unshard`, `foreach_reduce`), and pays its hooks per layer.
    # "ddp": run such a group as DDP does (fp32 module under autocast, gradients all-reduced
    # over the replicas), as torchtitan does with dp_shard 1; one H200, qwen2.5-0.5b: 53.9k
    # tokens/s under (wrapped) DDP vs 45.3k under FSDP2, +4.5 GB. "fsdp": fully_shard anyway
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
    # the grads then exist only from backward to the step. True keeps torch's wrapper (the
    # H200 measurements of 2026-11-30 ran with it).
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
    ds: DeepSpeedKnobs = DeepSpeedKnobs()
    fsdp: FSDPKnobs = FSDPKnobs()
    ddp: DDPKnobs = DDPKnobs()


class Strategy(Spec):
    """A named strategy (a row of STRATEGIES) with its TP/PP degrees and engine knobs."""

    name: str
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    shard_group: int | None = Field(None, gt=0, description="fsdp-hybrid: GPUs per shard group (default: a node)")
    tp_impl: TPImpl = Field("auto", description="tensor-parallel implementation planned (TP_SCHEMES): auto = "
                            "the engine's (torch's engines: dtensor; DeepSpeed ZeRO-0/1/2 at pp 1: autotp; "
                            "else megatron)")
    ds: DeepSpeedKnobs = DeepSpeedKnobs()
    fsdp: FSDPKnobs = FSDPKnobs()
    ddp: DDPKnobs = DDPKnobs()

    @model_validator(mode="after")
    def _check(self) -> Strategy:
        if self.name not in STRATEGIES:
            raise ShardwiseError(f"unknown strategy {self.name!r}. {did_you_mean(self.name, STRATEGY_NAMES)}")
        if self.pp > 1 and not self.facts.combines_with_pp:
            raise ShardwiseError(
                f"strategy {self.name!r} cannot run with pipeline parallelism (pp {self.pp}): DeepSpeed's "
                "pipeline engine supports ZeRO stage 0 and 1 only")
        if self.shard_group is not None and self.fsdp_sharding != "hybrid":
            raise ShardwiseError(f"shard_group {self.shard_group} applies to fsdp-hybrid only, not {self.name!r}")
        if self.tp_impl == "autotp" and (self.engine != "deepspeed" or self.pp > 1 or self.zero_stage == 3):
            raise ShardwiseError(
                f"tp_impl 'autotp' with strategy {self.name!r}{f' and pp {self.pp}' if self.pp > 1 else ''}: "
                "DeepSpeed's AutoTP training runs with ZeRO stage 0, 1 or 2 without pipeline stages")
        if self.tp_impl == "dtensor" and self.engine == "deepspeed":
            raise ShardwiseError(f"tp_impl 'dtensor' with strategy {self.name!r}: DeepSpeed takes no DTensor "
                                 "parameters (its TP is autotp, or Megatron-DeepSpeed's: megatron)")
        given = self.fsdp.reshard_after_forward
        if self.fsdp_sharding == "grad-op" and "reshard_after_forward" in self.fsdp.model_fields_set and given != "none":
            raise ShardwiseError(
                f"fsdp reshard_after_forward {given!r} with strategy 'fsdp-grad-op': grad-op keeps every layer "
                "gathered from forward to backward (reshard_after_forward none); resharding applies to fsdp, "
                "fsdp-hybrid and fsdp+offload")
        return self

    @classmethod
    def from_name(cls, name: str, **overrides) -> Strategy:
        return cls(name=name.strip().lower(), **overrides)

    @classmethod
    def with_knobs(cls, name: str, knobs: StrategyKnobs | None = None, **overrides) -> Strategy:
        """`name` with the engine knobs of `knobs` (the shard group only where it applies)."""
        k = knobs or StrategyKnobs()
        facts = STRATEGIES.get(name.strip().lower())  # an unknown name fails in from_name, with choices
        extra = {"shard_group": k.shard_group} if facts and facts.fsdp_sharding == "hybrid" and k.shard_group else {}
        if facts and facts.engine != "fsdp2" and k.tp_impl != "auto":
            extra["tp_impl"] = k.tp_impl
        fsdp = k.fsdp
        if facts and facts.fsdp_sharding == "grad-op":  # its resharding is its definition, not a knob
            fsdp = FSDPKnobs(**k.fsdp.model_dump(exclude_unset=True, exclude={"reshard_after_forward"}))
        return cls.from_name(name, ds=k.ds, fsdp=fsdp, ddp=k.ddp, **extra, **overrides)

    @property
    def facts(self) -> StrategyFacts:
        return STRATEGIES[self.name]

    @property
    def engine(self) -> Engine:
        return self.facts.engine

    @property
    def zero_stage(self) -> int | None:
        return self.facts.zero_stage

    @property
    def fsdp_sharding(self) -> FsdpSharding | None:
        return self.facts.fsdp_sharding

    @property
    def offload_optimizer(self) -> bool:
        return self.facts.offload_optimizer

    @property
    def offload_params(self) -> bool:
        return self.facts.offload_params

    @property
    def shards_params(self) -> bool:
        return self.facts.shards_params

    @property
    def shards_grads(self) -> bool:
        return self.facts.shards_grads

    @property
    def shards_optimizer(self) -> bool:
        return self.facts.shards_optimizer

    @property
    def tp_scheme(self) -> TPScheme:
        """How this strategy's TP splits the model (`tp_impl`; "auto": DTensor for torch's engines,
        DeepSpeed's AutoTP for ZeRO-0/1/2 at pp 1, Megatron's for ZeRO-3 and for TP × PP)."""
        if self.tp_impl != "auto":
            return TP_SCHEMES[self.tp_impl]
        if self.engine != "deepspeed":
            return TP_SCHEMES["dtensor"]
        return TP_SCHEMES["autotp" if self.zero_stage != 3 and self.pp == 1 else "megatron"]

    @property
    def resharding(self) -> Resharding | None:
        """Which FSDP2 decoder-layer units free their gathered params after forward (gathered
        again in backward): the knob, "none" for fsdp-grad-op; None for other engines."""
        if self.engine != "fsdp2":
            return None
        return "none" if self.fsdp_sharding == "grad-op" else self.fsdp.reshard_after_forward

    @property
    def zero_equivalent(self) -> int:
        """The ZeRO stage with the same parameter lifetime: FSDP2 that keeps every layer gathered
        from forward to backward (resharding "none", as fsdp-grad-op) is ZeRO-2's; else the row's."""
        return 2 if self.resharding == "none" else self.facts.zero_equivalent

    def reshards_layer(self, last: bool) -> bool:
        """`fully_shard(reshard_after_forward=...)` of a decoder layer (`last`: the final one)."""
        return self.resharding == "all" or (self.resharding == "not-last" and not last)

    def single_rank_ddp(self, world_size: int, gpus_per_node: int) -> Strategy | None:
        """The DDP strategy this FSDP2 strategy may run as: its data-parallel shard group is
        one rank, nothing is offloaded, no TP/PP, and `fsdp.single_rank` is not "fsdp" (whether
        "auto" takes it is the plan's call: plan.evaluate.single_rank_runs_as). With TP and one
        data-parallel rank (TP alone) always: the trainer shards nothing over data ranks then
        (shardwise.train.engines.fsdp.shard_model). Else None."""
        if self.engine != "fsdp2" or self.offload_params or self.pp > 1:
            return None
        layout = ParallelLayout.for_strategy(self, world_size, gpus_per_node)
        if self.tp > 1:  # TP alone (one data-parallel rank): the trainer applies no FSDP2 at all
            return Strategy.from_name("ddp", ddp=self.ddp, tp=self.tp) if layout.dp == 1 else None
        if self.fsdp.single_rank == "fsdp" or layout.dp_shard != 1:
            return None
        return Strategy.from_name("ddp", ddp=self.ddp)

    @property
    def trainable(self) -> bool:
        """`shardwise train` runs it: its data-parallel engines without PP; TP with FSDP2 without
        offload (DTensor, shardwise.train.tensor_parallel) or with ZeRO-1/2 without offload
        (DeepSpeed's AutoTP, shardwise.run.deepspeed.autotp_section), as its own scheme."""
        offload = self.offload_params or self.offload_optimizer
        tp_ok = self.tp == 1 or (not offload and (
            (self.engine == "fsdp2" and self.tp_scheme.name == "dtensor")
            or (self.zero_stage in (1, 2) and self.tp_scheme.name == "autotp")))
        return self.facts.trainer and tp_ok and self.pp == 1
