"""Batches for the loop: one list of `grad_accum` micro-batches per optimizer step and rank.

The global batch of a step is a fixed, seeded sequence of samples; rank r takes the r-th
contiguous slice and splits it into micro-batches. So the set of samples an optimizer step
sees does not depend on the world size or the accumulation — which is what makes a 2-rank
run comparable, step for step, to a 1-rank run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from shardwise.train.config import SyntheticData, TrainConfig
from shardwise.train.engines.base import IGNORE_INDEX, DistEnv

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


def iter_steps(
    dataset: Any,
    env: DistEnv,
    micro_batch: int,
    grad_accum: int,
    collate: Callable[[Sequence[Any]], Batch] = stack,
    seed: int = 0,
    start_step: int = 0,
    shuffle: bool = False,
) -> Iterator[list[Batch]]:
    """Yield this rank's `grad_accum` micro-batches for each optimizer step, forever.

    Epochs wrap over a seeded permutation (identical on all ranks); no sample is dropped
    inside an epoch except the tail that does not fill a global batch.
    """
    per_rank = micro_batch * grad_accum
    global_batch = per_rank * env.world_size
    n = len(dataset)
    if n < global_batch:
        raise ValueError(f"dataset has {n} samples, fewer than one global batch of {global_batch}")
    steps_per_epoch = n // global_batch
    step = start_step
    while True:
        epoch, k = divmod(step, steps_per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle else None
        base = k * global_batch + env.rank * per_rank
        idx = [base + j for j in range(per_rank)]
        idx = [int(order[i]) for i in idx] if order is not None else idx
        rows = [dataset[i] for i in idx]
        yield [collate(rows[m * micro_batch:(m + 1) * micro_batch]) for m in range(grad_accum)]
        step += 1


def build_source(cfg: TrainConfig, env: DistEnv, vocab_size: int, start_step: int = 0) -> Iterator[list[Batch]]:
    """The configured data as a step iterator (synthetic, or the SFT pipeline's rows)."""
    r = cfg.run
    if cfg.data.kind == "synthetic":
        ds = SyntheticSource(cfg.data.synthetic, vocab_size)
        return iter_steps(ds, env, r.micro_batch, r.grad_accum, start_step=start_step)
    from shardwise.train.sft_data import build_sft  # the data pipeline (torch, tokenizers)

    ds, collate = build_sft(cfg)
    return iter_steps(ds, env, r.micro_batch, r.grad_accum, collate, seed=r.seed, start_step=start_step,
                      shuffle=True)  # fmt: skip
