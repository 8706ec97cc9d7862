"""What the DDP and FSDP2 engines share: AdamW construction, autocast, fp16 loss scaling."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from shardwise.train.config import TrainConfig
from shardwise.train.engines.base import DistEnv, decay_groups

DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def build_adamw(cfg: TrainConfig, model: torch.nn.Module, env: DistEnv) -> torch.optim.AdamW:
    """AdamW with every default that matters stated: weight decay (torch's default is 0.01),
    betas, eps. Fused where the device has it (CUDA), else the for-loop/foreach reference."""
    o = cfg.optimizer
    fused = o.fused if o.fused is not None else env.device == "cuda"
    kw: dict[str, Any] = {"fused": True} if fused else {}
    return torch.optim.AdamW(
        decay_groups(model, o.weight_decay),
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        **kw,
    )


def autocast(cfg: TrainConfig, env: DistEnv):
    """Mixed precision for the replicated engine: autocast keeps fp32 weights and grads."""
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(env.torch_device.type, dtype=DTYPES[cfg.precision])


def grad_scaler(cfg: TrainConfig, env: DistEnv) -> torch.amp.GradScaler | None:
    """fp16 needs dynamic loss scaling (bf16 and fp32 do not: same exponent range as fp32)."""
    if cfg.precision != "fp16-mixed":
        return None
    return torch.amp.GradScaler(env.torch_device.type)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
