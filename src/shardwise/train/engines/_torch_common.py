"""What the DDP and FSDP2 engines share: AdamW construction (one optimizer, or one per parameter
stepped in backward; torch's AdamW, or a low-bit one: shardwise.train.engines.low_bit), autocast,
fp16 loss scaling, and the optimizer side of the Engine protocol (both own their optimizers)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from shardwise.run import RunSpec
from shardwise.train.engines import low_bit
from shardwise.train.engines.base import DistEnv, accumulate, decay_groups

# TrainSpec.compute_dtype -> torch dtype: the one place precision names become torch dtypes.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(run: RunSpec) -> torch.dtype:
    return TORCH_DTYPES[run.train.compute_dtype]


def master_dtype(run: RunSpec) -> torch.dtype:
    """The dtype of the parameters the optimizer updates (so of their gradients and AdamW's
    states, which torch creates like the parameters): fp32, bf16 under bf16-pure."""
    return TORCH_DTYPES[run.train.master_dtype]


def build_adamw(run: RunSpec, model: torch.nn.Module, env: DistEnv) -> torch.optim.Optimizer:
    """AdamW with every default that matters stated: weight decay (torch's default is 0.01),
    betas, eps. Fused where the device has it (CUDA), else the for-loop/foreach reference; the
    low-bit `optimizer.name`s build their library's AdamW with the same values and groups.
    With `optimizer.in_backward`, an InBackwardAdamW: the same AdamW per parameter."""
    o = run.config.optimizer
    if o.in_backward:
        return InBackwardAdamW(run, model, env)
    return _adamw(run, decay_groups(model, o.weight_decay), env)


def _adamw(run: RunSpec, groups: list[dict[str, Any]], env: DistEnv) -> torch.optim.Optimizer:
    o = run.config.optimizer
    if low_bit.is_low_bit(o.name):
        return low_bit.build(o.name, groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                             source=run.config.source)
    kw: dict[str, Any] = {"fused": True} if o.fused_on(env.device) else {}
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **kw)


class InBackwardAdamW:
    """The optimizer step in backward (`optimizer.in_backward`, torchtune's optimizer_in_bwd): one
    AdamW per trainable parameter, stepped by that parameter's post-accumulate-grad hook as soon
    as its gradient is final (FSDP2 runs the hook on the sharded parameter after its
    reduce-scatter), the gradient freed at once: no step ever holds every gradient.

    The contract, checked before any rank starts (shardwise.train.preflight): no clipping by the
    global norm (no update may wait for every gradient), one micro-batch per step, FSDP2 or an
    unwrapped replica (a DDP reducer keeps every gradient's bucket, and its hook fires before the
    all-reduce), no fp16 loss scaling. A parameter whose gradient is not finite is not updated (a
    per-parameter skip: the update cannot wait for the global norm); the step then reports a
    non-finite norm, so the loop counts it skipped. `finish_step` returns the global gradient
    norm, summed from the squares each hook saw."""

    def __init__(self, run: RunSpec, model: torch.nn.Module, env: DistEnv):
        o = run.config.optimizer
        self.by_param: dict[torch.nn.Parameter, torch.optim.Optimizer] = {
            p: _adamw(run, [{**group, "params": [p]}], env)
            for group in decay_groups(model, o.weight_decay) for p in group["params"]}
        self.optimizers = list(self.by_param.values())
        self._squares: torch.Tensor | None = None  # Σ‖g‖² of this step's gradients (a Partial DTensor when sharded)
        self._handles = [p.register_post_accumulate_grad_hook(self._step_one) for p in self.by_param]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def _step_one(self, p: torch.Tensor) -> None:
        grad = p.grad
        squares = grad.detach().float().square().sum()
        self._squares = squares if self._squares is None else self._squares + squares
        local = squares.to_local() if isinstance(squares, DTensor) else squares
        opt = self.by_param[p]
        if getattr(opt, "_step_supports_amp_scaling", False):  # fused: skipped on the device, no sync
            opt.found_inf = torch.isfinite(local).logical_not().to(torch.float32)  # type: ignore[attr-defined]
            try:
                opt.step()
            finally:
                del opt.found_inf  # type: ignore[attr-defined]
        elif bool(torch.isfinite(local)):
            opt.step()
        p.grad = None

    def finish_step(self) -> torch.Tensor:
        """The step's global gradient norm (one all-reduce where the parameters are sharded);
        the next step starts from zero."""
        squares, self._squares = self._squares, None
        if squares is None:
            return torch.zeros(())
        total = squares.full_tensor() if isinstance(squares, DTensor) else squares
        return total.sqrt()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        for opt in self.optimizers:
            opt.state.clear()


def autocast(run: RunSpec, env: DistEnv):
    """Mixed precision for the replicated engine: autocast keeps fp32 weights and grads. None
    for fp32, and for bf16-pure, whose weights are bf16 already (nothing to cast)."""
    if not run.train.mixed_precision:
        return contextlib.nullcontext()
    return torch.autocast(env.torch_device.type, dtype=compute_dtype(run))


def grad_scaler(run: RunSpec, env: DistEnv) -> torch.amp.GradScaler | None:
    """fp16 needs dynamic loss scaling (bf16 and fp32 do not: same exponent range as fp32)."""
    if run.train.compute_dtype != "fp16":
        return None
    return torch.amp.GradScaler(env.torch_device.type)


def full_state_dict(module: torch.nn.Module, is_main: bool) -> dict[str, torch.Tensor] | None:
    """The whole model on rank 0's host (None elsewhere): `get_model_state_dict` with
    `full_state_dict` and `cpu_offload` gathers each DTensor in turn (a collective: every rank
    calls it) and keeps it on rank 0 only. A tensor that is already a CPU one comes back as
    itself; those are cloned, so the result is a snapshot, not a view of the live weights."""
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    live = {_local(t).untyped_storage().data_ptr() for t in module.state_dict().values()}
    return {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in full.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def set_lr(optimizer: torch.optim.Optimizer | InBackwardAdamW, lr: float) -> None:
    for g in optimizer.param_groups:
        low_bit.set_lr(g, lr)


class TorchOptimizerEngine:
    """step/zero_grad/lr for engines that own `self.module`, `self.optimizer` and
    `self.scaler` (fp16 only). Subclasses provide sync_grads, forward_backward, the
    consolidated state dict and close; `_global_norm` turns the clipped norm into one number."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | InBackwardAdamW
    scaler: torch.amp.GradScaler | None
    run: RunSpec

    forward_backward_step = accumulate  # the micro-batches one after another (engines/base.py)

    def _global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients to a global norm of at most `max_norm`; return the global norm."""
        return self._global_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def step(self) -> torch.Tensor:
        """Clip and update, unless the global gradient norm is not finite: then the update is
        skipped (weights, AdamW's moments and step count untouched), as fp16's GradScaler skips an
        overflowing step. The norm is global (all-reduced), so every rank skips the same step.
        A NaN norm would otherwise make the clip coefficient NaN and every weight with it.

        Returns the norm as a 0-dim tensor where clipping computed it (on the device): the loop
        reads it at its logging interval. The skip needs no host sync where the optimizer takes
        the decision on the device: torch's fused AdamW (`_step_supports_amp_scaling`) reads the
        optimizer's `found_inf` attribute, which GradScaler sets, inside its kernel and leaves
        parameters, moments and the step count as they were when it is 1 (torch/optim/adam.py,
        `_fused_adam`: the step count it increments is decremented by found_inf). Elsewhere one
        `bool()` of `isfinite(norm)` decides: the step's one host sync.

        In backward (InBackwardAdamW) the updates are done when this is called: the norm only."""
        if isinstance(self.optimizer, InBackwardAdamW):
            return self.optimizer.finish_step().detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.run.config.optimizer.max_grad_norm or float("inf")
        norm = self._clip(params, max_norm).detach()
        opt = self.optimizer
        if self.scaler:
            self.scaler.step(opt)  # skips the update itself when it found inf/NaN
            self.scaler.update()
        elif getattr(opt, "_step_supports_amp_scaling", False):
            opt.found_inf = torch.isfinite(norm).logical_not().to(torch.float32)  # type: ignore[attr-defined]
            try:
                opt.step()
            finally:
                del opt.found_inf  # type: ignore[attr-defined]
        elif bool(torch.isfinite(norm)):
            opt.step()
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def close_optimizer(self) -> None:
        """Drop the optimizer's state (and the hooks of one stepped in backward)."""
        if isinstance(self.optimizer, InBackwardAdamW):
            self.optimizer.close()
        else:
            self.optimizer.state.clear()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])  # a tensor in torchao's groups

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    # --- checkpoints: torch's state-dict API, mapped onto the canonical names ------------------

    def _low_bit(self) -> bool:
        return low_bit.is_low_bit(self.run.config.optimizer.name)

    def _init_optimizer_state(self) -> None:
        """AdamW creates its state at the first step; a checkpoint loads into it, so create it
        now exactly as `torch.optim.AdamW._init_group` would (zeros, step 0). Not the library's
        `state_dict._init_optim_state`, which get_state_dict calls on an optimizer without state:
        it takes a zero-lr step, leaving the step count at 1, so a save before the first applied
        update (every step skipped as non-finite) would change the next update's bias correction.
        (The low-bit optimizers' states exist from the start: low_bit.init_states.)"""
        if self._low_bit():
            for opt in self._optimizers():
                low_bit.init_states(opt)
            return
        for group in self.optimizer.param_groups:
            opt = self._owner(group)
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                st = opt.state[p]
                if st:
                    continue
                st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                              else torch.tensor(0.0, dtype=torch.float32))
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """`get_state_dict`: the model's and the optimizer's state keyed by FQN, aliasing the live
        tensors (DTensor shards under FSDP2), frozen parameters left out (a LoRA base)."""
        self._init_optimizer_state()
        return get_state_dict(self.module, self._optimizers(), options=StateDictOptions(ignore_frozen_params=True))

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        opt = self.optimizer
        return list(opt.optimizers) if isinstance(opt, InBackwardAdamW) else [opt]

    def _owner(self, group: dict[str, Any]) -> torch.optim.Optimizer:
        """The torch optimizer whose `param_groups` holds `group`."""
        return next(o for o in self._optimizers() if any(g is group for g in o.param_groups))

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        model_sd, optim_sd = self._state_dicts()
        if self._low_bit():  # plain codes and scales (low_bit's module docstring), never the subclasses
            params = low_bit.entries(self._optimizers(), optim_sd)
            tensors, step = low_bit.canonical(params)
            tensors |= {f"model.{fqn}": model_sd[fqn] for fqn, _, _ in params}
        else:
            tensors, step = to_canonical(model_sd, optim_sd)
        return tensors, {"optimizer_step": step, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_checkpoint_state(self, read: Any, extra: dict[str, Any]) -> None:
        model_sd, optim_sd = self._state_dicts()
        if self._low_bit():
            self._load_low_bit(read, extra, model_sd, optim_sd)
            return
        tensors, _ = to_canonical(model_sd, optim_sd)
        read(tensors)  # in place: DCP copies each key's slice into this rank's tensors
        model_sd, optim_sd = from_canonical(tensors, optim_sd, int(extra["optimizer_step"]))
        # strict=False: the dict holds the trained parameters only (no frozen base, buffers or
        # second name of a tied weight); a name the model lacks would be a bug here (asserted).
        missing = set_state_dict(self.module, self._optimizers(), model_state_dict=model_sd,
                                 optim_state_dict=optim_sd, options=StateDictOptions(strict=False))
        assert not missing.unexpected_keys, missing.unexpected_keys
        if self.scaler and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])

    def _load_low_bit(self, read: Any, extra: dict[str, Any], model_sd: dict[str, Any],
                      optim_sd: dict[str, Any]) -> None:
        """The low-bit states read into the live ones (low_bit.load; the optimizer's own
        load_state_dict would cast and copy the subclasses), the model as above."""
        params = low_bit.entries(self._optimizers(), optim_sd)
        model = {f"model.{fqn}": model_sd[fqn] for fqn, _, _ in params}
        low_bit.load(params, read.saved, read, model, int(extra["optimizer_step"]))
        model_sd = {fqn: model[f"model.{fqn}"] for fqn, _, _ in params}
        missing = set_model_state_dict(self.module, model_sd, options=StateDictOptions(strict=False))
        assert not missing.unexpected_keys, missing.unexpected_keys
        if self.scaler and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])


