"""FSDP2: `fully_shard` on every decoder layer and at the root (torchtitan's layout).

- full: decoder layers reshard after forward as `strategy.fsdp.reshard_after_forward` says
  (params re-gathered in backward: ZeRO-3 memory): every layer but the last ("not-last", the
  default), every layer ("layers"), every layer and the root ("all", stock `fully_shard`), or none.
- grad-op: reshard_after_forward=False (params stay gathered between forward and backward,
  like ZeRO-2's memory for params during the step; gradients still reduce-scattered).
- hybrid: a 2-D (replicate, shard) mesh: shard inside a group, replicate across groups.
- `strategy.fsdp.wrap_embeddings`: the token embedding and [final norm, lm_head] as units of their
  own (torchtune's `custom_sharded_layers`, accelerate's layout), untied models at pp 1.
The mesh comes from the run's ParallelLayout (shardwise.train.engines.mesh), the knobs from its
Strategy: what the preflight planned. Gradients are reduce-scattered with averaging over the
data-parallel ranks (FSDP2 default), which is what the loop's `loss_scale` assumes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shardwise.plan.stage import carves_embeddings
from shardwise.run import RunSpec
from shardwise.train.engines._torch_common import (
    TorchOptimizerEngine,
    autocast,
    build_adamw,
    compute_dtype,
    full_state_dict,
    grad_scaler,
)
from shardwise.train.engines.base import DistEnv, evaluate_loss_sum, forward_loss_sum
from shardwise.train.engines.mesh import build_mesh, data_parallel_mesh
from shardwise.train.model.hf import decoder_layers, final_norm
from shardwise.train.model.weights import materialize


def shard_model(model: torch.nn.Module, run: RunSpec, mesh: Any, device: torch.device) -> torch.nn.Module:
    """`fully_shard` every decoder layer, then the root, as `run.strategy` says (also used on
    fake tensors by the full-size trace, shardwise.bench.fsdp_trace)."""
    s = run.strategy
    kw: dict[str, Any] = {"mesh": data_parallel_mesh(mesh)}
    if run.train.mixed_precision:
        # Compute in low precision; reduce in the knob's dtype (default fp32: a bf16
        # reduce-scatter over many ranks loses digits the fp32 master update then keeps).
        # fp32 and bf16-pure take no policy: the parameters already are the compute dtype, so
        # they are gathered as they are and their gradients reduce-scattered in it: bf16 under
        # bf16-pure, as planned and as torchtune runs it (the reduce_dtype knob is mixed
        # precision's; an fp32 reduce would sum more exactly, in buffers twice the size, and
        # still round the result into the bf16 sharded gradient).
        param = compute_dtype(run)
        reduce = torch.float32 if s.fsdp.reduce_dtype == "fp32" else param
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    if s.offload_params or s.offload_optimizer:
        kw["offload_policy"] = CPUOffloadPolicy()
    elif next(model.parameters()).device not in (device, torch.device("meta")):
        model = model.to(device)  # a meta model is allocated after sharding (weights.materialize)
    if run.layout.tp > 1:  # TP first, then FSDP2 over dp_shard (torchtitan's order): 2-D DTensors
        from shardwise.train.model.tensor_parallel import parallelize, tp_mesh_of

        parallelize(model, tp_mesh_of(mesh))
        if run.layout.dp == 1:  # TP alone: no data-parallel group to shard over
            return model
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer is the first one backward needs: resharding it after forward would only
        # gather it again at once (torchtitan keeps it; "not-last", the default). The memory is
        # the same: backward prefetches one layer anyway (plan/memory.py counts two layers
        # gathered). "all" is stock fully_shard's (accelerate, HF Trainer, torchtune).
        fully_shard(layer, reshard_after_forward=s.reshards_layer(last=i == len(layers) - 1), **kw)
    embedding, head = carved_units(model, run)
    if embedding is not None:
        # fsdp.wrap_embeddings: the token embedding and the head (final norm + lm_head) as units
        # of their own, gathered only around their forward and backward (torchtune's
        # custom_sharded_layers, accelerate 1.16's fsdp2_prepare_model); the embedding reshards
        # as the layers do, the head, first in backward, as the root does
        fully_shard(embedding, reshard_after_forward=s.reshards_embedding, **kw)
        fully_shard(head, reshard_after_forward=s.reshards_root, **kw)
    # The root keeps embeddings, final norm and lm_head (tied weights stay in one unit);
    # it is needed right after forward anyway, so it does not reshard in between, except under
    # "all", stock's: users pass reshard_after_forward=True to the root too, and torch then
    # reshards it and gathers it again in backward (Strategy.reshards_root).
    fully_shard(model, reshard_after_forward=s.reshards_root, **kw)
    return model


def carved_units(model: torch.nn.Module, run: RunSpec) -> tuple[Any, Any]:
    """The modules `strategy.fsdp.wrap_embeddings` shards apart from the root: (the input
    embedding, [final norm, lm_head]); (None, None) where it does not apply: the knob off, tied
    embeddings (one parameter stays in one unit), a pipeline stage (each keeps its root whole)."""
    if not carves_embeddings(run.strategy, tied=False, pp=run.layout.pp):  # the knob off, or a pipeline stage
        return None, None  # (a stage module has neither accessor: asked only past this)
    embedding, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    if lm_head is None or not carves_embeddings(run.strategy, embedding.weight is lm_head.weight, run.layout.pp):
        return None, None
    return embedding, [final_norm(model), lm_head]


def loss_parallel_if_needed(run: RunSpec):
    """TP with the standard loss: the logits stay a vocabulary shard (Shard(-1)); torch's
    loss_parallel computes F.cross_entropy on it, forward and backward inside the context.
    (The chunked loss is vocab-parallel itself: shardwise.train.model.loss.)"""
    if run.layout.tp > 1 and run.train.cross_entropy == "standard":
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _whole(loss: torch.Tensor) -> torch.Tensor:
    """loss_parallel's loss is a replicated DTensor: its (equal) local value."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


