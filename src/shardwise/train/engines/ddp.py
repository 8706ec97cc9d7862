"""DDP: full replicas, gradients all-reduced (averaged) in buckets during backward; one replica
runs the bare module (DDPKnobs.wrap_one_rank)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from shardwise.run import RunSpec
from shardwise.train.engines._torch_common import (
    TorchOptimizerEngine,
    autocast,
    build_adamw,
    full_state_dict,
    grad_scaler,
)
from shardwise.train.engines.base import DistEnv, evaluate_loss_sum, forward_loss_sum


class DDPEngine(TorchOptimizerEngine):
    name = "ddp"

    def __init__(self, model: torch.nn.Module, run: RunSpec, env: DistEnv):
        self.run, self.env = run, env
        from shardwise.train.model.weights import materialize

        materialize(model, env.torch_device)  # a checkpoint read straight to the device (meta-built model)
        self.module = model.to(env.torch_device)
        knobs = run.engine_strategy.ddp
        # The default process group: the trainer's layouts are pure data parallelism, every rank
        # a replica (run.layout.dp_replicate == world size). One replica has nothing to reduce:
        # the bare module, unless DDPKnobs.wrap_one_rank (the planner books the difference:
        # wrapped, the buckets stay allocated across steps).
        # gradient_as_bucket_view: grads alias the reduce buckets (no second gradient copy).
        self.ddp: DistributedDataParallel | None = None
        if knobs.wrapped(env.world_size):
            self.ddp = DistributedDataParallel(
                self.module,
                device_ids=[env.local_rank] if env.device == "cuda" else None,
                bucket_cap_mb=knobs.bucket_cap_mb,
                gradient_as_bucket_view=knobs.gradient_as_bucket_view,
            )
        self.optimizer = build_adamw(run, self.module, env)
        self.scaler = grad_scaler(run, env)

    def sync_grads(self, enabled: bool):
        # DDP's own no_sync: skip the all-reduce on all but the last micro-batch.
        return contextlib.nullcontext() if enabled or self.ddp is None else self.ddp.no_sync()

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
        model = self.ddp if self.ddp is not None else self.module
        loss_sum = forward_loss_sum(model, self.module, batch, self.env.torch_device, self.run.train,
                                    amp=autocast(self.run, self.env))
        loss = loss_sum * loss_scale
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss_sum.detach()

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # Through the DDP wrapper, as in training (it syncs buffers in forward; no reducer
        # without grad mode).
        model = self.ddp if self.ddp is not None else self.module
        return evaluate_loss_sum(model, self.module, batch, self.env.torch_device, self.run.train,
                                 amp=autocast(self.run, self.env))

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        return full_state_dict(self.module, self.env.is_main)

    def close(self) -> None:
        self.close_optimizer()
        self.ddp = None
