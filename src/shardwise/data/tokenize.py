"""Examples -> token ids + target mask, with explicit EOS and counted over-length handling."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardwise.data.config import DataConfig
from shardwise.data.formats import Example
from shardwise.data.template import Segment, make_renderer, split_segments
from shardwise.errors import ShardwiseError

BATCH = 256  # examples tokenised per call: the fast tokenizer parallelises a batch in Rust


@dataclass
class Encoded:
    ids: np.ndarray  # int32 [n]
    target: np.ndarray  # bool [n]: True where the token is learned (before the model's shift)
    where: str


@dataclass
class EncodeStats:
    samples: int = 0
    tokens: int = 0
    target_tokens: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    skipped_no_target: int = 0
    skip_reasons: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # pre-truncation lengths, for the histogram


class Encoder:
    """Turns examples into :class:`Encoded` samples for one tokenizer and config."""

    def __init__(self, tokenizer: Any, cfg: DataConfig):
        self.tok, self.cfg = tokenizer, cfg
        self.render = make_renderer(tokenizer, cfg.chat_template)
        self.bos = tokenizer.bos_token_id
        self.eos = tokenizer.eos_token_id
        if cfg.add_eos and self.eos is None:
            raise ShardwiseError("tokenizer: field 'eos_token': the tokenizer has no EOS token but data.add_eos "
                                 "is true; set one on the tokenizer or set data.add_eos: false.")

    def _ids(self, texts: list[str]) -> list[list[int]]:
        # The Rust backend directly: same ids as tokenizer(texts), without the Python wrapper's
        # per-call overhead and offset bookkeeping (a third of tokenisation time).
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def segments(self, ex: Example) -> list[Segment]:
        if ex.text is not None:  # continued pre-training: everything is a target
            return [(ex.text, True)]
        return split_segments(ex.messages, self.render, where=ex.where)

    def encode(self, examples: Iterable[Example], stats: EncodeStats) -> Iterator[Encoded]:
        batch: list[Example] = []
        for ex in examples:
            batch.append(ex)
            if len(batch) == BATCH:
                yield from self._encode_batch(batch, stats)
                batch = []
        if batch:
            yield from self._encode_batch(batch, stats)

    def _encode_batch(self, batch: list[Example], stats: EncodeStats) -> Iterator[Encoded]:
        segs = [self.segments(ex) for ex in batch]
        flat = [text for s in segs for text, _ in s]
        ids = self._ids(flat) if flat else []
        k = 0
        for ex, s in zip(batch, segs, strict=True):
            parts, mask = [], []
            if ex.text is not None and self.bos is not None:
                parts.append([self.bos]), mask.append(False)
            for _, is_target in s:
                parts.append(ids[k]), mask.append(is_target or self.cfg.train_on_prompt)
                k += 1
            out = self._finish(ex, parts, mask, stats)
            if out is not None:
                yield out

    def _finish(self, ex: Example, parts: list[list[int]], mask: list[bool], stats: EncodeStats) -> Encoded | None:
        token_ids = np.fromiter((t for p in parts for t in p), dtype=np.int32)
        target = np.repeat(np.array(mask, dtype=bool), [len(p) for p in parts])
        if self.cfg.add_eos and (len(token_ids) == 0 or token_ids[-1] != self.eos):
            # EOS is explicit: templates that end turns differently still teach the model to stop.
            token_ids = np.append(token_ids, np.int32(self.eos))
            target = np.append(target, bool(target[-1]) if len(target) else True)
        stats.lengths.append(len(token_ids))
        if len(token_ids) > self.cfg.max_length:
            policy = self.cfg.truncation
            if policy == "raise":
                raise ShardwiseError(
                    f"{ex.where}: field '{ex.target_field}': sample is {len(token_ids)} tokens, longer than "
                    f"max_length={self.cfg.max_length} (data.truncation='raise'; use keep_start, cut_prompt or drop).")
            if policy == "drop":
                stats.dropped_too_long += 1
                return None
            token_ids, target = truncate(token_ids, target, self.cfg.max_length, policy, bos=self.bos)
            stats.truncated += 1
        n_target = int(target[1:].sum())  # position 0 is never predicted (labels are shifted)
        if n_target == 0:
            err = ShardwiseError(
                f"{ex.where}: field '{ex.target_field}': no target tokens after templating and truncation "
                "(nothing to learn: no assistant reply, or it was cut off by max_length).")
            if self.cfg.on_error == "raise":
                raise err
            stats.skipped_no_target += 1
            if len(stats.skip_reasons) < 5:
                stats.skip_reasons.append(str(err))
            return None
        stats.samples += 1
        stats.tokens += len(token_ids)
        stats.target_tokens += n_target
        return Encoded(token_ids, target, ex.where)


def truncate(ids: np.ndarray, target: np.ndarray, max_length: int, policy: str, *,
             bos: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Cut a sample to ``max_length`` tokens.

    keep_start: keep the first tokens (the end of the last reply, and its EOS, is lost).
    cut_prompt: drop the oldest tokens before the final reply first (a leading BOS stays), so
    the final reply survives whole; only a reply longer than the budget is cut at its end.
    """
    if policy == "keep_start":
        return ids[:max_length], target[:max_length]
    assert policy == "cut_prompt", policy
    head = 1 if bos is not None and len(ids) and ids[0] == bos else 0
    starts = np.flatnonzero(target & ~np.concatenate(([False], target[:-1])))  # starts of target runs
    reply = int(starts[-1]) if len(starts) else len(ids)
    excess = len(ids) - max_length
    removable = max(reply - head, 0)
    cut = min(excess, removable)
    keep = np.r_[0:head, head + cut : len(ids)]
    ids, target = ids[keep], target[keep]
    return ids[:max_length], target[:max_length]
