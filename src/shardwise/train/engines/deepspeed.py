"""DeepSpeed ZeRO stages 0-3 via `deepspeed.initialize`, with optimizer/parameter offload, and
ZeRO-1/2 × TP through DeepSpeed's AutoTP training (the config's `tensor_parallel` block: AutoTP
shards the decoder linears inside `deepspeed.initialize`; `autotp_shards` maps each shard onto
its canonical full tensor for checkpoints and the final weights).

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
from typing import Any

import torch

from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec, deepspeed_config
from shardwise.train.engines.base import (
    DistEnv,
    accumulate,
    decay_groups,
    evaluate_loss_sum,
    forward_loss_sum,
)


def _no_scheduler(optimizer: Any) -> None:
    """`deepspeed.initialize(lr_scheduler=...)`: no DeepSpeed scheduler (see DeepSpeedEngine)."""
    return None


def deepspeed_comm() -> None:
    """DeepSpeed's communication backend on the process group this rank joined, calling torch's
    current collectives. DeepSpeed 0.19's TorchBackend picks `torch.distributed.all_gather_into_tensor`
    and `reduce_scatter_tensor` by name (`get_all_gather_function`); torch 2.13 deprecated both for
    `all_gather_single` / `reduce_scatter_single`, which take the same arguments (the old names
    now only warn and call them). Under ZeRO-3 every layer's fetch and every gradient
    reduce-scatter went through the old names: a FutureWarning per call, 480 lines in a 60-step
    demo. Only DeepSpeed's own choice of the deprecated function is replaced; a DeepSpeed or torch
    that does anything else is left alone. No process group yet: nothing to do (DeepSpeed makes
    its own, and the engine calls this again after)."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return
    import deepspeed
    from deepspeed import comm

    if comm.comm.cdb is None:
        deepspeed.init_distributed(dist_backend=tdist.get_backend())
    cdb = comm.comm.cdb
    for attr, old, new in (("all_gather_function", "all_gather_into_tensor", "all_gather_single"),
                           ("reduce_scatter_function", "reduce_scatter_tensor", "reduce_scatter_single")):
        if (hasattr(tdist, new) and getattr(tdist, old, None) is not None
                and getattr(cdb, attr, None) is getattr(tdist, old)):
            setattr(cdb, attr, getattr(tdist, new))


