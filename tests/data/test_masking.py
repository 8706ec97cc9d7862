"""Loss masks: assistant turns only (per turn), train_on_prompt, explicit EOS, templates."""

from __future__ import annotations

import pytest
from sft_records import chat

from shardwise.config.data import DataConfig
from shardwise.data import build_dataset
from shardwise.data.template import make_renderer, split_segments
from shardwise.errors import ShardwiseError


def runs(ds, tok, i=0):
    """Decoded maximal runs of (is_target, text) of document i."""
    ids, tgt = ds.document(i)
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or tgt[k] != tgt[start]:
            out.append((bool(tgt[start]), tok.decode(ids[start:k].tolist())))
            start = k
    return out


def test_multi_turn_each_reply_is_a_target_and_nothing_else(tok, write_jsonl):
    replies = ["first answer", "second answer", "third"]
    rec = chat("u1", replies[0], "u2", replies[1], "u3", replies[2], system="sys")
    ds = build_dataset(DataConfig(train_files=[str(write_jsonl([rec]))]), tok)
    learned = [text for is_t, text in runs(ds, tok) if is_t]
    assert learned == [r + tok.eos_token for r in replies]
    context = "".join(text for is_t, text in runs(ds, tok) if not is_t)
    for user in ("u1", "u2", "u3", "sys"):
        assert user in context


def test_train_on_prompt_learns_everything(tok, write_jsonl):
    rec = chat("question", "answer")
    ds = build_dataset(DataConfig(train_files=[str(write_jsonl([rec]))], train_on_prompt=True), tok)
    assert ds.document(0)[1].all()


def test_render_matches_apply_chat_template(tok):
    msgs = list(chat("a", "b", "c", "d", system="s")["messages"])
    render = make_renderer(tok)
    assert render(msgs, False) == tok.apply_chat_template(msgs, tokenize=False)
    assert render(msgs[:3], True) == tok.apply_chat_template(msgs[:3], tokenize=False, add_generation_prompt=True)
    segs = split_segments(msgs, render, where="x:1")
    assert "".join(t for t, _ in segs) == render(msgs, False)


CHATML_NO_EOS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_stop|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_eos_is_appended_when_the_template_has_none(tok, write_jsonl):
    path = str(write_jsonl([chat("q", "a")]))
    ds = build_dataset(DataConfig(train_files=[path], chat_template=CHATML_NO_EOS), tok)
    ids, tgt = ds.document(0)
    assert ids[-1] == tok.eos_token_id and tgt[-1]
    assert (ids == tok.eos_token_id).sum() == 1
    no_eos = build_dataset(DataConfig(train_files=[path], chat_template=CHATML_NO_EOS, add_eos=False), tok)
    assert no_eos.document(0)[0][-1] != tok.eos_token_id


def test_eos_not_duplicated_when_template_ends_with_it(tok, write_jsonl):
    ds = build_dataset(DataConfig(train_files=[str(write_jsonl([chat("q", "a")]))]), tok)
    ids = ds.document(0)[0]
    assert ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id


def test_template_that_rewrites_history_is_refused(tok, write_jsonl):
    # Renders a turn counter in the header: adding messages changes earlier text.
    unstable = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg = DataConfig(train_files=[str(write_jsonl([chat("q", "a", "q2", "a2")]))], chat_template=unstable)
    with pytest.raises(ShardwiseError, match=r"data\.jsonl:1: .*prefix-stable"):
        build_dataset(cfg, tok)


def test_template_errors_name_the_record(tok, write_jsonl):
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}"
    cfg = DataConfig(train_files=[str(write_jsonl([chat("q", "a")]))], chat_template=strict)
    with pytest.raises(ShardwiseError, match=r"data\.jsonl:1: field 'messages'.*need a system turn"):
        build_dataset(cfg, tok)


def test_fast_backend_ids_equal_the_tokenizer_call(tok):
    from shardwise.data.tokenize import Encoder

    texts = ["<|user|>\nHow many metres?<|end|>", " leading space", "ünï©ødé 🤖 ×", "a\u2028b"]
    enc = Encoder(tok, DataConfig(train_files=["unused.jsonl"]))
    assert enc._ids(texts) == tok(texts, add_special_tokens=False)["input_ids"]
