"""A model's parameter inventory: each module's direct tensors (`ParamTensor`) and what
`shardwise.specs.hf_meta` reads from a model built on the meta device (`HFInventory`).
ModelSpec carries them; the readers build them (no torch here)."""

from __future__ import annotations

from shardwise.config.base import Spec


class ParamTensor(Spec):
    """One module's direct parameters (weight, optional bias), `count` times (e.g. per layer).

    Kept per module because DeepSpeed's estimators size "the largest layer" by a module's
    direct parameters, and per tensor (`weight`, `bias`) because ZeRO-3 keeps tensors under
    `stage3_param_persistence_threshold` elements whole on every rank. A fused-experts module
    holds two 3-D tensors: gate_up in `weight`, down in `bias`; a module with more direct
    parameters lists the rest in `extra`.
    """

    name: str
    weight: int
    bias: int = 0
    count: int = 1
    layer: bool = True  # inside a decoder layer (an FSDP/ZeRO-3 unit) or in the root group
    extra: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.weight + self.bias + sum(self.extra)


class HFInventory(Spec):
    """What `shardwise.specs.hf_meta` read from a model built on the meta device: the exact
    per-module inventory, `model.parameters()` order and the numbers derived from them."""

    model_type: str
    layer_class: str  # the decoder layer's class name (the FSDP wrap unit)
    tensors: tuple[ParamTensor, ...]
    hf_order: tuple[int, ...]
    layer_sizes: tuple[int, ...]  # parameters of each decoder layer, in order
    largest_module: int
    active_params: int
    expert_params: int  # parameters under modules named "experts" (routed experts)
    embedding_params: int
    config_json: str  # the config.json it was built from (to_hf_dict)
    # per hf_order tensor: whether the trainer's AdamW decays it (specs.train.weight_decayed)
    hf_decayed: tuple[bool, ...] = ()
