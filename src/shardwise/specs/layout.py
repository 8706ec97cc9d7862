"""The parallel layout, shared by the planner and the trainer: validated without GPUs.

dp_replicate × dp_shard × tp × pp must equal the world size (torchtitan's ParallelDims).
Context parallelism (`cp`) takes its ranks from the data-parallel ones: model states are
sharded and reduced over dp_shard × cp as over any data-parallel group (torchtitan's
`dp_shard_cp` mesh; Megatron-Core's data-parallel group with context parallelism), while the cp
ranks of a group split one sequence instead of taking their own (`batch_ranks`).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from shardwise.config.base import Spec
from shardwise.errors import ShardwiseError

# The families `shardwise train` runs with tensor parallelism (shardwise.train.model.tensor_parallel's
# plan: transformers' Llama/Qwen2/Mistral module names, attention reshaped with -1 local heads).
TRAINER_TP_FAMILIES = ("llama", "qwen2", "mistral")


def trainer_tp_gap(model, tp: int, vocab_parallel: bool = True) -> str | None:
    """Why the trainer's TP plan cannot split `model` over `tp` ranks (None: it can).
    `vocab_parallel`: the embedding and lm_head are split too (DTensor's plan; AutoTP keeps them whole)."""
    if tp == 1:
        return None
    if model.family not in TRAINER_TP_FAMILIES:
        return (f"the trainer's tensor-parallel plan covers families {', '.join(TRAINER_TP_FAMILIES)}, "
                f"not {model.family!r}")
    if model.num_kv_heads % tp:
        return (f"tp {tp} must divide the {model.num_kv_heads} key/value heads of {model.name} (replicating KV "
                "heads across TP ranks is not implemented)")
    if vocab_parallel and model.vocab_size % tp:
        return f"tp {tp} must divide the vocabulary ({model.vocab_size}): the embedding and lm_head are sharded over it"
    return None


class ParallelLayout(Spec):

    world_size: int = Field(gt=0)
    dp_shard: int = Field(1, gt=0)  # GPUs a model state is sharded over (ZeRO/FSDP group)
    dp_replicate: int = Field(1, gt=0)  # replicas of each shard (DDP, HSDP across nodes)
    tp: int = Field(1, gt=0)
    cp: int = Field(1, gt=0)  # of the data-parallel ranks: the GPUs one sequence is split over
    pp: int = Field(1, gt=0)
    # expert parallelism: the ranks of one data-parallel group that split each MoE layer's routed
    # experts among them (torchtitan's ParallelDims borrows ep from dp_shard × cp; Megatron-Core's
    # --expert-model-parallel-size from the data-parallel ranks): not a factor of the world size
    ep: int = Field(1, gt=0)
    # the TP ranks each routed expert is split over (Strategy.expert_tp): None = tp. At 1 the EP
    # group may borrow the TP ranks too (Megatron-Core's expert grid ETP × EP × EDP × PP covers
    # the world: parallel_state.py; torchtitan's efsdp = dp_shard·cp·tp / ep)
    etp: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ParallelLayout:
        group = self.dp_shard if self.dp_shard > 1 else self.dp_replicate
        if group % self.cp:
            raise ShardwiseError(
                f"cp {self.cp} does not divide the data-parallel {'shard group' if self.dp_shard > 1 else 'degree'} "
                f"of {group} GPUs (context-parallel ranks are data-parallel ranks that split one sequence)")
        prod = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if prod != self.world_size:
            raise ShardwiseError(
                f"parallel layout does not cover the GPUs: dp_replicate {self.dp_replicate} × dp_shard "
                f"{self.dp_shard} × tp {self.tp} × pp {self.pp} = {prod}, but there are {self.world_size} GPUs"
            )
        if self.expert_tp not in (1, self.tp):
            raise ShardwiseError(f"etp {self.etp}: the expert tensor-parallel degree is 1 or tp ({self.tp})")
        if self.expert_tp < self.tp:
            if (self.dp * self.tp) % (self.ep * self.expert_tp):
                raise ShardwiseError(
                    f"ep {self.ep} must divide the data-parallel degree {self.dp} × tp {self.tp}: with whole experts "
                    "(etp 1) the expert-parallel ranks are borrowed from the data-parallel and tensor-parallel ones")
            if self.dp_shard > 1 and (self.dp_shard * self.tp) % self.ep:
                raise ShardwiseError(
                    f"ep {self.ep} must divide dp_shard {self.dp_shard} × tp {self.tp}: with whole experts (etp 1) "
                    "the expert states are sharded over the dp_shard × tp / ep ranks left (torchtitan's efsdp)")
            return self
        if self.dp % self.ep:
            raise ShardwiseError(
                f"ep {self.ep} must divide the data-parallel degree {self.dp} (dp_replicate {self.dp_replicate} × "
                f"dp_shard {self.dp_shard}): expert-parallel ranks are borrowed from the data-parallel ones")
        if self.dp_shard > 1 and self.dp_shard % self.ep:
            raise ShardwiseError(
                f"ep {self.ep} must divide the data-parallel shard group dp_shard {self.dp_shard}: expert "
                "parallelism borrows from the sharded dimension (torchtitan ParallelDims: dp_shard × cp), and the "
                "expert states are sharded over the dp_shard / ep ranks left")
        return self

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_tp(self) -> int:
        """The TP ranks each routed expert is split over (`etp`, default tp)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel degree: the ranks that hold the same experts and reduce their
        gradients, dp·tp / (ep·etp) (Megatron-Core's expert_data_parallel_size = world / (ETP·EP·PP))."""
        return self.dp * self.tp // (self.ep * self.expert_tp)

    @property
    def batch_ranks(self) -> int:
        """The data-parallel ranks that take their own sequences (dp / cp)."""
        return self.dp // self.cp

    @classmethod
    def for_strategy(cls, strategy, world_size: int, gpus_per_node: int) -> ParallelLayout:
        """Derive the layout a strategy implies on `world_size` GPUs with its TP/PP degrees."""
        tp, pp, cp, ep = strategy.tp, strategy.pp, strategy.cp, strategy.ep
        expert = {"ep": ep, "etp": strategy.expert_tp if ep > 1 else None}
        if world_size % (tp * pp):
            raise ShardwiseError(
                f"tp {tp} × pp {pp} = {tp * pp} does not divide the {world_size} GPUs "
                f"(data-parallel degree would be {world_size / (tp * pp):.3g})"
            )
        if world_size % (tp * pp * cp):
            raise ShardwiseError(
                f"cp {cp} × tp {tp} × pp {pp} = {cp * tp * pp} does not divide the {world_size} GPUs "
                "(context-parallel ranks split the data-parallel ones)")
        if tp > gpus_per_node or gpus_per_node % tp:
            raise ShardwiseError(
                f"tp {tp} must divide the {gpus_per_node} GPUs of a node (tensor parallelism stays on NVLink)"
            )
        dp = world_size // (tp * pp)
        if not strategy.shards_optimizer:  # DDP, ZeRO-0: every model state replicated
            return cls(world_size=world_size, dp_replicate=dp, tp=tp, cp=cp, pp=pp, **expert)
        if strategy.fsdp_sharding == "hybrid":
            group = strategy.shard_group or max(1, gpus_per_node // tp)
            if dp % group:
                raise ShardwiseError(
                    f"fsdp-hybrid: shard group of {group} GPUs does not divide the data-parallel degree {dp}"
                )
            return cls(world_size=world_size, dp_shard=group, dp_replicate=dp // group, tp=tp, cp=cp, pp=pp, **expert)
        return cls(world_size=world_size, dp_shard=dp, tp=tp, cp=cp, pp=pp, **expert)

    def check_model(self, model) -> None:
        """Refuse layouts the model's shape cannot split."""
        if model.num_heads % self.tp:
            raise ShardwiseError(
                f"tp {self.tp} does not divide the {model.num_heads} attention heads of {model.name}"
            )
        if model.num_kv_heads % self.tp and self.tp % model.num_kv_heads:
            raise ShardwiseError(
                f"tp {self.tp} and the {model.num_kv_heads} key/value heads of {model.name}: "
                "neither divides the other"
            )
        if self.pp > model.num_layers:
            raise ShardwiseError(f"pp {self.pp} exceeds the {model.num_layers} layers of {model.name}")
        if self.ep > 1 and not model.is_moe:
            raise ShardwiseError(f"ep {self.ep}: {model.name} is a dense model (no routed experts); expert "
                                 "parallelism applies to MoE models (num_experts > 0)")
        if self.ep > 1 and model.inventory is not None:
            raise ShardwiseError(f"ep {self.ep}: {model.name} was read on the meta device (family 'hf'); expert "
                                 "parallelism is planned for the analytic MoE families (mixtral, qwen2_moe, "
                                 "qwen3_moe, deepseek_v3)")
        if model.num_experts % self.ep:
            raise ShardwiseError(f"ep {self.ep} must divide the {model.num_experts} routed experts (num_experts) of "
                                 f"{model.name}: each expert-parallel rank holds num_experts / ep of them")
