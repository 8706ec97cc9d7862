"""Pipeline stages of an HF decoder CausalLM (strategy.pp > 1), cut by decoder layers as
shardwise.specs.pipeline splits them: the embedding with the first stage, the final norm and the
loss head with the last, every module under its original name (`model.layers.17.mlp.up_proj.weight`
on whichever rank holds layer 17), so checkpoints, weight loading and export never see a stage.

A stage runs transformers' own decoder forward (`LlamaModel.forward` and its Qwen2/Qwen3/Mistral
siblings) over its layers only: the module holding them is a shallow copy of the HF inner model
whose `layers` keeps the stage's layers under their original indices, whose embedding is absent
(later stages take the hidden states as `inputs_embeds`), and whose final norm is an identity
before the last stage. The masks, rotary embeddings and packed-attention keywords are therefore
computed exactly as in the unsplit model, so a pipeline run's losses equal one process's.
Per-layer-type masks (Qwen2/Qwen3 `layer_types`) are looked up by the loop's position, so each
stage's copy of the config lists its own layers' types.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from shardwise.train.model.weights import PENDING_ATTR, Pending, pending


class StageModule(nn.Module):
    """The modules one pipeline stage (or one rank's stages) runs, as children `model` (the HF inner
    model, pruned) and `lm_head` (last stage only): the CausalLM's own names.

    forward(x, **kw): `x` is the input ids on the first stage, else the previous stage's hidden
    states; `kw` are the model's keyword inputs (positions, masks, packed-attention boundaries) and
    `labels`. The last stage returns the chunked loss's fp32 sum (its LossHead, `loss_chunk` tokens
    at a time) or the logits (the standard loss); the others their hidden states, as plain tensors
    (a TP stage's sequence-sharded DTensor is sent as its local shard)."""

    def __init__(self, causal: nn.Module, layers: list[int], *, first: bool, last: bool):
        super().__init__()
        inner = causal.model
        part = copy.copy(inner)  # the HF model object, with its own child and parameter tables
        part._modules = OrderedDict(inner._modules)
        part._parameters = OrderedDict(inner._parameters)
        part._buffers = OrderedDict(inner._buffers)
        held = nn.ModuleList()
        held._modules = OrderedDict((str(i), inner.layers[i]) for i in layers)  # original indices
        part.layers = held
        if not first:
            part.embed_tokens = None
        if not last:
            part.norm = nn.Identity()
        part.config = _stage_config(inner.config, layers)
        self.model = part
        self.lm_head = causal.lm_head if last else None
        self.config = causal.config
        self.causal_lm_class = type(causal)  # what the loss head's support is read from (train.model.loss)
        self.first, self.last = first, last
        self.loss_chunk: int | None = None  # the chunked loss (LossHead) when set, else logits
        self.amp: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        self.tp_mesh: Any = None  # a TP stage: its hidden states travel as the local sequence shard

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        with self.amp():
            if self.first:
                out = self.model(input_ids=x, use_cache=False, **kw).last_hidden_state
            else:
                out = self.model(inputs_embeds=self._from_wire(x), use_cache=False, **kw).last_hidden_state
            if not self.last:
                return self._to_wire(out)
            if self.loss_chunk is None:
                return self.lm_head(out)
            from shardwise.train.model.loss import computing

            assert labels is not None
            with computing(self, labels, self.loss_chunk):
                return self.lm_head(out)

    def get_output_embeddings(self) -> nn.Module | None:
        return self.lm_head

    def _to_wire(self, h: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return h.to_local() if isinstance(h, DTensor) else h

    def _from_wire(self, h: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return h
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False)


def _stage_config(config: Any, layers: list[int]) -> Any:
    """The inner model's config for a stage: its decoder forward reads `layer_types[i]` for the
    i-th layer it runs, so the list names the stage's layers; everything else is the model's."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return config
    own = copy.copy(config)
    object.__setattr__(own, "layer_types", [types[i] for i in layers])
    return own


def split(model: nn.Module, stage_ranges: list[range], local: list[int]) -> tuple[StageModule, list[StageModule]]:
    """This rank's part of `model` (an HF CausalLM, on meta or CPU): one StageModule over all the
    layers of its stages `local` (indices into `stage_ranges`) — the module the engine's optimizer,
    checkpoints and export read — and one StageModule per local stage (the same submodules) for
    torch's PipelineStage; one rank's only stage is both. The rest of the model is dropped, and a
    pending weight read (a meta build) is narrowed to the tensors this rank holds."""
    last_stage = len(stage_ranges) - 1
    held = [i for s in local for i in stage_ranges[s]]
    whole = StageModule(model, held, first=0 in local, last=last_stage in local)
    stages = [whole] if len(local) == 1 else [
        StageModule(model, list(stage_ranges[s]), first=s == 0, last=s == last_stage) for s in local]
    todo = pending(model)
    if todo is not None:
        names = {n for n, _ in whole.named_parameters()}
        setattr(whole, PENDING_ATTR, Pending(todo.path, todo.format,
                                             {n: v for n, v in todo.initial.items() if n in names},
                                             dict(todo.buffers)))
    return whole, stages
