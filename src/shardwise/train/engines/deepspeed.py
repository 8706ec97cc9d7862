"""DeepSpeed ZeRO stages 0-3 via `deepspeed.initialize`, with optimizer/parameter offload.

The JSON config is `shardwise.run.deepspeed_config(run)`: the same builder `plan --emit` and
the benches use (its docstring lists the settings made explicit for parity). Two settings
are the engine's own:
- `backward(loss, scale_wrt_gas=False)`: DeepSpeed would divide by gradient_accumulation_steps;
  the loop's per-token `loss_scale` already normalises across micro-batches;
- `step()` after every micro-batch: DeepSpeed counts micro-steps and updates only at the
  accumulation boundary.
"""

from __future__ import annotations

import os

import torch

from shardwise.run import RunSpec, deepspeed_config
from shardwise.train.engines.base import DistEnv, decay_groups, model_inputs, token_loss_sum


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, run: RunSpec, env: DistEnv):
        if env.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the first deepspeed import
        import deepspeed

        self.run, self.env, self.stage = run, env, run.strategy.zero_stage or 0
        self.config = deepspeed_config(run)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=decay_groups(model, run.config.optimizer.weight_decay),
            config=self.config,
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
        if self.stage == 0 and self.run.train.compute_dtype == "fp32":
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
