"""Collator: rows -> torch tensors, with documents isolated from each other.

Batch contract (docs/data.md): ``input_ids``, ``labels`` (NOT shifted, -100 = ignored) and
``position_ids`` (restart at 0 per document) are int64. Two layouts:

- mask="varlen" (the trainer's default, shardwise.train.model.packed_attention): padding-free [1, T],
  the micro-batch's rows concatenated, with the documents' boundaries (``cu_seq_lens_q/k``)
  and no mask tensor: the attention kernel keeps the documents apart.
- mask="additive"/"bool" (the dense fallback): [B, S] rows and a 4-D block-diagonal causal
  mask [B, 1, S, S]; transformers passes a 4-D mask to SDPA/eager untouched, so a token only
  sees earlier tokens of its own document. Padding forms its own block (never a fully masked
  row, so no NaN) and is labelled -100.

Both hold the same target tokens (every document's first label is -100, so the position before
it, in the same row or the previous one, predicts nothing): the same loss and the same count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from shardwise.data.labels import IGNORE_INDEX

MaskKind = Literal["additive", "bool", "varlen"]


class SFTCollator:
    """Collate dataset items (see SFTDataset) into a micro-batch.

    mask="additive": float mask, 0 = attend, dtype-min = blocked; works for SDPA *and* eager
        (eager adds the mask to the scores). Pass ``mask_dtype`` = the model's compute dtype.
    mask="bool": True = attend; SDPA only (eager would add the booleans as 0/1).
    mask="varlen": the batch is flattened to [1, T] without padding (with ``pad_to``: T = pad_to,
        the rest one padding document whose labels are ignored), no attention_mask, plus
        ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` that transformers' flash-attention
        path and shardwise's per-document SDPA use as variable-length boundaries (FlexAttention
        reads them from ``position_ids``).
    """

    def __init__(self, pad_token_id: int, *, pad_to: int | None = None, mask: MaskKind = "additive",
                 mask_dtype: torch.dtype = torch.float32, pad_to_multiple_of: int | None = None):  # fmt: skip
        self.pad, self.pad_to, self.kind = pad_token_id, pad_to, mask
        self.mask_dtype, self.multiple = mask_dtype, pad_to_multiple_of

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "varlen":
            return self._varlen(items)
        width = max(len(it["input_ids"]) for it in items)
        width = max(width, self.pad_to or 0)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        b = len(items)
        ids = np.full((b, width), self.pad, dtype=np.int64)
        labels = np.full((b, width), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((b, width), dtype=np.int64)
        seg = np.zeros((b, width), dtype=np.int64)  # document number per token; padding = its own
        for r, it in enumerate(items):
            n = len(it["input_ids"])
            ids[r, :n], labels[r, :n] = it["input_ids"], it["labels"]
            lens = list(it["seq_lens"]) + ([width - n] if width > n else [])
            pos[r] = np.concatenate([np.arange(k) for k in lens])
            seg[r] = np.repeat(np.arange(len(lens)), lens)
        segt = torch.from_numpy(seg)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = (segt[:, :, None] == segt[:, None, :]) & causal  # [B, S, S]
        if self.kind == "bool":
            mask = allowed[:, None]
        else:
            mask = torch.zeros(allowed.shape, dtype=self.mask_dtype)
            mask.masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)
            mask = mask[:, None]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos), "attention_mask": mask}  # fmt: skip

    def _varlen(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        lens = [k for it in items for k in it["seq_lens"]]
        ids = np.concatenate([it["input_ids"] for it in items])[None]
        labels = np.concatenate([it["labels"] for it in items])[None]  # doc starts already -100
        short = (self.pad_to or 0) - ids.shape[1]
        if short > 0:  # `pad_to` tokens in all: a padding document of its own, every label ignored
            ids = np.concatenate([ids, np.full((1, short), self.pad, dtype=ids.dtype)], axis=1)
            labels = np.concatenate([labels, np.full((1, short), IGNORE_INDEX, dtype=labels.dtype)], axis=1)
            lens = [*lens, short]
        pos = np.concatenate([np.arange(k) for k in lens])[None]
        cu = torch.tensor(np.concatenate(([0], np.cumsum(lens))), dtype=torch.int32)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": max(lens), "max_length_k": max(lens)}  # fmt: skip
