"""DeepSpeed ZeRO stages 0-3 via `deepspeed.initialize`, with optimizer/parameter offload.

Settings made explicit because DeepSpeed's defaults would break parity with DDP/FSDP2:
- `gradient_clipping` = optimizer.max_grad_norm (DeepSpeed's default 0.0 means *no* clipping).
- AdamW `weight_decay` passed explicitly, in the same no-decay groups as the other engines.
- `backward(loss, scale_wrt_gas=False)`: DeepSpeed would divide by gradient_accumulation_steps;
  the loop's per-token `loss_scale` already normalises across micro-batches.
- `prescale_gradients: false`, `gradient_predivide_factor: 1.0`: plain average over ranks.
- `communication_data_type: fp32` (the trainer's strategy knob, `loop.strategy_of`): a bf16
  all-reduce/reduce-scatter rounds each partial sum to 8 bits of mantissa (DeepSpeed reduces in
  the parameter dtype by default); the planner counts the fp32 bytes it costs.
- fp16 `loss_scale: 0` (dynamic) with `initial_scale_power: 16`, as torch's GradScaler.
- bucket sizes from the plan/config; on CPU ~1e6 elements (5e8 defaults allocate GBs there).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardwise.plan.emit_deepspeed import comm_dtype, zero_section
from shardwise.specs import Strategy
from shardwise.train.config import TrainConfig
from shardwise.train.engines.base import DistEnv, decay_groups, model_inputs, token_loss_sum

CPU_BUCKET_ELEMENTS = 1_000_000


def ds_config(cfg: TrainConfig, strategy: Strategy, env: DistEnv) -> dict[str, Any]:
    """The DeepSpeed JSON config the trainer uses (also used by the overhead benchmark)."""
    o = cfg.optimizer
    on_cpu = env.device == "cpu"
    bucket = cfg.strategy.bucket_elements or (CPU_BUCKET_ELEMENTS if on_cpu else None)
    zero = zero_section(strategy, bucket=bucket, pin_memory=not on_cpu, gather_16bit_on_save=False)
    # torch AdamW on CPU (no C++ op to build) and for parity; DeepSpeedCPUAdam when offloading
    # from a GPU (its SIMD step is what makes offload usable).
    torch_adam = on_cpu or not strategy.offload_optimizer
    adam: dict[str, Any] = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if torch_adam:
        adam["torch_adam"] = True
        if o.fused if o.fused is not None else not on_cpu:
            adam["fused"] = True
    return {
        "train_micro_batch_size_per_gpu": cfg.run.micro_batch,
        "gradient_accumulation_steps": cfg.run.grad_accum,
        "train_batch_size": cfg.run.micro_batch * cfg.run.grad_accum * env.world_size,
        "gradient_clipping": o.max_grad_norm,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": not torch_adam,
        "bf16": {"enabled": cfg.precision == "bf16-mixed"},
        "fp16": {"enabled": cfg.precision == "fp16-mixed", "loss_scale": 0, "initial_scale_power": 16},
        **comm_dtype(strategy),
        "steps_per_print": 2**31 - 1,  # the trainer logs; DeepSpeed's own prints are noise
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, strategy: Strategy, env: DistEnv):
        if env.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the first deepspeed import
        import deepspeed

        self.cfg, self.env, self.stage = cfg, env, strategy.zero_stage or 0
        self.config = ds_config(cfg, strategy, env)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=decay_groups(model, cfg.optimizer.weight_decay), config=self.config
        )
        self.module = self.ds.module
        self._boundary = True

    def sync_grads(self, enabled: bool):
        # DeepSpeed tracks the accumulation boundary itself (stage 0/1 reduce only there; stage
        # 2/3 reduce-scatter every micro-batch by design). We only check our count matches.
        import contextlib

        self._boundary = enabled
        return contextlib.nullcontext()

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
        if self.ds.is_gradient_accumulation_boundary() != self._boundary:
            raise RuntimeError(
                "DeepSpeed's micro-step counter disagrees with the loop's accumulation boundary"
            )
        labels = batch["labels"].to(self.ds.device)
        logits = self.ds(**model_inputs(batch, self.ds.device)).logits
        loss_sum = token_loss_sum(logits, labels)
        self.ds.backward(loss_sum * loss_scale, scale_wrt_gas=False)
        if not self._boundary:
            self.ds.step()  # advances DeepSpeed's micro-step counter; no update off the boundary
        return loss_sum.detach()

    def step(self) -> float:
        norm = None
        if self.stage == 0 and self.cfg.precision == "fp32":
            # The plain fp32 path clips without recording the norm: measure it (grads are
            # already averaged over ranks at this point).
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads))
        self.ds.step()
        if norm is None:
            n = self.ds.get_global_grad_norm()
            norm = float(n) if n is not None else float("nan")
        return norm

    def zero_grad(self) -> None:
        pass  # DeepSpeed zeroes gradients inside step() at the boundary

    @property
    def lr(self) -> float:
        return self.ds.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for g in self.ds.optimizer.param_groups:
            g["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        # DeepSpeed checkpoints are directories (engine.save_checkpoint); expose the handle.
        return {"deepspeed_engine": self.ds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("DeepSpeed resumes via engine.load_checkpoint(dir)")

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        import deepspeed

        out: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if self.stage == 3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):  # collective
                    if self.env.is_main:
                        out[name] = p.detach().cpu().clone()
            elif self.env.is_main:
                out[name] = p.detach().cpu().clone()
        return out if self.env.is_main else None

    def close(self) -> None:
        self.ds.destroy()
