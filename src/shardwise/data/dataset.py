"""build_dataset: files -> validated examples -> tokens + target masks -> (packed) rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardwise.config.data import DataConfig
from shardwise.data.formats import Example, LoadReport, iter_examples, resolve_files
from shardwise.data.labels import IGNORE_INDEX
from shardwise.data.packing import efficiency, pack
from shardwise.data.tokenize import Encoder, EncodeStats
from shardwise.errors import ShardwiseError

log = logging.getLogger(__name__)


@dataclass
class DataStats:
    """Everything the pipeline did to the data: reported, never silent."""

    split: str
    records: int = 0
    skipped_invalid: int = 0
    encode: EncodeStats = field(default_factory=EncodeStats)
    rows: int = 0
    packing_efficiency: float = 0.0
    skip_reasons: list[str] = field(default_factory=list)

    def summary(self) -> str:
        e = self.encode
        return (f"{self.split}: {self.records} records -> {e.samples} samples, {e.tokens} tokens "
                f"({e.target_tokens} targets); truncated {e.truncated}, dropped too long {e.dropped_too_long}, "
                f"skipped invalid {self.skipped_invalid}, skipped no-target {e.skipped_no_target}; "
                f"{self.rows} rows, packing efficiency {self.packing_efficiency:.1%}")  # fmt: skip


class SFTDataset:
    """Map-style dataset of rows; a row is one sample, or several packed documents.

    Item: ``{"input_ids": int64[n], "labels": int64[n], "seq_lens": list[int]}`` where labels
    are -100 off-target and at the first token of every document (never predicted across a
    document boundary). Tokens are stored flat (int32 + offsets) to keep 10M+ tokens small.
    """

    def __init__(self, samples: list[Any], max_length: int, packing: bool, stats: DataStats):
        lengths = [len(s.ids) for s in samples]
        self.offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        self.tokens = np.concatenate([s.ids for s in samples]) if samples else np.zeros(0, np.int32)
        self.target = np.concatenate([s.target for s in samples]) if samples else np.zeros(0, bool)
        self.where = [s.where for s in samples]
        self.max_length = max_length
        self.rows = pack(lengths, max_length) if packing else [[i] for i in range(len(samples))]
        self.stats = stats
        stats.rows = len(self.rows)
        stats.packing_efficiency = efficiency(lengths, self.rows, max_length)

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, target: np.ndarray, offsets: np.ndarray, where: list[str],
                    rows: list[list[int]], max_length: int, stats: DataStats) -> SFTDataset:  # fmt: skip
        """The dataset as stored in the data cache (shardwise.data.cache): the same flat arrays and
        the same packing, so a loaded dataset yields exactly the rows of the one that was built."""
        ds = cls.__new__(cls)
        ds.tokens, ds.target, ds.offsets = tokens, target, offsets
        ds.where, ds.rows, ds.max_length, ds.stats = where, rows, max_length, stats
        return ds

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_documents(self) -> int:
        return len(self.where)

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, target mask) of document ``i``."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.target[a:b]

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids, labels, lens = [], [], []
        for d in self.rows[i]:
            tok, tgt = self.document(d)
            lab = np.where(tgt, tok, IGNORE_INDEX).astype(np.int64)
            lab[0] = IGNORE_INDEX  # the previous document's last token must not predict this one
            ids.append(tok.astype(np.int64)), labels.append(lab), lens.append(len(tok))
        return {"input_ids": np.concatenate(ids), "labels": np.concatenate(labels), "seq_lens": lens}


def _split(examples: list[Example], fraction: float, seed: int, split: str) -> list[Example]:
    """Seeded record-level split: stable for a given file set, whatever the tokenizer."""
    if fraction <= 0:
        return examples
    perm = np.random.default_rng(seed).permutation(len(examples))
    n_val = max(1, round(fraction * len(examples)))
    chosen = np.sort(perm[:n_val] if split == "validation" else perm[n_val:])
    return [examples[i] for i in chosen]


def build_dataset(cfg: DataConfig, tokenizer: Any, *, split: str = "train") -> SFTDataset:
    """Load, validate, template, tokenise, truncate and pack one split ("train"/"validation")."""
    if split not in ("train", "validation"):
        raise ShardwiseError(f"build_dataset: field 'split': expected 'train' or 'validation', got {split!r}.")
    if split == "validation" and cfg.validation_files:
        paths = resolve_files(cfg.validation_files, where="data.validation_files")
    elif split == "validation" and cfg.validation_fraction == 0:
        raise ShardwiseError("data: no validation split: set data.validation_files or data.validation_fraction.")
    else:
        paths = resolve_files(cfg.train_files, where="data.train_files")
    encoder = Encoder(tokenizer, cfg)  # first: a template refused on its probe render, before any file is read
    report = LoadReport()
    examples = list(iter_examples(paths, cfg.format, cfg.fields, cfg.on_error, report))
    if not cfg.validation_files:
        examples = _split(examples, cfg.validation_fraction, cfg.seed, split)
    stats = DataStats(split=split, records=report.records, skipped_invalid=report.skipped,
                      skip_reasons=list(report.skip_reasons))  # fmt: skip
    samples = list(encoder.encode(examples, stats.encode))
    stats.skip_reasons += stats.encode.skip_reasons
    if not samples:
        raise ShardwiseError(f"data.{split}: no usable samples in {[str(p) for p in paths]} "
                             f"({stats.summary()}). First problems: {stats.skip_reasons[:3]}")
    ds = SFTDataset(samples, cfg.max_length, cfg.packing, stats)
    e = stats.encode
    level = logging.WARNING if (e.truncated or e.dropped_too_long or stats.skipped_invalid or e.skipped_no_target) \
        else logging.INFO  # fmt: skip
    log.log(level, "%s", stats.summary())
    return ds
