"""DeepSpeed JSON configs for a planned strategy: a concrete one and an HF-Trainer one ("auto").

Pure: no torch, no deepspeed import. The ZeRO knobs (buckets, prefetch, persistence) are the
ones the memory plan assumed, so they stay concrete in both files: HF Trainer's "auto" for
`reduce_bucket_size` would fill hidden_size², a different memory footprint than the plan's.
Only values Trainer must agree with (batch, optimizer, scheduler, precision, clipping) are
"auto" in the HF file, so `TrainingArguments` stays the one source for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec


@dataclass(frozen=True, slots=True)
class Hyper:
    """Optimizer/schedule values written into every emitted file, so all of them agree.

    Defaults are the trainer's (`shardwise.train.config`); tests check they stay in step.
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    steps: int = 100
    warmup_steps: int = 0


HYPER = Hyper()


def check_emittable(strategy: Strategy) -> None:
    """Emission covers data parallelism only: none of the emitted launchers does TP/PP."""
    if strategy.tp * strategy.pp != 1:
        raise ShardwiseError(
            f"config emission supports data parallelism only (tp 1, pp 1); {strategy.name} has "
            f"tp {strategy.tp}, pp {strategy.pp}"
        )


def data_parallel(hw: HardwareSpec, strategy: Strategy) -> int:
    check_emittable(strategy)
    return hw.world_size


def deepspeed_config(
    model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, *, hf_auto: bool = False,
    hyper: Hyper = HYPER,
) -> dict[str, Any]:
    """The DeepSpeed config for a ZeRO strategy; `hf_auto` puts "auto" where HF Trainer fills values."""
    if strategy.engine != "deepspeed":
        raise ShardwiseError(f"strategy {strategy.name!r} runs on {strategy.engine}, not DeepSpeed: no DS config")
    dp = data_parallel(hw, strategy)
    auto = "auto"

    def pick(concrete: Any) -> Any:
        return auto if hf_auto else concrete

    zero = zero_section(strategy)
    h = hyper
    total = max(h.steps, 1)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": pick(train.micro_batch),
        "gradient_accumulation_steps": pick(train.grad_accum),
        # DeepSpeed asserts train = micro × accumulation × data-parallel ranks.
        "train_batch_size": pick(train.micro_batch * train.grad_accum * dp),
        "gradient_clipping": pick(h.max_grad_norm),  # DeepSpeed's default 0.0 would not clip
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": pick(h.lr), "betas": pick(list(h.betas)), "eps": pick(h.eps),
                "weight_decay": pick(h.weight_decay),
            },
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": pick(0.0), "warmup_max_lr": pick(h.lr),
                # deepspeed >= 0.19.6 rejects warmup_num_steps <= 0 (HF clamps to 1 the same way)
                "warmup_num_steps": pick(max(1, h.warmup_steps)), "total_num_steps": pick(total),
                "warmup_type": "linear",  # DeepSpeed's default is log-shaped; shardwise's is linear
            },
        },
        "zero_optimization": zero,
        **_precision(train, hf_auto),
        **comm_dtype(strategy),
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    return cfg


def zero_section(strategy: Strategy, *, bucket: int | None = None, pin_memory: bool = True,
                 gather_16bit_on_save: bool = True) -> dict[str, Any]:
    """The `zero_optimization` block for a strategy: shared by the emitted configs and the
    trainer's DeepSpeed engine so that both run what the plan assumed. `bucket` overrides the
    bucket sizes (the trainer's small CPU buckets)."""
    stage = strategy.zero_stage or 0
    k = strategy.ds
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": bucket or k.reduce_bucket_size,
        "allgather_bucket_size": bucket or k.allgather_bucket_size,
        "overlap_comm": k.overlap(stage),
        "contiguous_gradients": k.contiguous_gradients,
        "reduce_scatter": k.reduce_scatter,
        "use_multi_rank_bucket_allreduce": k.use_multi_rank_bucket_allreduce,
    }
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": min(bucket, k.prefetch_bucket_size) if bucket else k.prefetch_bucket_size,
            "stage3_max_live_parameters": k.max_live_parameters,
            "stage3_max_reuse_distance": k.max_reuse_distance,
            "stage3_param_persistence_threshold": k.param_persistence_threshold,
            # Lets `save_model()` write one consolidated 16-bit checkpoint (costs memory at save only).
            "stage3_gather_16bit_weights_on_model_save": gather_16bit_on_save,
        }
    # Pinned host buffers: the PCIe copies the plan's offload timing assumes are pinned.
    if strategy.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if strategy.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return zero


def comm_dtype(strategy: Strategy) -> dict[str, Any]:
    """`communication_data_type` when the plan assumed one other than DeepSpeed's default."""
    dtype = strategy.ds.communication_data_type
    return {} if dtype == "auto" else {"communication_data_type": dtype}


def _precision(train: TrainSpec, hf_auto: bool) -> dict[str, Any]:
    bf16 = train.compute_dtype == "bf16"
    fp16 = train.compute_dtype == "fp16"
    # fp16 dynamic loss scaling (loss_scale 0) starting at 2^16, as torch's GradScaler does.
    fp16_block: dict[str, Any] = {"enabled": "auto" if hf_auto else fp16, "loss_scale": 0,
                                  "initial_scale_power": 16, "loss_scale_window": 1000,
                                  "hysteresis": 2, "min_loss_scale": 1}  # fmt: skip
    return {"bf16": {"enabled": "auto" if hf_auto else bf16}, "fp16": fp16_block}
