"""shardwise.safe_json: the JSON files shardwise reads (checkpoint manifests and state, hardware
profiles) are bounded, strict and fail with a ShardwiseError naming the file.

Python's json alone accepts `NaN` and `Infinity`, reads `1e400` as infinity, raises
RecursionError 100k brackets deep and ValueError on a 5,000-digit integer, and `read_text`
reads `/dev/zero` until memory runs out. Hypothesis feeds arbitrary bytes and generated
near-JSON text (300 cases each, derandomized: a fixed seed).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from shardwise.safe_json import loads, read_bounded, read_json
from shardwise.specs.profile import load_profile


@pytest.mark.parametrize("text, says", [
    ("NaN", "NaN is not a JSON number"),
    ('{"a": -Infinity}', "-Infinity is not a JSON number"),
    ("1e400", "beyond a float's range"),
    ("9" * 5000, "not valid JSON"),
    ("[" * 100_000, "nested too deeply"),
    ('{"a": 1', "not valid JSON"),
    (b"\xff", "not UTF-8"),
])
def test_what_python_json_lets_through_or_crashes_on_is_refused(text, says):
    with pytest.raises(ShardwiseError, match=says) as e:
        loads(text, "the-file.json")
    assert str(e.value).startswith("the-file.json")


def test_files_are_bounded_and_regular(tmp_path):
    f = tmp_path / "big.json"
    with open(f, "wb") as fh:  # sparse: 1 GiB claimed, no disk used
        fh.truncate(1 << 30)
    with pytest.raises(ShardwiseError, match="over the 1024 shardwise reads"):
        read_bounded(f, 1024)
    with pytest.raises(ShardwiseError, match="not a regular file"):
        read_bounded("/dev/zero", 1024)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would block for ever
    with pytest.raises(ShardwiseError, match="not a regular file"):
        read_json(fifo)
    with pytest.raises(ShardwiseError, match="not found"):
        read_json(tmp_path / "missing.json")


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_are_refused(data):
    try:
        loads(data, "f.json")
    except ShardwiseError as e:
        assert str(e).startswith("f.json")


_TOKENS = st.sampled_from(["{", "}", "[", "]", ",", ":", '"a"', "1", "-0", "1e400", "1e-400", "NaN", "Infinity",
                           "true", "null", "9" * 4400, " ", "\\u0000", '"\\ud800"'])


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.lists(_TOKENS, max_size=40))
def test_near_json_parses_to_finite_values_or_is_refused(tokens):
    try:
        value = loads("".join(tokens), "f.json")
    except ShardwiseError as e:
        assert str(e).startswith("f.json")
        return
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            assert v == v and abs(v) != float("inf")
        elif isinstance(v, dict):
            stack += list(v.values())
        elif isinstance(v, list):
            stack += v


@pytest.mark.parametrize("text, says", [
    ('{"gemm_efficiency": NaN}', "NaN"),
    ('{"hbm_bytes_per_s": 1e400}', "beyond a float's range"),
    ("[" * 50_000 + "]" * 50_000, "nested too deeply"),
])
def test_a_hostile_hardware_profile_is_refused_naming_it(tmp_path, text, says):
    f = tmp_path / "hardware-profile.json"
    f.write_text(text)
    with pytest.raises(ShardwiseError, match=says) as e:
        load_profile(f)
    assert str(f) in str(e.value)