def autotp_shards(module: torch.nn.Module) -> dict[int, tuple[Any, int]]:
    """id(parameter) -> (its AutoTP layer, the dimension AutoTP split it along) for every
    TP-sharded parameter: a column-parallel `LinearLayer`'s weight and bias (dim 0), a
    row-parallel `LinearAllreduce`'s weight (dim 1; its bias stays whole). Parameters not listed
    are replicated over the TP group. The split sizes and this rank's index are the layer's
    (`_partition_sizes`, `tp_index`): DeepSpeed's own `gather_params` gathers with them."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, TensorParallel_Layer

    out: dict[int, tuple[Any, int]] = {}
    for name, m in module.named_modules():
        if not isinstance(m, TensorParallel_Layer) or not getattr(m, "is_tp_parallel", True):
            continue
        if type(m) is LinearLayer:
            out |= {id(t): (m, 0) for t in (m.weight, m.bias) if t is not None}
        elif type(m) is LinearAllreduce:
            out[id(m.weight)] = (m, 1)
        else:
            raise ShardwiseError(f"AutoTP replaced {name} with {type(m).__name__}: shardwise maps only "
                                 "LinearLayer / LinearAllreduce shards onto the canonical checkpoint")
    return out


class DeepSpeedEngine:
    name = "deepspeed"
    libraries = ("deepspeed", "deepspeed.comm")  # imported when it starts (a forking launcher imports them once for all ranks)

    def __init__(self, model: torch.nn.Module, run: RunSpec, env: DistEnv):
        if env.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the first deepspeed import
        import deepspeed

        self.run, self.env, self.stage = run, env, run.strategy.zero_stage or 0
        from shardwise.train.model.weights import materialize

        materialize(model, env.torch_device)  # ZeRO-0/1/2 from a meta build: a replica per rank
        self.config = deepspeed_config(run)
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if "leaf_module" in self.config["zero_optimization"] and embed is not None and not embed.weight.requires_grad:
            # A ZeRO-3 leaf reduces its gradients from a full backward hook, which fires at the start of
            # the leaf's backward when none of its inputs requires grad (the first layer behind a
            # frozen embedding: LoRA) — before its adapters' gradients exist. Making the embedding's
            # output require grad (PEFT's recipe for checkpointing) moves it to the end of the layer.
            model.enable_input_require_grads()
        deepspeed_comm()
        # The loop is the schedule (`set_lr` before every step, on every engine alike). The JSON's
        # `scheduler` block stays (it is `plan --emit`'s ds_config.json, for scripts of your own),
        # but DeepSpeed must not build it here: its constructor reads the lr before step 0 (DeepSpeed
        # logs "Attempting to get learning rate from scheduler before it has started", once per
        # rank, and sets every group's lr to 0), and each update would then write its own lr into
        # the param groups. A client scheduler factory that returns None wins over the config's.
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=decay_groups(model, run.config.optimizer.weight_decay),
            config=self.config, lr_scheduler=_no_scheduler,
        )
        deepspeed_comm()  # a backend DeepSpeed initialised itself (no process group before)
        self.module = self.ds.module
        self._tp = autotp_shards(self.module) if run.layout.tp > 1 else {}
        self._check_fetch_unit()
        self._boundary = True

    def _check_fetch_unit(self) -> None:
        """DeepSpeed silently skips leaf classes it does not find: a planned per-layer fetch that
        fell back to per-submodule hooks would run several times slower than planned."""
        leaf = self.config["zero_optimization"].get("leaf_module")
        if self.stage != 3 or leaf is None:
            return
        from deepspeed.utils import get_z3_leaf_modules

        found, want = len(get_z3_leaf_modules(self.module)), self.run.model.num_layers
        if found != want:
            raise ShardwiseError(
                f"ZeRO-3 fetch unit: {found} modules of class {leaf['classes']} in the model, expected one per "
                f"decoder layer ({want}); set strategy.deepspeed.fetch_unit: module")

    def sync_grads(self, enabled: bool):
        # DeepSpeed tracks the accumulation boundary itself (stage 0/1 reduce only there; stage
        # 2/3 reduce-scatter every micro-batch by design). We only check our count matches.
        import contextlib

        self._boundary = enabled
        return contextlib.nullcontext()

    forward_backward_step = accumulate  # the micro-batches one after another (engines/base.py)

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
        if self.ds.is_gradient_accumulation_boundary() != self._boundary:
            raise RuntimeError(
                "DeepSpeed's micro-step counter disagrees with the loop's accumulation boundary"
            )
        loss_sum = forward_loss_sum(self.ds, self.module, batch, self.ds.device, self.run.train)
        self.ds.backward(loss_sum * loss_scale, scale_wrt_gas=False)
        if not self._boundary:
            self.ds.step()  # advances DeepSpeed's micro-step counter; no update off the boundary
        return loss_sum.detach()

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # DeepSpeedEngine's forward (ZeRO-3 gathers and releases each layer's parameters), no
        # backward and no `ds.step()`: the micro-step counter and the gradients are untouched.
        return evaluate_loss_sum(self.ds, self.module, batch, self.ds.device, self.run.train)

    def step(self) -> torch.Tensor | float:
        """DeepSpeed's ZeRO-1/2/3 and bf16 optimizers skip a step whose gradient norm is not
        finite themselves (they report the norm as inf). The plain fp32 ZeRO-0 path does not: it
        clips and applies whatever it has. There the norm is measured here (grads are already
        averaged over ranks, so every rank sees the same), and a non-finite one skips the
        update (`_skip_update`): that decision is shardwise's one host sync of the step.
        Returns the norm as DeepSpeed gives it (a float or a 0-dim device tensor, copied: the
        loop reads it at its logging interval); DeepSpeed's own syncs are inside `ds.step()`."""
        if self.stage == 0 and self.run.train.compute_dtype == "fp32":
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads).detach()
            if not bool(torch.isfinite(norm)):
                self._skip_update()
            else:
                self.ds.step()
            return norm
        self.ds.step()
        n = self.ds.get_global_grad_norm()
        if n is None:
            return float("nan")
        return n.detach().clone() if isinstance(n, torch.Tensor) else float(n)

    def _skip_update(self) -> None:
        """`ds.step()` with the optimizer's update replaced by nothing for this one call: DeepSpeed
        still advances its step counters and zeroes the gradients, as after an fp16 overflow."""
        opt = self.ds.optimizer
        own = vars(opt).get("step")  # an instance attribute (a profiler hook), or the class's method
        opt.step = lambda *args, **kwargs: None
        try:
            self.ds.step()
        finally:
            if own is None:
                del opt.step
            else:
                opt.step = own

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
            elif id(p) in self._tp:  # collective over the TP group
                full = self._gather_tp(p, p.detach())
                if self.env.is_main:
                    out[name] = full.cpu().clone()
            elif self.env.is_main:
                out[name] = p.detach().cpu().clone()
        return out if self.env.is_main else None

    # --- AutoTP: a sharded linear's slice <-> its full tensor (the canonical checkpoint's) --------

    def _gather_tp(self, p: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor:
        """The full tensor of `value` (this rank's TP slice of `p`, or a moment of that slice):
        all-gathered over the TP group along the dimension AutoTP split (collective)."""
        module, dim = self._tp[id(p)]
        return module._all_gather_shards(value, module._partition_sizes, dim)

    def _slice_tp(self, p: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP slice of a full tensor of `p` (the split AutoTP made at initialize)."""
        module, dim = self._tp[id(p)]
        return full.split(module._partition_sizes, dim=dim)[module.tp_index].contiguous()

    # --- checkpoints: DeepSpeed's flat partitions mapped onto the canonical names -------------
    # deepspeed.utils' tensor-fragment API assembles (get) or scatters (set) one parameter's fp32
    # master value or Adam moment from/into ZeRO's flat partitions, for stages 1-3 and the bf16
    # optimizer. Stage 0 in fp32 has no partitions: the module's params are the master weights.

    _MOMENTS = ("exp_avg", "exp_avg_sq")
    _LOAD_CHUNK_ELEMENTS = 1 << 28  # full tensors materialised per rank at a time while loading

    def _base_optimizer(self) -> torch.optim.Optimizer:
        opt = self.ds.optimizer
        return getattr(opt, "optimizer", opt)

    def _named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @staticmethod
    def _partitioned(p: torch.nn.Parameter) -> bool:
        # Every param of a partitioned optimizer carries `_hp_mapping`; it is None on the ranks
        # that own no slice of it, which must still join the collective that assembles it.
        return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")

    def _full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        if id(p) in self._tp:
            module, dim = self._tp[id(p)]
            shape = list(p.shape)
            shape[dim] = sum(module._partition_sizes)
            return torch.Size(shape)
        return p.ds_shape if hasattr(p, "ds_shape") else p.shape

    def _owners(self, sizes: list[int]) -> list[int]:
        """Which rank writes each parameter: largest first to the least-loaded rank, so a big
        (tied) embedding does not pile onto rank 0 as a round-robin by position would. Every
        rank computes the same answer from the same sizes."""
        load = [0] * self.env.world_size
        owner = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
            r = min(range(len(load)), key=lambda k: (load[k], k))
            owner[i], load[r] = r, load[r] + sizes[i]
        return owner

    def _optimizer_step(self) -> int:
        for st in self._base_optimizer().state.values():
            if "step" in st:
                return int(st["step"])
        return 0

    def _ensure_optimizer_state(self) -> None:
        """AdamW's state exists only after a step, and ZeRO-1/2 link each parameter to its
        slice of that state once, after the first step of its *first* param group — before
        the other groups have any state (DeepSpeed 0.19 steps groups one at a time), so with a
        weight-decay split the no-decay group is never linked. Create any missing state as
        `torch.optim.AdamW` would (zeros, step 0) and link every group again."""
        base = self._base_optimizer()
        opt = self.ds.optimizer
        on_device = any(g.get("fused") or g.get("capturable") for g in base.param_groups)
        # ZeRO-3 empties the groups between steps and hands AdamW one flat partition at a time.
        flat = getattr(opt, "fp32_partitioned_groups_flat", None)
        for hp in flat if flat is not None else [hp for g in base.param_groups for hp in g["params"]]:
            if hp is not None:
                st = base.state[hp]
                if "exp_avg" in st:
                    continue
                st["step"] = (torch.zeros((), dtype=torch.float32, device=hp.device) if on_device
                              else torch.tensor(0.0, dtype=torch.float32))
                st["exp_avg"] = torch.zeros_like(hp, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(hp, memory_format=torch.preserve_format)
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def _loss_scaler(self) -> Any:
        return getattr(self.ds.optimizer, "loss_scaler", None)

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._ensure_optimizer_state()
        base = self._base_optimizer()
        tensors: dict[str, torch.Tensor] = {}
        params = self._named_params()
        owner = self._owners([self._full_shape(p).numel() for _, p in params])
        for i, (name, p) in enumerate(params):
            if self._partitioned(p):  # collective: every rank assembles, one keeps
                values = [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k) for k in self._MOMENTS]
            else:
                st = base.state.get(p, {})
                values = [p.detach().float()] + [st.get(k, torch.zeros_like(p, dtype=torch.float32))
                                                 for k in self._MOMENTS]
            if id(p) in self._tp:  # collective over the TP group: the full tensors, by name
                values = [self._gather_tp(p, v) for v in values]
            if owner[i] == self.env.rank:
                # DCP writes synchronously: no copy beyond the one off the device (none on CPU)
                for key, v in zip(("model", *(f"optim.{k}" for k in self._MOMENTS)), values, strict=True):
                    tensors[f"{key}.{name}"] = v.detach().to("cpu", torch.float32)
        scaler = self._loss_scaler()
        extra = {
            "optimizer_step": self._optimizer_step(),
            "scaler": {k: getattr(scaler, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter")
                       if isinstance(getattr(scaler, k, None), (int, float))} if scaler is not None else None,
        }
        return tensors, extra

    def load_checkpoint_state(self, read: Any, extra: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        self._ensure_optimizer_state()
        base = self._base_optimizer()
        params = self._named_params()
        chunk: list[tuple[str, torch.nn.Parameter]] = []
        size = 0
        for j, (name, p) in enumerate(params):
            chunk.append((name, p))
            size += self._full_shape(p).numel() * 3
            if size < self._LOAD_CHUNK_ELEMENTS and j + 1 < len(params):
                continue
            keys = [(f"{k}.{n}", q) for n, q in chunk for k in ("model", *(f"optim.{m}" for m in self._MOMENTS))]
            tensors = {k: torch.empty(self._full_shape(q), dtype=torch.float32) for k, q in keys}
            read(tensors)
            for n, q in chunk:
                value = tensors[f"model.{n}"].to(q.device)
                moments = {m: tensors[f"optim.{m}.{n}"].to(q.device) for m in self._MOMENTS}
                if id(q) in self._tp:
                    value = self._slice_tp(q, value)
                    moments = {m: self._slice_tp(q, t) for m, t in moments.items()}
                if self._partitioned(q):
                    safe_set_full_fp32_param(q, value)
                    for m, t in moments.items():
                        safe_set_full_optimizer_state(q, t, m)
                else:
                    with torch.no_grad():
                        q.copy_(value)
                    st = base.state[q]
                    for m, t in moments.items():
                        st[m] = t.clone()
                    st.setdefault("step", torch.tensor(0.0))
            chunk, size = [], 0
        step = float(extra["optimizer_step"])
        for st in base.state.values():
            if "step" in st:
                if torch.is_tensor(st["step"]):
                    st["step"].fill_(step)
                else:
                    st["step"] = int(step)
        self._refresh_low_precision()
        scaler = self._loss_scaler()
        for k, v in (extra.get("scaler") or {}).items():
            if scaler is not None and hasattr(scaler, k):
                setattr(scaler, k, v)

    def _refresh_low_precision(self) -> None:
        """Copy the loaded fp32 masters into the weights forward uses (DeepSpeed does the same
        after each step): stages 1/2 and the bf16 optimizer have `update_lp_params`; stage 3
        copies each flat fp32 partition into its compute partition."""
        opt = self.ds.optimizer
        if hasattr(opt, "update_lp_params"):
            opt.update_lp_params()
        elif hasattr(opt, "fp32_partitioned_groups_flat"):
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)

    def close(self) -> None:
        self.ds.destroy()