class FSDP2Engine(TorchOptimizerEngine):
    name = "fsdp2"
    takes_mesh = True  # build_engine passes the caller's device mesh

    def __init__(self, model: torch.nn.Module, run: RunSpec, env: DistEnv, mesh: Any = None):
        self.run, self.env = run, env
        self.mesh = mesh if mesh is not None else build_mesh(run.layout, env.torch_device.type)
        self.module = shard_model(model, run, self.mesh, env.torch_device)
        # A meta-built model (a local checkpoint): each rank allocates and reads its shard only
        # (host memory, where CPUOffloadPolicy keeps the shards).
        offload = run.strategy.offload_params or run.strategy.offload_optimizer
        materialize(self.module, torch.device("cpu") if offload else env.torch_device)
        self.optimizer = build_adamw(run, self.module, env)
        self.scaler = grad_scaler(run, env)

    def sync_grads(self, enabled: bool):
        # Held (RunSpec.grad_sync: the plan's decision, shardwise.plan.grad_sync): FSDP2
        # accumulates unsharded grads locally while sync is off; the last micro-batch
        # reduce-scatters the sum once. Else torch's default: a reduce-scatter per micro-batch
        # into the sharded grads.
        sync = self.run.grad_sync
        if isinstance(self.module, FSDPModule):  # not under TP alone (no data-parallel group)
            self.module.set_requires_gradient_sync(enabled or sync is None or not sync.hold)
        return contextlib.nullcontext()

    def _amp(self):
        # TP alone has no fully_shard, so no MixedPrecisionPolicy: low precision comes from
        # autocast over fp32 weights, as in the DDP engine (and torchtitan's TP-only runs); the
        # plan is DDP's at that tp (Strategy.single_rank_ddp)
        if self.run.layout.tp > 1 and self.run.layout.dp == 1:
            return autocast(self.run, self.env)
        return None

    def _loss_parallel(self):
        return loss_parallel_if_needed(self.run)

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
        self._reshard_after_eval()
        with self._loss_parallel():
            loss_sum = forward_loss_sum(self.module, self.module, batch, self.env.torch_device, self.run.train,
                                        amp=self._amp())
            loss = loss_sum * loss_scale
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        return _whole(loss_sum).detach()

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # A forward without backward leaves the root (unless "all") and the last
        # layer unsharded: kept so for the pass's next batch, resharded before anything that
        # needs the sharded parameters (the next training forward, a checkpoint, an export).
        self._evaluated = True
        with self._loss_parallel():
            return _whole(evaluate_loss_sum(self.module, self.module, batch, self.env.torch_device, self.run.train,
                                            amp=self._amp()))

    def _reshard_after_eval(self) -> None:
        if getattr(self, "_evaluated", False):
            self._reshard()
            self._evaluated = False

    def _global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        # clip_grad_norm_ on DTensors all-reduces the partial norms: a global norm (a device
        # collective, no host sync).
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _reshard(self) -> None:
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        # A forward without backward (an evaluation) leaves the root unsharded: its parameters
        # are then not the sharded ones the optimizer holds state for. Reshard first.
        self._reshard()
        return super()._state_dicts()

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        self._reshard_after_eval()
        return full_state_dict(self.module, self.env.is_main)  # collective: all ranks call it

    def close(self) -> None:
        self.close_optimizer()
