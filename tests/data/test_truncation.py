"""Over-length samples: keep_start, cut_prompt, drop, raise - always counted."""

from __future__ import annotations

import numpy as np
import pytest
from sft_records import chat

from shardwise.config.data import DataConfig
from shardwise.data import build_dataset
from shardwise.data.tokenize import truncate
from shardwise.errors import ShardwiseError

LONG_PROMPT = " ".join(["mountain river"] * 40)


def data(write_jsonl, n_short=2):
    recs = [chat("hi", "short reply")] * n_short + [chat(LONG_PROMPT, "the final answer")]
    return str(write_jsonl(recs))


def full_length(tok, write_jsonl) -> int:
    ds = build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=4096, packing=False), tok)
    return len(ds.document(2)[0])


def test_keep_start(tok, write_jsonl):
    n = full_length(tok, write_jsonl)
    ds = build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=n - 10, packing=False,
                                  truncation="keep_start", train_on_prompt=True), tok)
    ref = build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=n, packing=False), tok)
    assert ds.document(2)[0].tolist() == ref.document(2)[0][: n - 10].tolist()
    assert ds.stats.encode.truncated == 1 and ds.num_documents == 3


def test_keep_start_that_cuts_every_target_is_a_no_target_error(tok, write_jsonl):
    with pytest.raises(ShardwiseError, match=r"data\.jsonl:3: field 'messages': no target tokens"):
        build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=20), tok)


def test_cut_prompt_keeps_the_reply_and_bos(tok, write_jsonl):
    ds = build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=30, truncation="cut_prompt",
                                  packing=False), tok)
    ids, tgt = ds.document(2)
    assert len(ids) == 30 and ids[0] == tok.bos_token_id
    assert tok.decode(ids[tgt].tolist()) == "the final answer" + tok.eos_token
    assert ds.stats.encode.truncated == 1


def test_cut_prompt_on_arrays_removes_oldest_context_first():
    ids = np.arange(10, dtype=np.int32)  # 0 = BOS, 1..5 prompt, 6..9 reply
    tgt = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=bool)
    out, t = truncate(ids, tgt, 7, "cut_prompt", bos=0)
    assert out.tolist() == [0, 4, 5, 6, 7, 8, 9] and t.tolist() == [0, 0, 0, 1, 1, 1, 1]
    out, _ = truncate(ids, tgt, 3, "cut_prompt", bos=0)  # reply longer than budget: its start survives
    assert out.tolist() == [0, 6, 7]


def test_drop_is_counted(tok, write_jsonl):
    ds = build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=30, truncation="drop"), tok)
    assert ds.num_documents == 2 and ds.stats.encode.dropped_too_long == 1
    assert "dropped too long 1" in ds.stats.summary()


def test_raise_names_file_line_and_length(tok, write_jsonl):
    n = full_length(tok, write_jsonl)
    with pytest.raises(ShardwiseError, match=rf"data\.jsonl:3: field 'messages': sample is {n} tokens"):
        build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=30, truncation="raise"), tok)


def test_truncation_is_logged_not_silent(tok, write_jsonl, caplog):
    build_dataset(DataConfig(train_files=[data(write_jsonl)], max_length=30, truncation="cut_prompt"), tok)
    assert any("truncated 1" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
