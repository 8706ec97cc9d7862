"""Each record format, field mapping, file types and splits."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from sft_records import chat

from shardwise.config.data import DataConfig
from shardwise.data import build_dataset
from shardwise.errors import ShardwiseError


def targets(ds, tok, i=0) -> str:
    ids, tgt = ds.document(i)
    tgt = tgt.copy()
    tgt[0] = False
    return tok.decode(ids[tgt].tolist())


def build(tok, path, **kw):
    return build_dataset(DataConfig(train_files=[str(path)], packing=False, **kw), tok)


def test_alpaca_input_and_system(tok, write_jsonl):
    rec = {"instruction": "Add them.", "input": "2 and 3", "output": "5.", "system": "Be brief."}
    ds = build(tok, write_jsonl([rec]), format="alpaca")
    full = tok.decode(ds.document(0)[0].tolist())
    rendered = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Add them.\n\n2 and 3"},
                                        {"role": "assistant", "content": "5."}], tokenize=False)
    assert full == rendered
    assert targets(ds, tok) == "5." + tok.eos_token


def test_alpaca_without_input_has_no_blank_lines(tok, write_jsonl):
    ds = build(tok, write_jsonl([{"instruction": "Say hi.", "input": "", "output": "hi"}]))
    assert "Say hi.\n\n" not in tok.decode(ds.document(0)[0].tolist())


def test_openai_chat(tok, write_jsonl):
    ds = build(tok, write_jsonl([chat("q1", "a1", system="sys")]), format="chat")
    assert targets(ds, tok) == "a1" + tok.eos_token


def test_sharegpt_roles_are_mapped(tok, write_jsonl):
    rec = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                             {"from": "gpt", "value": "A"}]}
    sg = build(tok, write_jsonl([rec], "sg.jsonl"), format="sharegpt")
    oa = build(tok, write_jsonl([chat("Q", "A", system="S")], "oa.jsonl"), format="chat")
    assert sg.document(0)[0].tolist() == oa.document(0)[0].tolist()
    assert sg.document(0)[1].tolist() == oa.document(0)[1].tolist()


def test_plain_text_is_all_target_with_bos_and_eos(tok, write_jsonl):
    ds = build(tok, write_jsonl([{"text": "the river runs"}]), format="text")
    ids, tgt = ds.document(0)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tgt[1:].all()
    assert tok.decode(ids[1:-1].tolist()) == "the river runs"


def test_field_mapping_renames_columns(tok, write_jsonl):
    rec = {"dialog": [{"speaker": "user", "text": "Q"}, {"speaker": "assistant", "text": "A"}]}
    mapped = build(tok, write_jsonl([rec]), fields={"messages": "dialog", "role": "speaker", "content": "text"})
    plain = build(tok, write_jsonl([chat("Q", "A")], "p.jsonl"))
    assert mapped.document(0)[0].tolist() == plain.document(0)[0].tolist()


def test_unknown_canonical_field_is_rejected():
    with pytest.raises(ValueError, match="instruction"):
        DataConfig(train_files=["x.jsonl"], fields={"instructions": "q"})


def test_auto_detects_per_record_in_mixed_file(tok, write_jsonl):
    recs = [chat("Q", "A"), {"instruction": "I", "output": "O"}, {"text": "T"}]
    ds = build(tok, write_jsonl(recs))
    assert ds.num_documents == 3
    assert [targets(ds, tok, i) for i in range(2)] == ["A" + tok.eos_token, "O" + tok.eos_token]


def test_json_array_parquet_and_several_files(tok, tmp_path, write_jsonl):
    recs = [chat(f"q{i}", f"a{i}") for i in range(4)]
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps(recs[:2], indent=2))
    pq = tmp_path / "b.parquet"
    pd.DataFrame({"instruction": ["x", "y"], "output": ["X", "Y"]}).to_parquet(pq)
    jl = write_jsonl(recs[2:], "c.jsonl")
    ds = build_dataset(DataConfig(train_files=[str(arr), str(pq), str(jl)], packing=False), tok)
    assert ds.num_documents == 6
    assert ds.where[2].endswith("b.parquet:row 1")
    assert [targets(ds, tok, i) for i in (0, 2, 5)] == [t + tok.eos_token for t in ("a0", "X", "a3")]


def test_glob_and_missing_file(tok, tmp_path, write_jsonl):
    write_jsonl([chat("q", "a")], "one.jsonl")
    write_jsonl([chat("q", "a")], "two.jsonl")
    ds = build_dataset(DataConfig(train_files=[str(tmp_path / "*.jsonl")]), tok)
    assert ds.num_documents == 2
    with pytest.raises(ShardwiseError, match="not found"):
        build_dataset(DataConfig(train_files=[str(tmp_path / "nope.jsonl")]), tok)


def test_validation_by_fraction_is_disjoint_and_seeded(tok, write_jsonl):
    path = write_jsonl([chat(f"q{i}", f"a{i}") for i in range(20)])
    cfg = DataConfig(train_files=[str(path)], validation_fraction=0.25, packing=False, seed=3)
    train, val = build_dataset(cfg, tok), build_dataset(cfg, tok, split="validation")
    assert val.num_documents == 5 and train.num_documents == 15
    assert not set(train.where) & set(val.where)
    assert build_dataset(cfg, tok, split="validation").where == val.where  # same seed, same split


def test_validation_by_file(tok, write_jsonl):
    cfg = DataConfig(train_files=[str(write_jsonl([chat("q", "a")] * 3, "t.jsonl"))],
                     validation_files=[str(write_jsonl([chat("v", "w")], "v.jsonl"))])
    assert build_dataset(cfg, tok, split="validation").num_documents == 1
    assert build_dataset(cfg, tok).num_documents == 3


def test_unicode_line_separators_inside_strings_stay_in_one_record(tok, tmp_path):
    path = tmp_path / "u.jsonl"
    rec = chat("line\u2028break\x85next", "ok")
    path.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")  # raw U+2028 in the file
    ds = build_dataset(DataConfig(train_files=[str(path)], packing=False), tok)
    assert ds.num_documents == 1
    assert "line\u2028break" in tok.decode(ds.document(0)[0].tolist())
