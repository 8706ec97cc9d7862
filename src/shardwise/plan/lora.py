"""LoRA adapters: which matrices get them and how many trainable parameters they add. Pure.

One place for the adapter count, shared by the communication model (plan/comm.py: only
adapter gradients are reduced) and, later, the memory model (plan/memory.py `_lora`).

A LoRA adapter of rank r on a linear d_in → d_out is two matrices, A (r × d_in) and
B (d_out × r): r·(d_in + d_out) parameters (PEFT `LoraLayer`). PEFT keeps them in fp32 under
a bf16/fp16 base (`autocast_adapter_dtype=True`, its default).
"""

from __future__ import annotations

from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec


def target_dims(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of every linear LoRA can target in one decoder layer, by module name."""
    h, i = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (h, model.q_dim), "k_proj": (h, model.kv_dim), "v_proj": (h, model.kv_dim),
        "o_proj": (model.q_dim, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


def adapter_tensors(model: ModelSpec, train: TrainSpec, tp: int = 1) -> list[tuple[float, int]]:
    """(elements on one TP rank, tensors per layer) of each adapter matrix (A and B of every
    targeted linear); targets the model does not have are ignored."""
    dims = target_dims(model)
    r = train.lora_rank
    out: list[tuple[float, int]] = []
    for t in train.lora_targets:
        if t in dims and r:
            d_in, d_out = dims[t]
            out += [(r * d_in / tp, 1), (r * d_out / tp, 1)]
    return out


def adapter_params_per_layer(model: ModelSpec, train: TrainSpec) -> int:
    """Trainable parameters LoRA adds to one decoder layer: Σ r·(d_in + d_out) over the targets."""
    dims = target_dims(model)
    return sum(train.lora_rank * sum(dims[t]) for t in train.lora_targets if t in dims)


def adapter_params(model: ModelSpec, train: TrainSpec, tp: int = 1, pp: int = 1) -> float:
    """Trainable adapter parameters one GPU's model replica holds: the layers of the fullest
    pipeline stage, split over the TP ranks (0 without LoRA)."""
    if not train.lora_rank:
        return 0.0
    return adapter_params_per_layer(model, train) * -(-model.num_layers // pp) / tp
