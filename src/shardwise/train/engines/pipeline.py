"""Pipeline parallelism (strategy.pp > 1) with torch.distributed.pipelining, the library torchtitan
runs: each pipeline rank builds its stages (shardwise.train.model.pipeline: decoder layers split as
shardwise.specs.pipeline says, original names), applies the run's TP plan and FSDP2 over the
data-parallel ranks of its stage exactly as the FSDP2 engine does to a whole model
(engines/fsdp.shard_model: DP × TP × PP on the one device mesh), and runs one step's micro-batches
through torch's schedule (GPipe, 1F1B, interleaved 1F1B).

The contracts of every engine hold:
- the loss: the last stage computes each micro-batch's fp32 token-loss sum (the chunked LossHead or
  the standard loss) and backpropagates it times the loop's `loss_scale` (the step's global target
  count is known before the step); torch's own division by the micro-batch count is off
  (`scale_grads=False`);
- clipping by the norm of every stage's gradients: each rank's norm over its data-parallel and TP
  shards (DTensor), squared and summed over the pipeline ranks, then torch's
  `clip_grads_with_norm_` (torchtitan's `clip_grad_norm_` with a pp mesh); a non-finite global
  norm skips the update on every rank alike;
- checkpoints in the canonical names: each rank saves the tensors of its stages, DCP merges them,
  and any layout (another pp, FSDP2, ZeRO-3) reads them back;
- evaluation: the stages run in order, each sending its hidden states to the next (no schedule:
  a validation batch need not have the training micro-batches' shape).

Every micro-batch of a step must have one shape (torch's stages fix their buffers at the first
step): the data path pads them (shardwise.train.sft_data, for pp > 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise.run import RunSpec
from shardwise.specs.pipeline import rank_stages, stage_layers
from shardwise.train.engines._torch_common import (
    TORCH_DTYPES,
    TorchOptimizerEngine,
    autocast,
    build_adamw,
)
from shardwise.train.engines.base import DistEnv, model_inputs, token_loss_sum
from shardwise.train.engines.fsdp import _whole, loss_parallel_if_needed, shard_model
from shardwise.train.engines.mesh import build_mesh
from shardwise.train.model.hf import decoder_layers
from shardwise.train.model.pipeline import split
from shardwise.train.model.weights import materialize


def _schedule_class(name: str) -> type:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}[name]


class PipelineEngine(TorchOptimizerEngine):
    name = "pipeline"
    takes_mesh = True

    def __init__(self, model: torch.nn.Module, run: RunSpec, env: DistEnv, mesh: Any = None):
        from torch.distributed.pipelining import PipelineStage

        self.run, self.env = run, env
        self.mesh = mesh if mesh is not None else build_mesh(run.layout, env.torch_device.type)
        lay, s = run.layout, run.strategy
        pp_mesh = self.mesh["pp"]
        self.pp_group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.num_stages = lay.pp * s.pp_virtual_stages
        self.local = rank_stages(self.pp_rank, lay.pp, s.pp_virtual_stages)
        whole, self.parts = split(model, stage_layers(len(decoder_layers(model)), self.num_stages), self.local)
        device = env.torch_device
        from shardwise.train.model.tensor_parallel import tp_mesh_of

        tp_mesh = tp_mesh_of(self.mesh)
        for part in self.parts:
            shard_model(part, run, self.mesh, device)
            part.loss_chunk = run.train.ce_chunk if run.train.cross_entropy == "chunked" else None
            part.tp_mesh = tp_mesh
            if lay.tp > 1 and lay.dp == 1:  # TP without FSDP2 (engines/fsdp._amp): autocast gives the precision
                part.amp = lambda: autocast(run, env)
        self.module = whole
        materialize(self.module, device)
        self.optimizer = build_adamw(run, self.module, env)
        self.scaler = None  # fp16 is refused with pp > 1 (shardwise.run.resolve.check_pipeline)
        self.stages = [PipelineStage(part, idx, self.num_stages, device, group=self.pp_group)
                       for part, idx in zip(self.parts, self.local, strict=True)]
        cls = _schedule_class(s.pp_schedule)
        target = self.stages if s.pp_schedule == "interleaved-1f1b" else self.stages[0]
        self.schedule = cls(target, n_microbatches=run.config.run.grad_accum, loss_fn=self._loss, scale_grads=False)
        self._scale = 1.0
        self._sums: list[torch.Tensor] = []

    @property
    def holds_loss(self) -> bool:
        """This rank runs the last stage (it alone computes the loss)."""
        return self.num_stages - 1 in self.local

    # --- one step: every micro-batch through the schedule -------------------------------------

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """torch's loss_fn on the last stage: the micro-batch's fp32 loss sum (kept for the record)
        times the loop's loss scale."""
        total = output if self.run.train.cross_entropy == "chunked" else token_loss_sum(output, labels)
        self._sums.append(_whole(total).detach())
        return total * self._scale

    def forward_backward_step(self, micro: list[dict[str, torch.Tensor]], loss_scale: float) -> torch.Tensor:
        """Forward and backward of the step's micro-batches in the schedule's order; the fp32 loss
        sum over them on the last stage's ranks, 0 elsewhere."""
        self._reshard_after_eval()
        shapes = {tuple(b["input_ids"].shape) for b in micro}
        if len(shapes) != 1:
            raise RuntimeError(f"pipeline stages need one shape for all micro-batches of a step; got {sorted(shapes)}")
        device = self.env.torch_device
        args, kwargs, targets = [], [], []
        for b in micro:
            inputs = model_inputs(b, device)
            args.append((inputs.pop("input_ids"),))
            labels = b["labels"].to(device, non_blocking=True)
            kwargs.append({**inputs, "labels": labels})
            targets.append(labels)
        self._scale, self._sums = loss_scale, []
        sched = self.schedule
        # The loop's micro-batches as they are (torch's step() would torch.chunk one whole batch,
        # which cannot carry each packed micro-batch's document boundaries); what step() does
        # first, then its micro-batch loop.
        for stage in self.stages:
            stage.has_backward = True
            stage.clear_runtime_states()
        with loss_parallel_if_needed(self.run):  # TP's standard loss on the logits' vocabulary shards
            sched._step_microbatches(args, kwargs, targets, None, False)
        if not self._sums:
            return torch.zeros((), dtype=torch.float64, device=device)
        # the last len(micro): at the first step the stages' shape inference calls the loss too
        return torch.stack(self._sums[-len(micro):]).double().sum()

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
        raise NotImplementedError("a pipeline runs a step's micro-batches together: forward_backward_step")

    def sync_grads(self, enabled: bool):
        raise NotImplementedError("torch's schedule decides the gradient reduction of each micro-batch")

    # --- evaluation: the stages in order, hidden states sent along ----------------------------

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self._evaluated = True
        device = self.env.torch_device
        inputs = model_inputs(batch, device)
        ids = inputs.pop("input_ids")
        labels = batch["labels"].to(device)
        out = torch.zeros((), dtype=torch.float32, device=device)
        modes = [p.training for p in self.parts]
        for p in self.parts:
            p.train(False)
        try:
            with torch.no_grad(), loss_parallel_if_needed(self.run):
                for s in range(self.num_stages):
                    if s not in self.local:
                        continue
                    part = self.parts[self.local.index(s)]
                    x = ids if s == 0 else self._recv(s - 1)
                    y = part(x, labels=labels, **inputs)
                    if s < self.num_stages - 1:
                        self._send(y, s + 1)
                    elif part.loss_chunk is None:
                        out = _whole(token_loss_sum(y, labels))
                    else:
                        out = y.float()
        finally:
            for p, mode in zip(self.parts, modes, strict=True):
                p.train(mode)
        return out.detach()

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.pp_group, stage % self.run.layout.pp)

    def _send(self, t: torch.Tensor, stage: int) -> None:
        """Hidden states to `stage`'s rank: a header (dtype, rank, shape) then the tensor."""
        code = list(TORCH_DTYPES.values()).index(t.dtype)
        header = torch.tensor([code, t.dim(), *t.shape] + [0] * (6 - t.dim()), dtype=torch.int64, device=t.device)
        dist.send(header, self._peer(stage), group=self.pp_group)
        dist.send(t.contiguous(), self._peer(stage), group=self.pp_group)

    def _recv(self, stage: int) -> torch.Tensor:
        device = self.env.torch_device
        header = torch.empty(8, dtype=torch.int64, device=device)
        dist.recv(header, self._peer(stage), group=self.pp_group)
        code, ndim, *dims = header.tolist()
        t = torch.empty(dims[:ndim], dtype=list(TORCH_DTYPES.values())[code], device=device)
        dist.recv(t, self._peer(stage), group=self.pp_group)
        return t

    # --- the optimizer step: clipping over every stage ----------------------------------------

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The global gradient norm over all stages (each rank's, DTensor-reduced over its shards,
        squared and summed over the pipeline ranks), then every gradient scaled by torch's
        `clip_grads_with_norm_` with it."""
        grads = [p.grad for p in params]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self.env.torch_device)
        if isinstance(local, DTensor):
            local = local.full_tensor()
        squares = local.float().square()
        dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt()
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # --- FSDP2 under the stages ----------------------------------------------------------------

    def _fsdp_modules(self) -> list[FSDPModule]:
        seen: dict[int, FSDPModule] = {}
        for root in [self.module, *self.parts]:
            for m in root.modules():
                if isinstance(m, FSDPModule):
                    seen.setdefault(id(m), m)
        return list(seen.values())

    def _reshard_after_eval(self) -> None:
        if getattr(self, "_evaluated", False):
            self._reshard()
            self._evaluated = False

    def _reshard(self) -> None:
        for m in self._fsdp_modules():
            m.reshard()

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self._reshard()
        return super()._state_dicts()

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model on rank 0: each stage's full tensors (gathered over its data-parallel
        and TP ranks), sent by the first rank of each stage to rank 0. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._reshard_after_eval()
        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        mine = {k: v.detach().cpu().clone() for k, v in full.items()} if self._stage_leader() else {}
        del full
        parts: list[Any] = [None] * dist.get_world_size() if self.env.is_main else []
        dist.gather_object(mine, parts if self.env.is_main else None, dst=0)
        if not self.env.is_main:
            return None
        merged: dict[str, torch.Tensor] = {}
        for p in parts:
            merged.update(p)
        return merged

    def _stage_leader(self) -> bool:
        """The first rank (in the mesh's order) of this rank's pipeline stage."""
        coords = self.mesh.get_coordinate() or []
        names = self.mesh.mesh_dim_names or ()
        return all(c == 0 for n, c in zip(names, coords, strict=True) if n != "pp")

    def close(self) -> None:
        self.close_optimizer()

