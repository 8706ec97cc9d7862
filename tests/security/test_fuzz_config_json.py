"""Fuzz of a model directory's config.json (shardwise.specs.hf_config.read_config_json, the
planner's ModelSpec.from_hf_config, preflight's check_model_source): the catalog's configs (every
family shardwise plans analytically, as `to_hf_dict` writes them, plus the RoPE / epsilon fields
real checkpoints carry) with one field replaced by a generated JSON value (NaN, Infinity, huge
and negative numbers, booleans, strings, lists, objects, null), or deleted, or an `auto_map`
added; and the file's bytes mutated. Each either reads, or is one ShardwiseError naming the
file; never another exception. An `auto_map` names a Python file that writes a marker when
imported: without trust_remote_code it is refused, and the marker never appears. Hypothesis
with a fixed seed (derandomize=True)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.catalog import get_model, model_names
from shardwise.config.schema import ModelSection
from shardwise.errors import ShardwiseError
from shardwise.specs.hf_config import read_config_json
from shardwise.specs.model import ModelSpec
from shardwise.train.model.build import check_model_source

# a fixed seed (derandomize), no example database: every CI run tries the same cases
FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

# What real config.json files carry beside the sizes the planner reads (Llama 3.1's RoPE scaling).
REAL = {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_dropout": 0.0, "initializer_range": 0.02,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}  # fmt: skip
BASES = [get_model(n).to_hf_dict() | REAL for n in model_names()]
FAMILIES = {b["model_type"] for b in BASES}
CODE = "import pathlib\npathlib.Path({marker!r}).write_text('the directory code ran')\n"
AUTO_MAP = {"AutoConfig": "custom_code.CustomConfig", "AutoModelForCausalLM": "custom_code.CustomModel"}
NAMES = ["rms_norm_eps", "layer_norm_eps", "rope_theta", "rope_scaling", "partial_rotary_factor", "head_dim",
         "num_key_value_heads", "hidden_size", "vocab_size", "model_type", "text_config", "auto_map",
         "mlp_only_layers", "final_logit_softcapping", "expansion_ratio", "attn_config", "tie_word_embeddings"]  # fmt: skip

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -1, 1, 3, 2**31, 10**40, 1e-300, -0.0]),
    st.text(max_size=10), st.sampled_from([*sorted({b["model_type"] for b in BASES}), "bert", ""]),
)  # fmt: skip
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8) | st.sampled_from(
                                                           ["factor", "rope_type", "short_factor", "rope_theta"]),
                                                           inner, max_size=3)),
                      max_leaves=6)  # fmt: skip


def key_paths(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += key_paths(v, (*prefix, k))
    return out


@st.composite
def mutated(draw) -> dict:
    cfg = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    path = draw(st.sampled_from(key_paths(cfg)) | st.sampled_from(NAMES).map(lambda n: (n,)))
    node = cfg
    for p in path[:-1]:
        node = node[p]
    if draw(st.integers(0, 9)) == 0:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = draw(VALUES)
    if draw(st.booleans()):
        cfg["auto_map"] = AUTO_MAP
    return cfg


def check_dir(d: Path, marker: Path) -> None:
    """Every reader of the directory: a result or one ShardwiseError naming config.json."""
    try:
        cfg, _ = read_config_json(d)
    except ShardwiseError as e:
        assert str(d / "config.json") in str(e), str(e)
        cfg = None
    mt = (cfg or {}).get("model_type", "llama")
    if cfg is not None and (not isinstance(mt, str) or mt in FAMILIES):  # the meta-device path: not here (slow)
        try:
            ModelSpec.from_hf_config(d)
        except ShardwiseError as e:
            assert str(d / "config.json") in str(e), str(e)
    try:
        check_model_source(ModelSection(path=str(d), random_init=True), "fuzz.yaml")
        assert not (cfg or {}).get("auto_map"), "a directory with auto_map passed without trust_remote_code"
    except ShardwiseError as e:
        assert "fuzz.yaml: model.path" in str(e), str(e)
    assert not marker.exists(), "the directory's own code ran"


@settings(FUZZ, max_examples=300)
@given(cfg=mutated())
def test_mutated_config_json_reads_or_is_refused_naming_the_file(cfg):
    """300 cases in CI (fixed seed): one field of a catalog config replaced, deleted, or an
    auto_map added."""
    with tempfile.TemporaryDirectory() as tmp:
        d, marker = Path(tmp) / "model", Path(tmp) / "ran"
        d.mkdir()
        (d / "custom_code.py").write_text(CODE.format(marker=str(marker)))
        (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))
        check_dir(d, marker)


@settings(FUZZ, max_examples=200)
@given(base=st.sampled_from(BASES), cuts=st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=4)),
                                                    max_size=4), truncate=st.booleans())
def test_config_json_with_mutated_bytes_reads_or_is_refused_naming_the_file(base, cuts, truncate):
    """200 cases in CI (fixed seed): a catalog config.json with bytes replaced, or cut short."""
    data = bytearray(json.dumps(base, indent=1).encode())
    for at, new in cuts:
        i = at % len(data)
        data[i:i + len(new)] = new
    if truncate and cuts:
        data = data[: cuts[0][0] % len(data)]
    with tempfile.TemporaryDirectory() as tmp:
        d, marker = Path(tmp) / "model", Path(tmp) / "ran"
        d.mkdir()
        (d / "config.json").write_bytes(bytes(data))
        check_dir(d, marker)


@pytest.mark.parametrize("content", ["[" * 100_000 + "]" * 100_000, '{"a": ' + "9" * 5000 + "}",
                                     '{"hidden_size": 64}' + " " * (17 << 20)], ids=["deep", "digits", "huge"])
def test_config_json_deep_long_or_huge_is_one_error(tmp_path, content):
    """What the fuzz cannot reach in its size: 100k-deep nesting, a 5,000-digit integer, 17 MiB."""
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ShardwiseError, match=str(tmp_path / "config.json")):
        read_config_json(tmp_path)
