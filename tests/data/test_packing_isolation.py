"""Packed documents must not see each other: packed logits == each document run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.data import SFTCollator

IGNORE = -100


def tiny_llama(vocab: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval().float()


def row(docs: list[np.ndarray]) -> dict:
    labels = []
    for d in docs:
        lab = d.astype(np.int64).copy()
        lab[0] = IGNORE
        labels.append(lab)
    return {"input_ids": np.concatenate(docs).astype(np.int64), "labels": np.concatenate(labels),
            "seq_lens": [len(d) for d in docs]}


# eager adds the mask to the scores, so it takes the additive form only (documented).
@pytest.mark.parametrize(("attn", "mask"), [("sdpa", "additive"), ("sdpa", "bool"), ("eager", "additive")])
def test_packed_logits_equal_documents_alone(tok, attn, mask):
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, len(tok), size=n) for n in (17, 5, 30, 11)]  # 4 documents, uneven
    model = tiny_llama(len(tok), attn)
    # Two rows of different fill so the second one has padding (a block of its own).
    batch = SFTCollator(tok.pad_token_id, pad_to=70, mask=mask)([row(docs), row(docs[1:3])])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
        for r, row_docs in enumerate([docs, docs[1:3]]):
            start = 0
            for d in row_docs:
                alone = model(input_ids=torch.tensor(d, dtype=torch.long)[None]).logits[0]
                got = packed[r, start : start + len(d)]
                assert torch.max(torch.abs(got - alone)).item() <= 1e-5
                start += len(d)
    assert not torch.isnan(packed).any()  # padding rows are never fully masked


def test_without_the_mask_documents_do_leak(tok):
    """Control: the equality above is not vacuous; a plain causal mask lets documents mix."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, len(tok), size=n) for n in (9, 12)]
    model = tiny_llama(len(tok), "sdpa")
    batch = SFTCollator(tok.pad_token_id)([row(docs)])
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"]).logits[0, 9:]
        alone = model(input_ids=torch.tensor(docs[1], dtype=torch.long)[None]).logits[0]
    assert torch.max(torch.abs(leaky - alone)).item() > 1e-3


def test_mask_and_positions_shape(tok):
    batch = SFTCollator(tok.pad_token_id, pad_to=8)([row([np.array([5, 6, 7]), np.array([8, 9])])])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    allowed = batch["attention_mask"][0, 0] == 0
    assert allowed[4].tolist() == [False, False, False, True, True, False, False, False]
    assert allowed[2].tolist() == [True, True, True, False, False, False, False, False]
    # Padding: not a target, its own block.
    assert batch["labels"][0, 5:].tolist() == [IGNORE] * 3
    assert batch["labels"][0, [0, 3]].tolist() == [IGNORE, IGNORE]  # no prediction across documents


def test_varlen_boundaries(tok):
    a, b, c = np.array([5, 6, 7]), np.array([8, 9]), np.array([10, 11, 12, 13])
    batch = SFTCollator(tok.pad_token_id, mask="varlen")([row([a, b]), row([c])])
    assert "attention_mask" not in batch
    assert batch["input_ids"].shape == (1, 9)
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 9]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 4
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert batch["labels"][0, [0, 3, 5]].tolist() == [IGNORE] * 3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_real_packed_rows_from_the_pipeline_are_isolated(tok, attn):
    """End to end: rows built by build_dataset from the bundled data, through the collator."""
    from shardwise.config.data import DataConfig
    from shardwise.data import build_dataset, sample_data_path

    ds = build_dataset(DataConfig(train_files=[str(sample_data_path())], max_length=160), tok)
    i = next(k for k in range(len(ds)) if len(ds.rows[k]) >= 3)
    model = tiny_llama(len(tok), attn)
    batch = SFTCollator(tok.pad_token_id, pad_to=160)([ds[i]])
    with torch.no_grad():
        packed = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits[0]
        start = 0
        for d in ds.rows[i]:
            ids = torch.from_numpy(ds.document(d)[0].astype(np.int64))[None]
            alone = model(input_ids=ids).logits[0]
            assert torch.max(torch.abs(packed[start : start + ids.shape[1]] - alone)).item() <= 1e-5
            start += ids.shape[1]
