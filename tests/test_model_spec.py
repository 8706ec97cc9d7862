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
    layer0 = model.model.layers[0]
    assert spec.params_per_layer == sum(p.numel() for p in layer0.parameters())


def test_published_sizes_sanity():
    # Published headline sizes (model cards), as a guard against a wrong catalog shape.
    assert abs(catalog.get_model("llama-2-7b").params - 6.74e9) < 0.01e9
    assert abs(catalog.get_model("llama-3.1-70b").params - 70.6e9) < 0.1e9
    assert abs(catalog.get_model("mixtral-8x7b").params - 46.7e9) < 0.1e9
    assert abs(catalog.get_model("mixtral-8x7b").active_params - 12.9e9) < 0.1e9
    assert abs(catalog.get_model("qwen2.5-0.5b").params - 0.494e9) < 0.001e9


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
    path.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ShardwiseError, match=r"gpt2.*supported: llama"):
        ModelSpec.from_hf_config(path)


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