# The canonical checkpoint (shardwise.train.checkpoint.sharded) names each trained parameter's master value
# and AdamW moments by FQN: `model.<fqn>`, `optim.exp_avg.<fqn>`, `optim.exp_avg_sq.<fqn>`. The
# DeepSpeed engine maps ZeRO's flat partitions onto the same names.
MOMENTS = ("exp_avg", "exp_avg_sq")


def to_canonical(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
    """get_state_dict's output -> the canonical tensors (the same objects, no copies) and the
    optimizer's step count. The parameters are those the optimizer holds state for, named as
    `named_parameters()` names them (a tied weight once, under its first name)."""
    tensors: dict[str, torch.Tensor] = {}
    step = 0
    for fqn, st in optim_sd["state"].items():
        tensors[f"model.{fqn}"] = model_sd[fqn]
        for m in MOMENTS:
            tensors[f"optim.{m}.{fqn}"] = st[m]
        step = int(st["step"])
    return tensors, step


def from_canonical(tensors: dict[str, torch.Tensor], optim_sd: dict[str, Any],
                   step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The inverse, for `set_state_dict`: the canonical tensors back under get_state_dict's keys,
    every parameter's step count set to `step`, the optimizer's own `param_groups` (lr, betas,
    weight decay come from the config and the schedule, not from the checkpoint)."""
    model_sd: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for fqn, st in optim_sd["state"].items():
        model_sd[fqn] = tensors[f"model.{fqn}"]
        st["step"].fill_(float(step))  # AdamW's own step tensor, one per parameter (never shared)
        state[fqn] = {**st, **{m: tensors[f"optim.{m}.{fqn}"] for m in MOMENTS}}
    return model_sd, {"state": state, "param_groups": optim_sd["param_groups"]}
