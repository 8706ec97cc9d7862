"""Bad input names file, line and field; skip mode counts instead; random records never crash."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sft_records import chat

from shardwise.config.data import DataConfig
from shardwise.data import build_dataset
from shardwise.errors import ShardwiseError

GOOD = chat("q", "a")

BAD = {  # name -> (record or raw line, expected message fragment)
    "malformed_json": ('{"messages": [', r"data\.jsonl:2: malformed JSON"),
    "missing_field": ({"instruction": "x"}, r"data\.jsonl:2: field 'output': missing"),
    "unknown_role": ({"messages": [{"role": "robot", "content": "x"}]},
                     r"data\.jsonl:2: field 'messages\[0\]\.role': unknown role 'robot'"),
    "empty_conversation": ({"messages": []}, r"data\.jsonl:2: field 'messages': empty conversation"),
    "no_target_tokens": ({"messages": [{"role": "user", "content": "only a question"}]},
                         r"data\.jsonl:2: field 'messages': no target tokens"),
    # `datasets` 5.2 segfaults on this line; the loader must turn it into an error instead.
    "not_an_object": ("null", r"data\.jsonl:2: expected a JSON object per record, got NoneType"),
    "wrong_type": ({"messages": [{"role": "user", "content": 3}]},
                   r"data\.jsonl:2: field 'messages\[0\]\.content': expected a string, got int"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_record_raises_with_location(tok, write_jsonl, name):
    bad, message = BAD[name]
    path = write_jsonl([GOOD, bad, GOOD])
    with pytest.raises(ShardwiseError, match=message):
        build_dataset(DataConfig(train_files=[str(path)]), tok)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_record_is_a_counted_skip_when_chosen(tok, write_jsonl, name):
    bad, message = BAD[name]
    path = write_jsonl([GOOD, bad, GOOD])
    ds = build_dataset(DataConfig(train_files=[str(path)], on_error="skip"), tok)
    assert ds.num_documents == 2
    assert ds.stats.skipped_invalid + ds.stats.encode.skipped_no_target == 1
    assert any(__import__("re").search(message, r) for r in ds.stats.skip_reasons)


def test_line_numbers_count_blank_lines(tok, tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), "", "", json.dumps({"messages": []})]) + "\n")
    with pytest.raises(ShardwiseError, match=r"gaps\.jsonl:4: "):
        build_dataset(DataConfig(train_files=[str(path)]), tok)


def test_json_array_error_names_the_element_line(tok, tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([GOOD, GOOD, {"messages": [{"role": "x", "content": "y"}]}], indent=1))
    line = path.read_text().splitlines().index(" {", 0) + 1  # first element's line
    lines = [i + 1 for i, s in enumerate(path.read_text().splitlines()) if s == " {"]
    assert lines[0] == line
    with pytest.raises(ShardwiseError, match=rf"arr\.json:{lines[2]}: field 'messages\[0\]\.role'"):
        build_dataset(DataConfig(train_files=[str(path)]), tok)


def test_explicit_format_mismatch_is_a_missing_field(tok, write_jsonl):
    with pytest.raises(ShardwiseError, match=r"data\.jsonl:1: field 'instruction': missing"):
        build_dataset(DataConfig(train_files=[str(write_jsonl([GOOD]))], format="alpaca"), tok)


def test_everything_skipped_is_an_error(tok, write_jsonl):
    with pytest.raises(ShardwiseError, match="no usable samples"):
        build_dataset(DataConfig(train_files=[str(write_jsonl([{"x": 1}]))], on_error="skip"), tok)


def test_config_errors_name_the_field():
    from shardwise.config.data import load_data_config

    with pytest.raises(ShardwiseError, match=r"run\.yaml: field 'data\.truncation'"):
        load_data_config({"train_files": ["a.jsonl"], "truncation": "middle"}, source="run.yaml")
    with pytest.raises(ShardwiseError, match=r"field 'data\.max_lenght'"):
        load_data_config({"train_files": ["a.jsonl"], "max_lenght": 5}, source="run.yaml")


# ---------------------------------------------------------------- property-based

text = st.text(alphabet=string.ascii_letters + " {}[]\":,\\<|>\n", max_size=12)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False), text)
value = st.recursive(scalar, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                    st.dictionaries(text, kids, max_size=3)), max_leaves=8)
key = st.sampled_from(["messages", "conversations", "instruction", "input", "output", "system", "text",
                       "role", "content", "from", "value"])
turn = st.dictionaries(st.sampled_from(["role", "content", "from", "value"]),
                       st.one_of(st.sampled_from(["user", "assistant", "system", "human", "gpt", "x"]), value),
                       max_size=3)
record = st.one_of(
    st.dictionaries(key, value, max_size=4),
    st.fixed_dictionaries({"messages": st.lists(turn, max_size=4)}),
    st.fixed_dictionaries({"conversations": st.lists(turn, max_size=4)}),
    value,
)
line = st.one_of(record.map(json.dumps), text)  # some lines are not JSON at all


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(line, min_size=1, max_size=5), fmt=st.sampled_from(["auto", "chat", "alpaca", "sharegpt",
                                                                          "text"]),
       on_error=st.sampled_from(["raise", "skip"]))
def test_random_records_only_ever_raise_shardwise_error(tok, tmp_path_factory, lines, fmt, on_error):
    path = tmp_path_factory.mktemp("h") / "rand.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = DataConfig(train_files=[str(path)], format=fmt, on_error=on_error, max_length=64)
    try:
        ds = build_dataset(cfg, tok)
    except ShardwiseError as exc:
        assert "rand.jsonl" in str(exc)  # every error points at the file
        return
    for i in range(len(ds)):  # whatever loads is well formed
        item = ds[i]
        assert len(item["input_ids"]) == len(item["labels"]) <= 64
