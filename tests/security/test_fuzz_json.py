"""shardwise.config.file's strict JSON (checkpoint manifests and state, hardware profiles, plan
inputs): generated text parses to finite values or is refused with a ShardwiseError naming the
file. Hypothesis, 300 cases each, derandomized (a fixed seed): arbitrary bytes, and near-JSON
built from tokens that trip Python's json (NaN, Infinity, 1e400, 4,400-digit integers, lone
surrogates, unbalanced brackets)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.config.file import parse_json
from shardwise.errors import ShardwiseError


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_are_refused(data):
    try:
        parse_json(data.decode("utf-8", "replace"), Path("f.json"))
    except ShardwiseError as e:
        assert str(e).startswith("f.json")


_TOKENS = st.sampled_from(["{", "}", "[", "]", ",", ":", '"a"', "1", "-0", "1e400", "1e-400", "NaN", "Infinity",
                           "true", "null", "9" * 4400, " ", "\\u0000", '"\\ud800"'])


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.lists(_TOKENS, max_size=40))
def test_near_json_parses_to_finite_values_or_is_refused(tokens):
    try:
        value = parse_json("".join(tokens), Path("f.json"))
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
