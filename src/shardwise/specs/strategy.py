"""Strategy: a named strategy (a row of shardwise.config.strategy's table) with its TP/PP degrees,
its TP scheme and its engine knobs, as the planner, the layout, the trainer and the emitters read
it; and what each tensor-parallel implementation splits (`TP_SCHEMES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from shardwise.config.base import Spec
from shardwise.config.strategy import (
    STRATEGIES,
    STRATEGY_NAMES,
    CPImpl,
    DDPKnobs,
    DeepSpeedKnobs,
    Engine,
    FSDPKnobs,
    FsdpSharding,
    PPSchedule,
    Resharding,
    StrategyFacts,
    StrategyKnobs,
    ZeroImpl,
    virtual_refusal,
)
from shardwise.errors import ShardwiseError, did_you_mean
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.pipeline import stage_engine_refusal

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
    `copy_to_tensor_model_parallel_region` ahead of the fused projections).
    torch_loss_parallel: the standard loss over the vocabulary shards is torch's `loss_parallel`
    (DTensor's custom log-softmax and NLL ops), not Megatron's vocab-parallel cross-entropy: its
    memory differs (plan/loss.py `logits_bytes`)."""

    name: str
    sequence_parallel: bool
    vocab_parallel: bool
    saves_gathered_input: bool
    reduces_per_linear: bool
    torch_loss_parallel: bool


TP_SCHEMES: dict[str, TPScheme] = {
    # torch DTensor `parallelize_module` (shardwise.train.model.tensor_parallel, torchtitan's parallelize_llama)
    "dtensor": TPScheme("dtensor", sequence_parallel=True, vocab_parallel=True, saves_gathered_input=True,
                        reduces_per_linear=False, torch_loss_parallel=True),
    # Megatron-LM (and Megatron-DeepSpeed) with --sequence-parallel: the published Megatron rows
    "megatron": TPScheme("megatron", sequence_parallel=True, vocab_parallel=True, saves_gathered_input=False,
                         reduces_per_linear=False, torch_loss_parallel=False),
    # DeepSpeed AutoTP training (`tensor_parallel.autotp_size`, shardwise.run.deepspeed.autotp_section):
    # the decoder linears only; no sequence parallelism; embedding, norms and lm_head whole
    "autotp": TPScheme("autotp", sequence_parallel=False, vocab_parallel=False, saves_gathered_input=False,
                       reduces_per_linear=True, torch_loss_parallel=False),
}


