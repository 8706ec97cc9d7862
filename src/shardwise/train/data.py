"""Batches for the loop: one list of `grad_accum` micro-batches per optimizer step and rank.

The global batch of a step is a fixed, seeded sequence of samples; rank r takes the r-th
contiguous slice and splits it into micro-batches. So the set of samples an optimizer step
sees does not depend on the world size or the accumulation — which is what makes a 2-rank
run comparable, step for step, to a 1-rank run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.config.schema import SyntheticData
from shardwise.data.labels import IGNORE_INDEX, count_target_tokens
from shardwise.run import RunSpec
from shardwise.train.engines.base import DistEnv

Batch = dict[str, torch.Tensor]


class SyntheticSource:
    """Seeded random tokens with prompt masks of unequal length (1..seq_len-2 positions masked),
    so ranks and micro-batches hold different target counts — what catches per-rank means."""

    def __init__(self, cfg: SyntheticData, vocab_size: int):
        self.cfg, self.vocab = cfg, vocab_size

    def __len__(self) -> int:
        return self.cfg.samples

    def __getitem__(self, i: int) -> Batch:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + i)
        s = self.cfg.seq_len
        ids = torch.randint(0, self.vocab, (s,), generator=g)
        prompt = int(torch.randint(1, s - 1, (1,), generator=g))
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(s)}


def stack(rows: Sequence[Batch]) -> Batch:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def contiguous_indices(n: int, env: DistEnv, per_rank: int, consumed: int = 0) -> Iterator[int]:
    """Rank r's indices: the r-th slice of each global batch, in file order, epochs wrapping.
    `consumed` global samples (a resumed run's position) are skipped without reading them."""
    global_batch = per_rank * env.world_size
    if n < global_batch:
        raise ValueError(f"dataset has {n} samples, fewer than one global batch of {global_batch}")
    base = (consumed // global_batch % (n // global_batch)) * global_batch
    while True:
        if base + global_batch > n:  # drop the tail that cannot fill a global batch
            base = 0
        yield from range(base + env.rank * per_rank, base + (env.rank + 1) * per_rank)
        base += global_batch


def sampler_indices(sampler: Any) -> Iterator[int]:
    """Endless epochs of the data pipeline's ResumableDistributedSampler (strided by rank:
    the union over ranks of each step's slice is still one contiguous run of the epoch's order)."""
    while True:
        yield from sampler
        sampler.set_epoch(sampler.epoch)  # __iter__ already advanced the epoch at its end


def iter_steps(
    dataset: Any,
    indices: Iterator[int],
    micro_batch: int,
    grad_accum: int,
    collate: Callable[[Sequence[Any]], Batch] = stack,
) -> Iterator[list[Batch]]:
    """Yield this rank's `grad_accum` micro-batches for each optimizer step, forever."""
    while True:
        rows = [dataset[next(indices)] for _ in range(micro_batch * grad_accum)]
        yield [collate(rows[m * micro_batch : (m + 1) * micro_batch]) for m in range(grad_accum)]


def build_source(run: RunSpec, env: DistEnv, vocab_size: int, consumed: int = 0) -> Iterator[list[Batch]]:
    """The configured data as a step iterator (synthetic, or the SFT pipeline's rows), starting
    after `consumed` global samples: a resumed run continues the sample order exactly, on any
    world size that keeps the global batch (the position is global, not per rank)."""
    cfg = run.config
    r = cfg.run
    per_rank = r.micro_batch * r.grad_accum
    if cfg.data.kind == "synthetic":
        ds = SyntheticSource(cfg.data.synthetic, vocab_size)
        return iter_steps(ds, contiguous_indices(len(ds), env, per_rank, consumed), r.micro_batch, r.grad_accum)
    from shardwise.train.sft_data import build_sft  # the data pipeline (tokenizer, files)

    ds, collate, sampler = build_sft(run, env)
    if consumed:
        # The sampler strides an epoch's order by rank, so each step's global batch is one
        # contiguous run of it whatever the world size: rank r's position is consumed / world.
        mine = consumed // env.world_size
        sampler.load_state_dict({"epoch": mine // sampler.num_samples, "position": mine % sampler.num_samples})
    return iter_steps(ds, sampler_indices(sampler), r.micro_batch, r.grad_accum, collate)


@dataclass(frozen=True)
class PreparedStep:
    """One optimizer step's micro-batches for this rank, with the counts the loop all-reduces."""

    step: int  # the optimizer step (1-based) they are for
    micro: list[Batch]
    targets: int  # this rank's target tokens over the micro-batches (count_target_tokens)
    tokens: int  # this rank's input tokens


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """The next steps' micro-batches, prepared on a background thread while the training thread
    runs the current one: read, collated and counted up to `depth` steps ahead, so the training
    thread never reads rows or collates between a backward and the next forward.

    The thread takes `count` items from `steps` in order, one per step from `first`, the same
    items a loop calling `next(steps)` would get: which rows a step sees does not change, and a
    resumed run's position (the step count, shardwise.train.data.build_source's `consumed`) does
    not depend on how far the thread has read. An exception the thread raises is raised again by
    `next` on the training thread, with its message unchanged and a note saying where it was
    raised; a source that ends early is an error naming the step. `close` stops the thread (it
    is a daemon: a thread stuck inside the source never holds up the process's exit).
    """

    _POLL_S = 0.1  # how often a blocked put or get looks at the stop flag and the thread

    def __init__(self, steps: Iterator[list[Batch]], first: int, count: int, depth: int = 2):
        self._steps, self._first, self._count = steps, first, count
        self._queue: queue.Queue[PreparedStep | _Failed] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="shardwise-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        step = self._first
        try:
            for step in range(self._first, self._first + self._count):
                if self._stop.is_set():
                    return
                try:
                    micro = next(self._steps)
                except StopIteration:
                    raise RuntimeError(f"the batch source ended before step {step} (it gave "
                                       f"{step - self._first} of the {self._count} steps asked)") from None
                item = PreparedStep(step, micro, sum(count_target_tokens(b) for b in micro),
                                    sum(b["input_ids"].numel() for b in micro))
                if not self._put(item):
                    return
        except BaseException as e:  # every error reaches the training thread
            e.add_note(f"(raised while preparing the batches of step {step}, on the prefetch thread)")
            self._put(_Failed(e))

    def _put(self, item: PreparedStep | _Failed) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> PreparedStep:
        """The next step's prepared micro-batches (waits for the thread when it is behind)."""
        while True:
            try:
                item = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread ended without the next step's batches "
                                       "(closed, or asked for more steps than it was given)") from None
                continue
            if isinstance(item, _Failed):
                raise item.error
            return item

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; wait up to `timeout_s` for it to leave the source it may be reading."""
        self._stop.set()
        try:
            while True:  # a put blocked on a full queue returns at its next poll
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout_s)


def eval_layout(n_rows: int, env: DistEnv, micro_batch: int) -> list[list[int | None]]:
    """This rank's micro-batches of one evaluation pass over rows 0..n_rows-1: deterministic (no
    shuffle), round k of the pass takes rows [k·M·W, (k+1)·M·W) and rank r the r-th M of them.
    Every rank runs the same number of forwards (each is a collective under FSDP2, ZeRO-3 and
    DDP); a slot past the last row is None (a row without targets: it adds nothing). The union
    over ranks is every row exactly once, whatever the world size."""
    per_round = micro_batch * env.world_size
    rounds = -(-n_rows // per_round)
    out = []
    for k in range(rounds):
        first = k * per_round + env.rank * micro_batch
        out.append([i if i < n_rows else None for i in range(first, first + micro_batch)])
    return out


def _no_target(row: Batch) -> dict[str, Any]:
    """A one-token stand-in with no target, shaped like `row` (padding an evaluation round)."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if k == "seq_lens":
            out[k] = [1]
        elif k == "labels":
            out[k] = v[:1] * 0 + IGNORE_INDEX
        else:
            out[k] = v[:1]
    return out


def build_eval_batches(run: RunSpec, env: DistEnv) -> list[Batch]:
    """This rank's micro-batches of one pass over the validation split (`data.sft`'s
    validation_files / validation_fraction), the first `run.eval_batches` global batches of it
    (micro_batch × grad_accum × ranks rows each) or all of it. Built once; every evaluation
    reads the same batches."""
    from shardwise.train.sft_data import build_sft_split

    cfg = run.config
    r = cfg.run
    ds, collate = build_sft_split(run, "validation")
    n = len(ds)
    if r.eval_batches is not None:
        n = min(n, r.eval_batches * r.micro_batch * r.grad_accum * env.world_size)
    filler = _no_target(ds[0])
    return [collate([ds[i] if i is not None else filler for i in rows]) for rows in eval_layout(n, env, r.micro_batch)]
