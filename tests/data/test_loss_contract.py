"""Loss normalisation contract: sum of per-token losses / global target count is the same
whether documents are packed, split over micro-batches (grad accumulation) or over ranks."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from shardwise.config.data import DataConfig
from shardwise.data import SFTCollator, build_dataset, count_target_tokens, sample_data_path


def summed_loss(model, batch) -> torch.Tensor:
    kw = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    logits = model(**kw).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def test_same_mean_loss_packed_unpacked_accumulated_and_sharded(tok):
    from test_packing_isolation import tiny_llama

    cfg = {"train_files": [str(sample_data_path())], "max_length": 128}
    packed = build_dataset(DataConfig(**cfg), tok)
    docs = sorted({d for r in packed.rows[:3] for d in r})  # the documents of three packed rows
    unpacked = build_dataset(DataConfig(**cfg, packing=False), tok)
    model = tiny_llama(len(tok), "sdpa")
    collate = SFTCollator(tok.pad_token_id)

    def mean_over(microbatches):
        total = sum(summed_loss(model, b) for b in microbatches)
        return total / sum(count_target_tokens(b) for b in microbatches)  # the global count

    with torch.no_grad():
        one_step = mean_over([collate([packed[i] for i in range(3)])])
        items = [unpacked[d] for d in docs]
        accumulated = mean_over([collate(items[k : k + 4]) for k in range(0, len(items), 4)])
        # Two "ranks" with uneven token counts: each computes a sum, the counts are all-reduced.
        rank0, rank1 = items[: len(items) // 3], items[len(items) // 3 :]
        sharded = mean_over([collate(rank0), collate(rank1)])
        naive = (mean_over([collate(rank0)]) + mean_over([collate(rank1)])) / 2  # the wrong way
    assert torch.allclose(one_step, accumulated, atol=1e-5)
    assert torch.allclose(one_step, sharded, atol=1e-5)
    assert not torch.allclose(one_step, naive, atol=1e-5)


def test_count_matches_dataset_statistics(tok):
    ds = build_dataset(DataConfig(train_files=[str(sample_data_path())], max_length=256), tok)
    collate = SFTCollator(tok.pad_token_id, pad_to=256)
    counted = sum(count_target_tokens(collate([ds[i]])) for i in range(len(ds)))
    assert counted == ds.stats.encode.target_tokens


def test_unpacked_padding_is_ignored(tok):
    ds = build_dataset(DataConfig(train_files=[str(sample_data_path())], packing=False), tok)
    lens = [len(ds[i]["input_ids"]) for i in range(2)]
    batch = SFTCollator(tok.pad_token_id)([ds[0], ds[1]])
    short = int(np.argmin(lens))
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    assert (batch["labels"][short, min(lens):] == -100).all()
    assert (batch["input_ids"][short, min(lens):] == tok.pad_token_id).all()
