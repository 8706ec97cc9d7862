"""`shardwise data inspect`: statistics of a dataset and one sample with its loss mask shown."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from shardwise.data.dataset import SFTDataset

TARGET_STYLE, PROMPT_STYLE = "bold green", "dim"
OPEN, CLOSE = "⟦", "⟧"  # plain-text markers around learned tokens (no colour needed)


def stats_table(ds: SFTDataset) -> Table:
    s, e = ds.stats, ds.stats.encode
    t = Table(title=f"{s.split} split", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    pct = f" ({e.target_tokens / e.tokens:.1%} of tokens)" if e.tokens else ""
    rows = [("records read", s.records), ("samples", e.samples), ("tokens", e.tokens),
            ("target tokens (loss)", f"{e.target_tokens}{pct}"), ("truncated", e.truncated),
            ("dropped (too long)", e.dropped_too_long), ("skipped (invalid record)", s.skipped_invalid),
            ("skipped (no target tokens)", e.skipped_no_target), ("rows", s.rows),
            ("packing efficiency", f"{s.packing_efficiency:.1%}")]  # fmt: skip
    for k, v in rows:
        t.add_row(k, str(v))
    return t


def length_histogram(lengths: list[int], max_length: int, bins: int = 8, width: int = 40) -> Table:
    """Sample lengths before truncation; the last bin holds everything over max_length."""
    t = Table(title="sample length (tokens, before truncation)")
    for col, just in (("range", "left"), ("count", "right"), ("", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    if not lengths:
        return t
    arr = np.asarray(lengths)
    edges = np.linspace(0, max_length, bins + 1).astype(int)
    counts = [int(((arr > lo) & (arr <= hi)).sum()) for lo, hi in pairwise(edges)]
    labels = [f"{lo + 1}-{hi}" for lo, hi in pairwise(edges)]
    over = int((arr > max_length).sum())
    if over:
        counts.append(over), labels.append(f"> {max_length} (over)")
    top = max(counts) or 1
    for label, c in zip(labels, counts, strict=True):
        t.add_row(label, str(c), "█" * round(width * c / top))
    return t


def render_document(ds: SFTDataset, tokenizer: Any, index: int, *, plain: bool = False) -> Text:
    """Document ``index`` with learned tokens highlighted (or wrapped in ⟦ ⟧ when plain)."""
    ids, target = ds.document(index)
    target = target.copy()
    target[0] = False  # never predicted (the model shifts labels)
    out = Text()
    start = 0
    for end in [*np.flatnonzero(np.diff(target.astype(np.int8))) + 1, len(ids)]:
        piece = tokenizer.decode(ids[start:end].tolist(), skip_special_tokens=False)
        learned = bool(target[start])
        if plain:
            out.append(f"{OPEN}{piece}{CLOSE}" if learned else piece)
        else:
            out.append(piece, style=TARGET_STYLE if learned else PROMPT_STYLE)
        start = end
    return out


def report(ds: SFTDataset, tokenizer: Any, *, sample: int = 0, plain: bool = False) -> Group:
    if not 0 <= sample < ds.num_documents:
        from shardwise.errors import ShardwiseError

        raise ShardwiseError(f"inspect: field '--sample': expected 0..{ds.num_documents - 1}, got {sample}.")
    legend = (f"learned tokens are wrapped in {OPEN} {CLOSE}; the rest is context (label -100)" if plain
              else f"[{TARGET_STYLE}]learned tokens[/] vs [{PROMPT_STYLE}]context (label -100)[/]")  # fmt: skip
    parts: list[Any] = [stats_table(ds), length_histogram(ds.stats.encode.lengths, ds.max_length)]
    parts += [Text.from_markup(f"\nsample {sample} ({escape(ds.where[sample])}) — {legend}:"),
              render_document(ds, tokenizer, sample, plain=plain)]  # fmt: skip
    if ds.stats.skip_reasons:
        parts.append(Text("\nfirst problems:\n" + "\n".join(ds.stats.skip_reasons), style="yellow"))
    return Group(*parts)
