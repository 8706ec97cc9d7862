"""The decoder-layer class of a model, by name: FSDP's wrap unit (accelerate's
`fsdp_transformer_layer_cls_to_wrap`) and ZeRO-3's leaf (`zero_optimization.leaf_module`)."""

from __future__ import annotations

from shardwise.errors import ShardwiseError
from shardwise.specs.model import ModelSpec

# The decoder block class FSDP wraps one unit per (transformers' names, by model family; the
# class each family's `<Family>ForCausalLM` builds its `model.layers` from). Family "hf" (read on
# the meta device) carries its own: `ModelSpec.inventory.layer_class`.
LAYER_CLASS = {
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "mistral": "MistralDecoderLayer",
    "mixtral": "MixtralDecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
    "qwen3_moe": "Qwen3MoeDecoderLayer",
    "qwen2_moe": "Qwen2MoeDecoderLayer",
    "gemma": "GemmaDecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "gemma3_text": "Gemma3DecoderLayer",  # Gemma3ForCausalLM (text-only) shares the multimodal model's layer
    "phi3": "Phi3DecoderLayer",
    "olmo2": "Olmo2DecoderLayer",
    "deepseek_v3": "DeepseekV3DecoderLayer",
    "mpt": "MptBlock",
    "gpt2": "GPT2Block",
}


def layer_class(model: ModelSpec) -> str:
    """The decoder-layer class name: the unit accelerate's TRANSFORMER_BASED_WRAP wraps for
    FSDP and the leaf ZeRO-3 fetches whole (one unit per layer, as the planner prices them)."""
    if model.inventory is not None:
        return model.inventory.layer_class
    try:
        return LAYER_CLASS[model.family]
    except KeyError:
        raise ShardwiseError(f"no decoder-layer class (FSDP wrap unit, ZeRO-3 leaf) known for model family {model.family!r}") from None
