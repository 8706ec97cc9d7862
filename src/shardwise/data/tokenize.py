"""Examples -> token ids + target mask, with explicit EOS and counted over-length handling."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardwise.config.data import DataConfig
from shardwise.data.formats import Example
from shardwise.data.template import Segment, make_renderer, split_segments
from shardwise.errors import ShardwiseError

BATCH = 256  # examples tokenised per call: the fast tokenizer parallelises a batch in Rust
# A sample whose templated text is longer than max(LONG_CHARS, 4 * max_length) characters is
# tokenised in bounded pieces (`Encoder._encode_long`): only the tokens max_length can keep, and
# one more that tells the sample is over, are computed. Tokenising a whole record costs ~170
# bytes of RSS per character (a 10 MB record: 1.9 GB; 100 MB: ~17 GB) before truncation
# throws almost all of it away; in pieces the memory follows max_length, not the record.
LONG_CHARS = 1 << 16
# The first window a long text is tokenised in (characters; at least 4 per token needed). The
# tokens of a window that agree with those of a window twice as long are kept: they lie at
# least a window away from where the text was cut, where no tokenizer with a pre-tokenizer
# (BPE, WordPiece, Unigram) looks, so they equal the whole text's tokens.
WINDOW_CHARS = 1 << 14


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
        """Samples in the order of `examples`: short ones tokenised BATCH at a time, a long one
        (module docstring of LONG_CHARS) on its own, in bounded pieces, as soon as it comes."""
        long_chars = max(LONG_CHARS, 4 * self.cfg.max_length)
        batch: list[tuple[Example, list[Segment]]] = []
        for ex in examples:
            segs = self.segments(ex)
            if sum(len(text) for text, _ in segs) > long_chars:
                yield from self._encode_batch(batch, stats)
                batch = []
                out = self._encode_long(ex, segs, stats)
                del segs  # the templated text of a long record goes now, not with the next batch
                if out is not None:
                    yield out
                continue
            batch.append((ex, segs))
            if len(batch) == BATCH:
                yield from self._encode_batch(batch, stats)
                batch = []
        yield from self._encode_batch(batch, stats)

    def _encode_batch(self, batch: list[tuple[Example, list[Segment]]], stats: EncodeStats) -> Iterator[Encoded]:
        flat = [text for _, s in batch for text, _ in s]
        ids = self._ids(flat) if flat else []
        k = 0
        for ex, s in batch:
            parts, mask = [], []
            if ex.text is not None and self.bos is not None:
                parts.append([self.bos]), mask.append(False)
            for _, is_target in s:
                parts.append(ids[k]), mask.append(is_target or self.cfg.train_on_prompt)
                k += 1
            out = self._finish(ex, parts, mask, stats)
            if out is not None:
                yield out

    # ------------------------------------------------------------ long samples, in pieces

    def _head(self, text: str, need: int) -> tuple[list[int], bool]:
        """(ids, True): all ids of `text`; or (its first `need` ids, False) when it has more,
        found in windows of the text's start that double until `need` ids are stable."""
        n = max(WINDOW_CHARS, 4 * need)
        if len(text) <= 2 * n:
            return self._ids([text])[0], True
        prev = self._ids([text[:n]])[0]
        while 2 * n < len(text):
            n *= 2
            cur = self._ids([text[:n]])[0]
            if _agree(prev, cur) > need:
                return cur[:need], False
            prev = cur
        return self._ids([text])[0], True

    def _tail(self, text: str, need: int) -> tuple[list[int], bool]:
        """`_head` from the end: all ids of `text`, or its last `need` ids (and False)."""
        n = max(WINDOW_CHARS, 4 * need)
        if len(text) <= 2 * n:
            return self._ids([text])[0], True
        prev = self._ids([text[-n:]])[0]
        while 2 * n < len(text):
            n *= 2
            cur = self._ids([text[-n:]])[0]
            if _agree(prev[::-1], cur[::-1]) > need:
                return cur[-need:], False
            prev = cur
        return self._ids([text])[0], True

    def _prefix(self, pieces: list[tuple[Any, bool]], budget: int) -> tuple[list[list[int]], list[bool], bool]:
        """The parts (and masks) of the sample's first `budget` tokens at least; True when the
        sample has more than the parts hold (it then has more than budget - 1 tokens)."""
        parts, mask, n = [], [], 0
        for payload, m in pieces:
            if n >= budget:
                return parts, mask, True
            ids, complete = (payload, True) if isinstance(payload, list) else self._head(payload, budget - n)
            parts.append(ids), mask.append(m)
            n += len(ids)
            if not complete:
                return parts, mask, True
        return parts, mask, False

    def _encode_long(self, ex: Example, segs: list[Segment], stats: EncodeStats) -> Encoded | None:
        """A long sample with the tokens of whole-text tokenisation that the truncation policy
        keeps (keep_start: the first max_length; cut_prompt: the final reply from its start and
        the context just before it; drop/raise: enough to know it is over), without tokenising
        the rest. `_finish` then sees a shorter sample that truncates to the same tokens."""
        L = self.cfg.max_length
        pieces: list[tuple[Any, bool]] = [([self.bos], False)] if ex.text is not None and self.bos is not None else []
        pieces += [(text, is_target or self.cfg.train_on_prompt) for text, is_target in segs if text]
        if self.cfg.truncation == "cut_prompt":
            reduced = self._cut_prompt_parts(pieces, L)
            if reduced is not None:
                parts, mask, head, over = reduced
                return self._finish(ex, parts, mask, stats, over=over, bos=self.bos if head else None)
        parts, mask, over = self._prefix(pieces, L + 1)
        return self._finish(ex, parts, mask, stats, over=over)

    def _cut_prompt_parts(self, pieces: list[tuple[Any, bool]], L: int):
        """cut_prompt keeps [BOS] + the last tokens of the context before the final reply + the
        final reply onwards, max_length in all. Returns (parts, masks, has_bos, over): BOS, the
        last context tokens (one more than fit, when there are more: the sample then stays
        over), the reply onwards (max_length + 1 tokens at most; `over` when it has more). None
        where the policy keeps the start anyway (no reply, or the reply starts the sample):
        `_prefix` does."""
        targets = [i for i, (_, m) in enumerate(pieces) if m]
        if not targets:
            return None
        r = targets[-1]
        while r > 0 and pieces[r - 1][1]:  # the final run of target pieces starts at r
            r -= 1
        if r == 0:
            return None
        first = pieces[0][0] if isinstance(pieces[0][0], list) else self._head(pieces[0][0], 1)[0]
        head = [first[0]] if first and self.bos is not None and first[0] == self.bos else []
        reply, rmask, over = self._prefix(pieces[r:], L - len(head) + 1)
        if over:  # the reply alone fills max_length: no context survives
            return [head, *reply], [False, *rmask], bool(head), True
        last = next((p[-1] for p in reversed(reply) if p), None)
        eos = 1 if self.cfg.add_eos and last != self.eos else 0
        need = max(L - len(head) - sum(map(len, reply)) - eos, 0) + 1  # one more: truncation is counted
        context, cmask = [], []
        for i in range(r - 1, -1, -1):
            payload, m = pieces[i]
            ids, complete = (payload, True) if isinstance(payload, list) else self._tail(payload, need)
            if i == 0 and head and complete:
                ids = ids[1:]  # the BOS is `head`
            context.insert(0, ids), cmask.insert(0, m)
            need -= len(ids)
            if not complete or need <= 0:
                break
        return [head, *context, *reply], [False, *cmask, *rmask], bool(head), False

    def _finish(self, ex: Example, parts: list[list[int]], mask: list[bool], stats: EncodeStats, *,
                over: bool = False, bos: int | None = -1) -> Encoded | None:  # fmt: skip
        """`parts` and their masks as one sample: EOS, truncation, target check, statistics.
        `over`: the parts are the start of a longer sample (`_encode_long`), more than
        max_length tokens: no EOS is appended (truncation cuts it) and the recorded length is a
        lower bound. `bos`: the BOS cut_prompt keeps (default: the tokenizer's)."""
        token_ids = np.fromiter((t for p in parts for t in p), dtype=np.int32)
        target = np.repeat(np.array(mask, dtype=bool), [len(p) for p in parts])
        if self.cfg.add_eos and not over and (len(token_ids) == 0 or token_ids[-1] != self.eos):
            # EOS is explicit: templates that end turns differently still teach the model to stop.
            token_ids = np.append(token_ids, np.int32(self.eos))
            target = np.append(target, bool(target[-1]) if len(target) else True)
        stats.lengths.append(len(token_ids))
        if over or len(token_ids) > self.cfg.max_length:
            policy = self.cfg.truncation
            if policy == "raise":
                size = f"more than {self.cfg.max_length}" if over else str(len(token_ids))
                raise ShardwiseError(
                    f"{ex.where}: field '{ex.target_field}': sample is {size} tokens, longer than "
                    f"max_length={self.cfg.max_length} (data.truncation='raise'; use keep_start, cut_prompt or drop).")
            if policy == "drop":
                stats.dropped_too_long += 1
                return None
            token_ids, target = truncate(token_ids, target, self.cfg.max_length, policy,
                                         bos=self.bos if bos == -1 else bos)  # fmt: skip
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


def _agree(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


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
