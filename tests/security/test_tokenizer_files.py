"""Hostile tokenizer files: refused with a ShardwiseError naming the file, never code run.

Before: a tokenizer_config.json nested 100k deep ended in a RecursionError traceback, a broken
tokenizer.json in "cannot load DIR" naming no file, NaN passed, and any size was read. Now the
files are checked first (shardwise.data.tokenizer_check). A `tokenizer_class` or `auto_map`
naming the directory's own code never imports it without trust_remote_code (the marker).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.data import default_tokenizer_path, load_tokenizer
from shardwise.errors import ShardwiseError

CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def tokenizer(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(default_tokenizer_path(), d)
    return d


def config(d: Path) -> dict:
    return json.loads((d / "tokenizer_config.json").read_text())


BAD = {  # name -> (file, writer, expected fragment)
    "config not JSON": ("tokenizer_config.json", lambda d: "{bad", "malformed JSON"),
    "config NaN": ("tokenizer_config.json", lambda d: json.dumps(config(d) | {"model_max_length": float("nan")}),
                   "NaN is not JSON"),
    "config 100k deep": ("tokenizer_config.json", lambda d: '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",
                         "nested too deeply"),
    "config 40 deep": ("tokenizer_config.json", lambda d: json.dumps(config(d) | {"x": json.loads("[" * 40 + "]" * 40)}),
                       "nested more than 32"),
    "config a list": ("tokenizer_config.json", lambda d: "[]", "expected a JSON object"),
    "config a number": ("tokenizer_config.json", lambda d: "0", "expected a JSON object"),  # found by the fuzz test
    "special tokens Infinity": ("special_tokens_map.json", lambda d: '{"x": Infinity}', "Infinity is not JSON"),
    "tokenizer.json not JSON": ("tokenizer.json", lambda d: "{bad", "not a valid tokenizer.json"),
    "tokenizer.json NaN": ("tokenizer.json", lambda d: (d / "tokenizer.json").read_text()[:-2] + ', "x": NaN}',
                           "not a valid tokenizer.json"),
    "tokenizer.json 100k deep": ("tokenizer.json", lambda d: '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                 "not a valid tokenizer.json"),
    "template not UTF-8": ("chat_template.jinja", lambda d: b"\xff\xfe{{ x }}", "not UTF-8"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_malformed_tokenizer_file_is_named(tmp_path, name):
    file, write, fragment = BAD[name]
    d = tokenizer(tmp_path, "tok")
    content = write(d)
    (d / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ShardwiseError) as info:
        load_tokenizer(d)
    assert str(d / file) in str(info.value) and fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_a_huge_tokenizer_file_is_refused_unread(tmp_path, file):
    """A sparse file of 1 GiB (no disk used): refused by its size, before anything reads it."""
    d = tokenizer(tmp_path, "tok")
    with (d / file).open("r+b") as f:
        f.truncate(1 << 30)
    with pytest.raises(ShardwiseError, match="over the bound") as info:
        load_tokenizer(d)
    assert str(d / file) in str(info.value)


def test_a_custom_tokenizer_class_never_imports_code(tmp_path):
    """`tokenizer_class` naming the directory's own module, with no auto_map: nothing is
    imported (transformers looks the name up in its own classes only)."""
    marker = tmp_path / "MARKER"
    d = tokenizer(tmp_path, "tok")
    (d / "custom_tokenizer.py").write_text(CODE.format(marker=str(marker)))
    (d / "tokenizer_config.json").write_text(json.dumps(config(d) | {"tokenizer_class": "custom_tokenizer.Evil"}))
    try:
        load_tokenizer(d)
    except ShardwiseError as exc:
        assert str(d) in str(exc)
    assert not marker.exists()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)  # fmt: skip
KEYS = st.sampled_from(["auto_map", "tokenizer_class", "chat_template", "eos_token", "bos_token", "pad_token",
                        "model_max_length", "added_tokens_decoder", "extra_special_tokens", "clean_up_tokenization_spaces",
                        "x"])  # fmt: skip


@settings(derandomize=True, max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(edits=st.dictionaries(KEYS, JSON_VALUES, max_size=3), raw=st.none() | st.binary(max_size=60))
def test_fuzz_tokenizer_config_loads_or_is_refused_naming_a_file(tmp_path, edits, raw):
    """25 generated tokenizer_config.json files (fixed seed: derandomize): edited fields
    (auto_map, tokenizer_class, chat_template, special tokens, NaN, nesting) or raw bytes. Each
    loads, or fails with a ShardwiseError naming the directory or one of its files; the
    directory's own code (custom_code.py) never runs."""
    marker = tmp_path / "MARKER"
    d = tokenizer(tmp_path, "tok")
    (d / "custom_code.py").write_text(CODE.format(marker=str(marker)))
    if "auto_map" in edits and isinstance(edits["auto_map"], dict):
        edits["auto_map"] = edits["auto_map"] | {"AutoTokenizer": [None, "custom_code.T"]}
    text = raw if raw is not None else json.dumps(config(d) | edits).encode()
    (d / "tokenizer_config.json").write_bytes(text)
    try:
        tok = load_tokenizer(d)
        from shardwise.data.template import make_renderer

        make_renderer(tok)
    except ShardwiseError as exc:
        assert str(d) in str(exc) or "chat_template" in str(exc), str(exc)
    assert not marker.exists()
