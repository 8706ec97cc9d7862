"""The label contract shared by the data pipeline, the loss and the loop (docs/data.md): labels
are NOT shifted, IGNORE_INDEX marks positions that carry no loss, and position t predicts
labels[t + 1]. Defined once here; torch-free (works on tensors and numpy arrays alike)."""

from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100  # torch's cross_entropy default ignore_index, and HF's convention


def count_target_tokens(batch: dict[str, Any]) -> int:
    """Tokens that contribute to the loss after the model's shift: labels[:, 1:] != IGNORE_INDEX.

    The trainer sums these over all micro-batches of a step and all ranks and divides the
    *summed* per-token loss by that global count (docs/data.md, docs/training.md).
    """
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
