"""FSDP2: `fully_shard` on every decoder layer and at the root (torchtitan's layout).

- full: reshard_after_forward=True (params re-gathered in backward: ZeRO-3 memory).
- grad-op: reshard_after_forward=False (params stay gathered between forward and backward,
  like ZeRO-2's memory for params during the step; gradients still reduce-scattered).
- hybrid: a 2-D (replicate, shard) mesh: shard inside a group, replicate across groups.
Gradients are reduce-scattered with averaging over the data-parallel ranks (FSDP2 default),
which is what the loop's `loss_scale` assumes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardwise.errors import ShardwiseError
from shardwise.specs import Strategy
from shardwise.train.config import TrainConfig
from shardwise.train.engines._torch_common import DTYPES, TorchOptimizerEngine, build_adamw, grad_scaler
from shardwise.train.engines.base import DistEnv, model_inputs, token_loss_sum


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (`model.model.layers` for Llama/Qwen/Mistral)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ShardwiseError(f"{type(model).__name__}: no `model.layers` to wrap per decoder layer")
    return list(layers)


class FSDP2Engine(TorchOptimizerEngine):
    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, strategy: Strategy, env: DistEnv):
        self.cfg, self.env = cfg, env
        dev = env.torch_device.type
        if strategy.fsdp_sharding == "hybrid":
            group = strategy.shard_group or env.world_size
            mesh = init_device_mesh(
                dev, (env.world_size // group, group), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh(dev, (env.world_size,), mesh_dim_names=("shard",))
        kw: dict[str, Any] = {"mesh": mesh}
        if cfg.precision != "fp32":
            # Compute in low precision, reduce gradients in fp32: a bf16 reduce-scatter over many
            # ranks loses digits the fp32 master update then keeps.
            kw["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=DTYPES[cfg.precision], reduce_dtype=torch.float32
            )
        if strategy.offload_params or strategy.offload_optimizer:
            kw["offload_policy"] = CPUOffloadPolicy()
        if not kw.get("offload_policy"):
            model = model.to(env.torch_device)
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=strategy.reshard_after_forward, **kw)
        # The root keeps embeddings, final norm and lm_head (tied weights stay in one unit);
        # it is needed right after forward anyway, so it never reshards in between.
        fully_shard(model, reshard_after_forward=False, **kw)
        self.module = model
        self.optimizer = build_adamw(cfg, model, env)
        self.scaler = grad_scaler(cfg, env)

    def sync_grads(self, enabled: bool):
        # FSDP2 accumulates unsharded grads locally while sync is off; the last micro-batch
        # reduce-scatters the sum once.
        self.module.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
        labels = batch["labels"].to(self.env.torch_device)
        logits = self.module(**model_inputs(batch, self.env.torch_device)).logits
        loss_sum = token_loss_sum(logits, labels)
        loss = loss_sum * loss_scale
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss_sum.detach()

    def _global_norm(self, norm: torch.Tensor) -> float:
        # clip_grad_norm_ on DTensors all-reduces the partial norms: a global norm.
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        out = {}
        for k, v in self.module.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v  # collective: all ranks call it
            if self.env.is_main:
                out[k] = full.detach().cpu().clone()
        return out if self.env.is_main else None

    def close(self) -> None:
        self.optimizer.state.clear()
