"""Strategy: which engine, how it shards, what it offloads, and the knobs that change memory."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardwise.errors import ShardwiseError, did_you_mean
from shardwise.specs.base import Spec

Engine = Literal["ddp", "deepspeed", "fsdp2"]

# name -> (engine, zero stage, fsdp sharding, offload optimizer, offload params)
_TABLE: dict[str, tuple[Engine, int | None, str | None, bool, bool]] = {
    "ddp": ("ddp", None, None, False, False),
    "zero0": ("deepspeed", 0, None, False, False),
    "zero1": ("deepspeed", 1, None, False, False),
    "zero2": ("deepspeed", 2, None, False, False),
    "zero3": ("deepspeed", 3, None, False, False),
    "fsdp": ("fsdp2", None, "full", False, False),
    "fsdp-grad-op": ("fsdp2", None, "grad-op", False, False),
    "fsdp-hybrid": ("fsdp2", None, "hybrid", False, False),
    "zero1+opt-offload": ("deepspeed", 1, None, True, False),
    "zero2+opt-offload": ("deepspeed", 2, None, True, False),
    "zero3+opt-offload": ("deepspeed", 3, None, True, False),
    "zero3+full-offload": ("deepspeed", 3, None, True, True),
    "fsdp+offload": ("fsdp2", None, "full", True, True),  # CPUOffloadPolicy moves params+grads+optim
}
STRATEGY_NAMES: tuple[str, ...] = tuple(_TABLE)


class DeepSpeedKnobs(Spec):
    """DeepSpeed ZeRO config keys that change memory or traffic (defaults = DeepSpeed 0.19's,
    `deepspeed/runtime/zero/config.py`)."""

    reduce_bucket_size: int = Field(500_000_000, gt=0)
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    overlap_comm: bool | None = None  # None = DeepSpeed's default: True for stage 3 only
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    prefetch_bucket_size: int = Field(50_000_000, ge=0)
    max_live_parameters: int = Field(1_000_000_000, ge=0)
    max_reuse_distance: int = Field(1_000_000_000, ge=0)
    param_persistence_threshold: int = Field(100_000, ge=0)
    # Gradient reduction dtype: "auto" = DeepSpeed's default, the parameter dtype (bf16 under
    # bf16 mixed precision); shardwise's trainer sets "fp32" for loss parity (docs/training.md).
    communication_data_type: Literal["auto", "fp32", "bf16", "fp16"] = "auto"

    def overlap(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    def reduce_bytes(self, compute_bytes: int) -> int:
        """Bytes per gradient element DeepSpeed reduces in."""
        return {"auto": compute_bytes, "fp32": 4, "bf16": 2, "fp16": 2}[self.communication_data_type]


class Strategy(Spec):

    name: str
    engine: Engine
    zero_stage: int | None = None
    fsdp_sharding: Literal["full", "grad-op", "hybrid"] | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    shard_group: int | None = Field(None, gt=0, description="fsdp-hybrid: GPUs per shard group (default: a node)")
    ds: DeepSpeedKnobs = DeepSpeedKnobs()
    gradient_as_bucket_view: bool = True  # DDP: shardwise sets it, so no second gradient copy

    @classmethod
    def from_name(cls, name: str, **overrides) -> Strategy:
        key = name.strip().lower()
        if key not in _TABLE:
            raise ShardwiseError(f"unknown strategy {name!r}. {did_you_mean(name, STRATEGY_NAMES)}")
        engine, stage, fsdp, off_opt, off_par = _TABLE[key]
        return cls(
            name=key, engine=engine, zero_stage=stage, fsdp_sharding=fsdp,
            offload_optimizer=off_opt, offload_params=off_par, **overrides,
        )

    @property
    def shards_params(self) -> bool:
        return self.zero_stage == 3 or self.fsdp_sharding is not None

    @property
    def reshard_after_forward(self) -> bool:
        return self.fsdp_sharding in ("full", "hybrid")
