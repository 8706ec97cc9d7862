"""The parameter count derived from the architecture equals what transformers builds, to the
parameter, for every catalog entry (built on the meta device: no memory, no weights)."""

from __future__ import annotations

import json

import pytest

from shardwise import catalog
from shardwise.errors import ShardwiseError
from shardwise.specs import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def build_meta(spec: ModelSpec):
    cfg = transformers.AutoConfig.for_model(**spec.to_hf_dict())
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", catalog.model_names())
def test_param_count_matches_transformers(name):
    spec = catalog.get_model(name)
    model = build_meta(spec)
    # tied embeddings are one Parameter object: count each once
    counted = sum({id(p): p.numel() for p in model.parameters()}.values())
    assert spec.params == counted
    # the per-module inventory is the same model: largest module and per-layer sizes
    per_module = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    assert spec.largest_module == max(per_module)
    # params_per_layer is the largest decoder layer (dense and MoE layers differ in deepseek_v3)
    from shardwise.specs.hf_meta import decoder_layers

    layers = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    assert list(spec.layer_sizes) == layers
    assert spec.params_per_layer == max(layers)
    assert spec.root_params == counted - sum(layers)
    # DeepSpeed ZeRO-1/2 flattens the parameters in this order
    assert list(spec.hf_order) == [p.numel() for p in model.parameters()]
    # and groups them as the trainer's AdamW does (train/engines/base.decay_groups), by name and rank
    from shardwise.specs.train import weight_decayed

    assert spec.hf_decayed == tuple(weight_decayed(n, p.ndim) for n, p in model.named_parameters())


def test_published_sizes_sanity():
    # Published headline sizes (model cards), as a guard against a wrong catalog shape.
    assert abs(catalog.get_model("llama-2-7b").params - 6.74e9) < 0.01e9
    assert abs(catalog.get_model("llama-3.1-70b").params - 70.6e9) < 0.1e9
    assert abs(catalog.get_model("mixtral-8x7b").params - 46.7e9) < 0.1e9
    assert abs(catalog.get_model("mixtral-8x7b").active_params - 12.9e9) < 0.1e9
    assert abs(catalog.get_model("qwen2.5-0.5b").params - 0.494e9) < 0.001e9
    # Further families: total (and activated) sizes from each model card.
    def near(name: str, total: float, active: float | None = None, tol: float = 0.01) -> None:
        m = catalog.get_model(name)
        assert abs(m.params - total) / total < tol, (name, m.params)
        if active is not None:
            assert abs(m.active_params - active) / active < 0.03, (name, m.active_params)

    near("qwen3-8b", 8.19e9)  # "8.2B"
    near("qwen3-30b-a3b", 30.5e9, 3.3e9)  # "30.5B total, 3.3B activated"
    near("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9)  # "14.3B total, 2.7B activated"
    near("gemma-7b", 8.54e9)
    near("gemma-2-9b", 9.24e9)
    near("gemma-3-12b", 12.19e9 - 0.42e9)  # 12.2B with the 0.42B SigLIP vision tower, text only here
    near("phi-3-mini", 3.82e9)
    near("olmo-2-7b", 7.30e9)
    near("deepseek-v3", 671e9, 37e9)  # "671B total, 37B activated" (without the 14B MTP module)
    near("mpt-7b", 6.7e9)  # "6.7B parameters"
    # The entries named by Hugging Face ids: the model card's size, else the size its Hub page
    # shows (from the safetensors) where the card says only "8B" or "14B".
    near("llama-3-8b", 8.03e9)
    near("llama-3-70b", 70.6e9)
    near("llama-3.2-1b", 1.23e9)  # "1B (1.23B)"
    near("llama-3.2-3b", 3.21e9)  # "3B (3.21B)"
    near("llama-3.3-70b", 70.6e9)
    near("mistral-7b-v0.3", 7.25e9)
    near("zephyr-7b", 7.24e9)
    near("mixtral-8x22b", 141e9, 39e9)  # "141B parameters, 39B active"
    near("mixtral-8x22b-instruct", 141e9, 39e9)
    near("qwen2.5-1.5b", 1.54e9)  # "Number of Parameters: 1.54B"
    near("qwen2.5-3b", 3.09e9)
    near("qwen2.5-32b", 32.5e9)
    near("qwen3-0.6b", 0.6e9)  # "0.6B"
    near("qwen3-1.7b", 1.7e9, tol=0.02)  # "1.7B" (1.72B counted)
    near("qwen3-4b", 4.0e9)
    near("qwen3-14b", 14.8e9)
    near("qwen3-32b", 32.8e9)
    near("qwen3-30b-a3b-2507", 30.5e9, 3.3e9)  # "30.5B in total, 3.3B activated"
    near("qwen3-235b-a22b", 235e9, 22e9)  # "235B in total, 22B activated"
    near("gemma-2-2b", 2.61e9)
    near("gemma-2-27b", 27.2e9)
    near("gemma-3-1b", 1.0e9)
    near("gemma-3-4b", 4.30e9 - 0.42e9)  # 4.3B with the vision tower, text only here (as gemma-3-12b)
    near("gemma-3-27b", 27.4e9 - 0.42e9)
    near("phi-3.5-mini", 3.82e9)  # "3.8B"
    near("phi-4", 14.7e9)
    near("olmo-2-13b", 13.7e9)
    near("olmo-2-32b", 32.2e9)
    near("smollm2-135m", 135e6)
    near("smollm2-360m", 360e6)
    near("smollm2-1.7b", 1.7e9)


def test_hf_config_roundtrip(tmp_path):
    spec = catalog.get_model("qwen2.5-7b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(spec.to_hf_dict()))
    again = ModelSpec.from_hf_config(path)
    assert again.params == spec.params


def test_malformed_config_names_missing_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(ShardwiseError) as e:
        ModelSpec.from_hf_config(path)
    assert "num_attention_heads" in str(e.value) and str(path) in str(e.value)


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}')
    with pytest.raises(ShardwiseError, match=r"config.json:3"):
        ModelSpec.from_hf_config(path)


def test_unsupported_model_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "not-a-model", "hidden_size": 64}))
    with pytest.raises(ShardwiseError) as e:
        ModelSpec.from_hf_config(path)
    msg = str(e.value)
    assert str(path) in msg and "'not-a-model'" in msg and "llama" in msg and "transformers" in msg, msg


def test_params_default_shape_is_llama2_7b():
    spec = ModelSpec.from_params(7e9)
    ref = catalog.get_model("llama-2-7b")
    assert (spec.hidden_size, spec.num_layers, spec.intermediate_size) == (4096, 32, 11008)
    assert spec.params == ref.params


def test_params_closest_shape():
    for target in (1e9, 13e9, 70e9):
        spec = ModelSpec.from_params(target)
        assert abs(spec.params - target) / target < 0.1


def test_unknown_model_lists_valid():
    with pytest.raises(ShardwiseError) as e:
        catalog.get_model("llama-9")
    assert "llama-2-7b" in str(e.value) and "qwen2.5-72b" in str(e.value)