class Strategy(Spec):
    """A named strategy (a row of STRATEGIES) with its TP/PP degrees and engine knobs."""

    name: str
    tp: int = Field(1, gt=0)
    cp: int = Field(1, gt=0, description="context-parallel degree: each sequence split over cp GPUs (plan/context.py)")
    cp_impl: CPImpl = Field("auto", description="how CP exchanges keys and values: torch, ring, allgather, "
                            "ulysses; auto = the engine's (DeepSpeed: ulysses, else torch)")
    cp_load_balance: bool = Field(True, description="CP chunks balanced for causal attention (else consecutive)")
    pp: int = Field(1, gt=0)
    pp_schedule: PPSchedule = Field("1f1b", description="the pipeline schedule (pp > 1; shardwise.specs.pipeline)")
    pp_virtual_stages: int = Field(1, gt=0, description="stages per pipeline rank (interleaved 1F1B: ≥ 2)")
    ep: int = Field(1, gt=0, description="expert-parallel degree: the routed experts of each MoE layer split over "
                    "ep ranks borrowed from the data-parallel ones (plan/experts.py); plan-only")
    ep_load_imbalance: float = Field(1.0, ge=1.0, allow_inf_nan=False,
                                     description="tokens the busiest expert-parallel rank receives over the balanced "
                                     "share (1.0: balanced; a capacity-factor engine: its capacity factor)")
    etp: int | None = Field(None, gt=0, description="expert tensor-parallel degree under ep > 1: the TP ranks each "
                            "routed expert is split over, 1 or tp (Megatron's --expert-tensor-parallel-size); "
                            "None: the engine's (`expert_tp`)")
    ep_overlap: bool = Field(False, description="under ep > 1: the dispatch/combine all-to-alls of one micro-batch "
                             "overlapped with another's compute (Megatron's --overlap-moe-expert-parallel-comm)")
    shard_group: int | None = Field(None, gt=0, description="fsdp-hybrid: GPUs per shard group (default: a node)")
    tp_impl: TPImpl = Field("auto", description="tensor-parallel implementation planned (TP_SCHEMES): auto = "
                            "the engine's (torch's engines: dtensor; DeepSpeed ZeRO-0/1/2 at pp 1: autotp; "
                            "else megatron)")
    zero_impl: ZeroImpl = Field("deepspeed", description="zero1's sharded optimizer: deepspeed (ZeRO stage 1) or "
                                "megatron (Megatron-Core's distributed optimizer; plan-only)")
    grad_reduce_in_bf16: bool = Field(False, description="zero_impl megatron: the gradient buffer and its "
                                      "reduce-scatter in bf16 (Megatron-LM --grad-reduce-in-bf16, --main-grads-dtype "
                                      "bf16; Megatron-Bridge grad_reduce_in_fp32 false), not Megatron-LM's fp32")
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
        if self.pp > 1 and (why := virtual_refusal(self.pp_schedule, self.pp_virtual_stages)):
            raise ShardwiseError(why)
        if self.pp == 1 and self.pp_virtual_stages > 1:
            raise ShardwiseError(f"pp_virtual_stages {self.pp_virtual_stages} needs pipeline parallelism (pp > 1)")
        if self.ep_load_imbalance != 1.0 and self.ep == 1:
            raise ShardwiseError(f"ep_load_imbalance {self.ep_load_imbalance} needs expert parallelism (ep > 1)")
        if self.etp is not None and self.etp != self.tp and self.ep == 1:
            raise ShardwiseError(f"etp {self.etp} with ep 1: without expert parallelism the routed experts are "
                                 f"split over the tp {self.tp} ranks as the dense layers are (give ep > 1)")
        if self.ep_overlap and self.ep == 1:
            raise ShardwiseError("ep_overlap needs expert parallelism (ep > 1): it overlaps the EP all-to-alls")
        if self.ep_overlap and self.pp > 1 and self.pp_virtual_stages == 1:
            raise ShardwiseError(f"ep_overlap with pp {self.pp}: Megatron-Core overlaps the EP all-to-alls under "
                                 "pipeline parallelism with virtual stages only (pp_virtual_stages ≥ 2; "
                                 "transformer_config.py: virtual_pipeline_model_parallel_size must be specified)")
        if self.etp not in (None, 1, self.tp):
            raise ShardwiseError(f"etp {self.etp}: the expert tensor-parallel degree is planned as 1 (experts whole, "
                                 f"expert parallelism borrows the TP ranks) or tp ({self.tp}: experts split as the "
                                 "dense layers are)")
        if self.ep > 1 and self.tp > 1 and not self.tp_scheme.sequence_parallel:
            raise ShardwiseError(
                f"ep {self.ep} with tp {self.tp} and tp_impl {self.tp_scheme.name!r}: expert parallelism beside "
                "tensor parallelism is planned with sequence parallelism (Megatron-Core's token dispatcher, "
                "torchtitan's MoE sharding), which DeepSpeed's AutoTP does not run; give tp_impl megatron")
        if self.shard_group is not None and self.fsdp_sharding != "hybrid":
            raise ShardwiseError(f"shard_group {self.shard_group} applies to fsdp-hybrid only, not {self.name!r}")
        if self.tp_impl == "autotp" and (self.engine != "deepspeed" or self.pp > 1 or self.zero_stage == 3):
            raise ShardwiseError(
                f"tp_impl 'autotp' with strategy {self.name!r}{f' and pp {self.pp}' if self.pp > 1 else ''}: "
                "DeepSpeed's AutoTP training runs with ZeRO stage 0, 1 or 2 without pipeline stages")
        if self.tp_impl == "dtensor" and self.engine == "deepspeed":
            raise ShardwiseError(f"tp_impl 'dtensor' with strategy {self.name!r}: DeepSpeed takes no DTensor "
                                 "parameters (its TP is autotp, or Megatron-DeepSpeed's: megatron)")
        if self.cp_impl == "torch" and self.engine == "deepspeed":
            raise ShardwiseError(f"cp_impl 'torch' with strategy {self.name!r}: torch's context_parallel shards "
                                 "DTensor inputs of torch's engines; DeepSpeed's sequence parallelism is ulysses "
                                 "(or a ring: cp_impl ring)")
        if self.zero_impl == "megatron" and self.name != "zero1":
            raise ShardwiseError(f"zero_impl 'megatron' with strategy {self.name!r}: Megatron-Core's distributed "
                                 "optimizer shards the optimizer states as ZeRO stage 1 does (strategy zero1)")
        if self.grad_reduce_in_bf16 and self.zero_impl != "megatron":
            raise ShardwiseError(f"grad_reduce_in_bf16 with strategy {self.name!r} and zero_impl {self.zero_impl!r}: "
                                 "it sets Megatron-Core's gradient buffer dtype (zero1 with zero_impl megatron); "
                                 "DeepSpeed's reduction dtype is ds.communication_data_type, FSDP2's "
                                 "fsdp.reduce_dtype")
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
        """`name` with the engine knobs of `knobs` (the shard group and the pipeline schedule only
        where they apply); `overrides` win."""
        k = knobs or StrategyKnobs()
        facts = STRATEGIES.get(name.strip().lower())  # an unknown name fails in from_name, with choices
        extra = {"shard_group": k.shard_group} if facts and facts.fsdp_sharding == "hybrid" and k.shard_group else {}
        extra |= {f: getattr(k, f) for f in ("ep", "ep_load_imbalance", "etp", "ep_overlap") if getattr(k, f) is not None}
        if overrides.get("pp", 1) > 1:  # the schedule applies to pipeline stages only
            extra |= {f: getattr(k, f) for f in ("pp_schedule", "pp_virtual_stages") if getattr(k, f) is not None}
        if facts and facts.engine != "fsdp2" and k.tp_impl != "auto":
            extra["tp_impl"] = k.tp_impl
        if name.strip().lower() == "zero1":  # the other strategies have one implementation each
            extra["zero_impl"] = k.zero_impl
            if k.zero_impl == "megatron" and k.grad_reduce_in_bf16 is not None:
                extra["grad_reduce_in_bf16"] = k.grad_reduce_in_bf16
        extra |= {f: getattr(k, f) for f in ("cp", "cp_impl", "cp_load_balance") if getattr(k, f) is not None}
        fsdp = k.fsdp
        if facts and facts.fsdp_sharding == "grad-op":  # its resharding is its definition, not a knob
            fsdp = FSDPKnobs(**k.fsdp.model_dump(exclude_unset=True, exclude={"reshard_after_forward"}))
        return cls.from_name(name, ds=k.ds, fsdp=fsdp, ddp=k.ddp, **(extra | overrides))

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
    def expert_tp(self) -> int:
        """The TP ranks each routed expert is split over (`etp`; None: the engine's). Without expert
        parallelism, tp: the experts are split as the dense layers are. Under it, Megatron-Core's
        default is tp (`--expert-tensor-parallel-size` defaults to the TP size: NVIDIA/Megatron-LM@d98e8a6
        megatron/training/arguments.py); torchtitan's DTensor layout borrows the TP ranks for EP and
        keeps each expert whole (pytorch/torchtitan@b5bcd76 models/common/MOE_SHARDING.md: routed
        experts `Shard(0)` on the EP mesh, efsdp = dp_shard·cp·tp / ep): 1."""
        if self.etp is not None:
            return self.etp
        if self.ep == 1 or self.tp_scheme.name != "dtensor":
            return self.tp
        return 1

    def main_grad_bytes(self, compute_dtype: str, compute_bytes: int) -> int:
        """Bytes per element of Megatron-Core's gradient buffer (zero_impl megatron), which its
        reduce-scatter also moves: fp32 for a bf16 run (megatron/training/arguments.py: "bfloat16
        requires gradient accumulation and all-reduce to be done in fp32"), bf16 under
        `grad_reduce_in_bf16` (`--grad-reduce-in-bf16` sets accumulate_allreduce_grads_in_fp32
        False: NVIDIA/Megatron-LM@d98e8a64); the compute dtype's for fp16 and fp32 runs."""
        return 4 if compute_dtype == "bf16" and not self.grad_reduce_in_bf16 else compute_bytes

    @property
    def cp_scheme(self) -> str:
        """How this strategy's context parallelism exchanges keys and values (`cp_impl`; "auto":
        DeepSpeed's Ulysses for DeepSpeed, torch's context_parallel for torch's engines)."""
        if self.cp_impl != "auto":
            return self.cp_impl
        return "ulysses" if self.engine == "deepspeed" else "torch"

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
        return self.resharding in ("all", "layers") or (self.resharding == "not-last" and not last)

    @property
    def reshards_embedding(self) -> bool:
        """`fully_shard(embedding, reshard_after_forward=...)` of the embedding unit that
        `fsdp.wrap_embeddings` carves out of the root: as the decoder layers (torchtune passes one
        value to every unit, accelerate 1.16 passes its flag; the head unit follows the root:
        `reshards_root`)."""
        return self.reshards_layer(last=False)

    @property
    def reshards_root(self) -> bool:
        """`fully_shard(model, reshard_after_forward=...)` of the root (embeddings, final norm,
        lm_head): True under "all", as users who wrap each layer and then the root pass one value
        to every unit (torchtune's `shard_model`, pytorch/torchtune@0696355
        torchtune/training/_distributed.py). torch honours an explicit True on the root: its
        `_lazy_init` turns resharding off only where the argument was left None (torch 2.13
        `_fsdp_state.py`, `_auto_reshard_after_forward`), so the root is gathered again in
        backward. (accelerate 1.16 `fsdp2_prepare_model` wraps the input embedding alone with the
        value, final norm and lm_head with False and the root with None: not this layout.)
        `fsdp.reshard_root` true or false says it beside any layer policy (torchtitan: true with
        its not-last layers)."""
        if self.engine != "fsdp2":
            return False
        return self.resharding == "all" if self.fsdp.reshard_root == "auto" else self.fsdp.reshard_root

    def in_backward_refusal(self, dp: int) -> str | None:
        """Why the optimizer step in backward (`optimizer.in_backward`) does not run with this
        strategy at `dp` data-parallel ranks, or None where it does (FSDP2; one unwrapped DDP
        replica). The trainer's preflight and the planner both ask here."""
        if self.engine == "deepspeed":
            return f"DeepSpeed's engine owns the optimizer step ({self.name}); use an fsdp strategy"
        if self.tp > 1 or self.pp > 1:
            return f"it is not run with tensor or pipeline parallelism (tp {self.tp}, pp {self.pp})"
        if self.engine == "ddp" and self.ddp.wrapped(dp):
            return ("DDP keeps every gradient in its reducer's buckets (nothing would be saved) and a parameter's "
                    "hook fires before their all-reduce; use an fsdp strategy (or one ddp rank)")
        return None

    def low_bit_refusal(self, optimizer: str, device: str) -> str | None:
        """Why the trainer does not run the low-bit `optimizer` (optimizer.name adamw8bit,
        adamw4bit, paged_adamw8bit; shardwise.train.engines.low_bit) with this strategy as the
        engines run it (RunSpec.engine_strategy) on `device`, or None where it does (and for the
        other optimizers). The trainer's preflight, `to_config` and the recommender ask here."""
        if optimizer not in ("adamw8bit", "adamw4bit", "paged_adamw8bit"):
            return None
        if self.engine == "deepspeed":
            return f"DeepSpeed's engine owns the optimizer and its states ({self.name}); use an fsdp or ddp strategy"
        if self.tp > 1:
            return f"low-bit states are run with data parallelism only, not with tensor parallelism (tp {self.tp})"
        if optimizer == "paged_adamw8bit":
            if device != "cuda":
                return (f"bitsandbytes' paged optimizer keeps its states in CUDA unified memory (cudaMallocManaged), "
                        f"and this run is on {device}; adamw8bit (torchao) runs on any device")
            if self.engine == "fsdp2":
                return (f"bitsandbytes' optimizer kernels take plain tensors, not FSDP2's DTensor shards ({self.name}); "
                        "use ddp, or adamw8bit (torchao, which shards with FSDP2)")
        return None

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
        """`shardwise train` runs it: its data-parallel engines; TP with FSDP2 without offload
        (DTensor, shardwise.train.model.tensor_parallel) or with ZeRO-1/2 without offload
        (DeepSpeed's AutoTP, shardwise.run.deepspeed.autotp_section), as its own scheme; PP with
        FSDP2 without offload, DTensor's TP inside the stages (`specs.pipeline.stage_engine_refusal`).
        Context parallelism (cp > 1) is planned only.
        Expert parallelism (ep > 1) is planned only (plan/experts.py): the trainer runs none.
        What the model and the run decide on top (families, tied embeddings, the schedule's
        micro-batches) is `specs.pipeline.trainer_pp_gap`'s and `specs.layout.trainer_tp_gap`'s."""
        offload = self.offload_params or self.offload_optimizer
        tp_ok = self.tp == 1 or (not offload and (
            (self.engine == "fsdp2" and self.tp_scheme.name == "dtensor")
            or (self.zero_stage in (1, 2) and self.tp_scheme.name == "autotp")))
        return self.facts.trainer and tp_ok and self.cp == 1 and self.ep == 1 and stage_engine_refusal(self) is None
