"""Tensor and sequence parallelism (`strategy.tp`): DTensor `parallelize_module` plans per family,
applied before FSDP2's `fully_shard` over `dp_shard` (torchtitan's `parallelize_llama` order).

The plan of a Llama/Qwen2/Mistral decoder (transformers' module names), Megatron-LM's sequence
parallelism as torchtitan writes it:

- `model.embed_tokens`: RowwiseParallel over the vocabulary (each rank holds V/tp rows; the
  masked lookup's partial sums are reduce-scattered over the sequence: output Shard(1));
- `input_layernorm`, `post_attention_layernorm`, `model.norm`: SequenceParallel (each rank
  normalises its S/tp positions; the weight's gradient is all-reduced over tp);
- `self_attn`: its `hidden_states` all-gathered over the sequence (Shard(1) → Replicate), then
  q/k/v ColwiseParallel (each rank computes its num_heads/tp query heads and num_kv_heads/tp
  key/value heads: transformers 5.24's Llama/Qwen2 attention reshapes with
  `view(*input_shape, -1, head_dim)`, so local heads need no config change) and o_proj
  RowwiseParallel with output Shard(1) (a reduce-scatter);
- `mlp`: the same all-gather, gate/up ColwiseParallel, down RowwiseParallel → Shard(1);
- `lm_head`: ColwiseParallel over the vocabulary, input Shard(1) (all-gathered), output the
  logits' vocabulary shard (Shard(-1)) which never becomes whole: the chunked loss computes the
  cross-entropy on the shard (shardwise.train.model.loss, vocab-parallel), the standard loss through
  torch's `loss_parallel()`.

Between layers the hidden states stay DTensors of the global shape (Shard(1)), so transformers'
mask and position code, which reads `inputs_embeds.shape[1]`, sees the whole sequence. The
attention's and the MLP's input is a replicated DTensor (the whole sequence); the projections'
outputs are local tensors (local heads), so the attention kernels, packed documents
(position_ids, the per-document SDPA, a dense mask) and RoPE work unchanged.

A tied lm_head (Qwen2's tie_word_embeddings) is sharded like the embedding (dim 0 over tp) and
tied again after the plan distributed each module's copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.errors import ShardwiseError


class VocabParallelHead(ColwiseParallel):
    """ColwiseParallel lm_head whose forward may return the chunked loss sum (a plain 0-d tensor,
    already whole on every TP rank) instead of the logits' vocabulary shard: passed through."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # type: ignore[override]
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def layer_plan() -> dict[str, Any]:
    """One decoder layer's plan (transformers' names for Llama, Qwen2, Mistral). The attention's
    and the MLP's input stays a Replicate DTensor (not a local tensor): the input gradients of
    q/k/v (gate/up) then add up as one Partial, reduce-scattered once in backward, where local
    inputs would all-reduce each branch's gradient on its own (3 + 2 all-reduces per layer)."""
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": row,
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def root_plan() -> dict[str, Any]:
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": VocabParallelHead(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def parallelize(model: torch.nn.Module, tp_mesh: Any) -> torch.nn.Module:
    """Apply the plan in place (every parameter becomes a DTensor on `tp_mesh`); returns `model`:
    a CausalLM, or a pipeline stage (shardwise.train.model.pipeline), which lacks the root modules
    of the other stages."""
    from shardwise.train.model.hf import decoder_layers

    embed, head = _present(model, "model.embed_tokens"), _present(model, "lm_head")
    tied = embed is not None and head is not None and head.weight is embed.weight
    for layer in decoder_layers(model):
        attn = layer.self_attn
        heads = getattr(attn.config, "num_attention_heads", None)
        if heads is not None and heads % tp_mesh.size():
            raise ShardwiseError(f"tp {tp_mesh.size()} does not divide the {heads} attention heads")
        parallelize_module(layer, tp_mesh, layer_plan())
    parallelize_module(model, tp_mesh, {k: v for k, v in root_plan().items() if _present(model, k) is not None})
    if tied:  # each module's copy was distributed on its own: one parameter again (both Shard(0))
        head.weight = embed.weight
    return model


def _present(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The submodule `name` where this model (or stage) holds one with parameters, else None."""
    try:
        mod = model.get_submodule(name)
    except AttributeError:
        return None
    return mod if mod is not None and any(True for _ in mod.parameters()) else None


def tp_mesh_of(mesh: Any) -> Any | None:
    """The `tp` sub-mesh of the run's mesh (None without TP)."""
    names = mesh.mesh_dim_names or ()
    return mesh["tp"] if "tp" in names else None
