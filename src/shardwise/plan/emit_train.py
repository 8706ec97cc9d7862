"""shardwise's own training config (`shardwise train shardwise.yaml`) for a planned strategy.

The dict follows `shardwise.train.config.TrainConfig`; where the plan used a setting the
trainer does not offer (bf16-pure, selective checkpointing, flash attention, SGD/8-bit Adam)
the nearest accepted value is written and the difference is returned as a note, which the
YAML header and README repeat: a silently different run would make the plan's numbers lie.
"""

from __future__ import annotations

from typing import Any

from shardwise import catalog
from shardwise.plan.emit_deepspeed import HYPER, Hyper
from shardwise.specs import HardwareSpec, ModelSpec, ParallelLayout, Strategy, TrainSpec


def shardwise_config(
    model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, *, hyper: Hyper = HYPER,
) -> tuple[dict[str, Any], list[str]]:
    """(TrainConfig-shaped dict, notes on where it differs from what was planned)."""
    notes: list[str] = []
    precision = train.precision
    if precision == "bf16-pure":
        notes.append("planned bf16-pure; the trainer runs bf16-mixed (fp32 master weights: more memory)")
        precision = "bf16-mixed"
    activation = {"none": "none", "full": "full", "selective": "full"}[train.checkpointing]
    if train.checkpointing == "selective":
        notes.append("planned selective checkpointing; the trainer offers full (less memory, more recompute)")
    attention = "sdpa" if train.attention == "flash" else train.attention
    if train.attention == "flash":
        notes.append("planned flash attention; the trainer uses sdpa (same O(seq) memory with its flash kernel)")
    if train.optimizer != "adamw":
        notes.append(f"planned optimizer {train.optimizer!r}; the trainer (and the DeepSpeed JSON) use AdamW")
    if train.lora_rank:
        notes.append(f"planned LoRA rank {train.lora_rank}; these configs describe full fine-tuning")

    model_section: dict[str, Any] = {"attention": attention}
    if model.name in catalog.model_names():
        # A catalog name builds that architecture with random weights; real SFT wants `path`.
        model_section["name"] = model.name
    else:
        model_section |= {"name": None, "path": f"/path/to/{model.name}"}

    strategy_section: dict[str, Any] = {"name": strategy.name}
    if strategy.fsdp_sharding == "hybrid":
        layout = ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
        strategy_section["shard_group"] = layout.dp_shard
    if strategy.engine == "deepspeed":
        strategy_section["bucket_elements"] = strategy.ds.reduce_bucket_size

    h = hyper
    cfg: dict[str, Any] = {
        "name": f"{model.name}-{strategy.name}",
        "model": model_section,
        "data": {"kind": "sft", "sft": {"max_length": train.seq_len}},
        "strategy": strategy_section,
        "optimizer": {"name": "adamw", "lr": h.lr, "betas": list(h.betas), "eps": h.eps,
                      "weight_decay": h.weight_decay, "max_grad_norm": h.max_grad_norm},
        # DeepSpeed's WarmupDecayLR (linear warmup), as in ds_config.json: both files train alike.
        "schedule": {"kind": "warmup_decay", "warmup_steps": h.warmup_steps},
        "precision": precision,
        "run": {"steps": h.steps, "micro_batch": train.micro_batch, "grad_accum": train.grad_accum,
                "nproc": hw.gpus_per_node, "device": "cuda"},
        "checkpointing": {"activation": activation, "output_dir": f"runs/{model.name}-{strategy.name}"},
        "hardware": {"gpu": hw.gpu.name, "check_memory": True},
    }
    return cfg, notes
