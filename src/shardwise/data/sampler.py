"""Deterministic, resumable distributed sampler (torch-free; a DataLoader accepts any iterable).

Epoch ``e`` uses the permutation ``default_rng([seed, e])`` of all rows, made divisible by
the world size (``drop_last``: drop the tail; otherwise repeat the head), and rank ``r`` takes
every ``world``-th index starting at ``r``. So every rank gets exactly the same number of
samples, and the order depends only on (seed, epoch, rank, world, dataset length).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from shardwise.errors import ShardwiseError


class ResumableDistributedSampler:
    """Per-rank sample indices with exact resume from ``state_dict()``.

    ``position`` counts samples of the current epoch this rank has handed out. With DataLoader
    workers the sampler is read ahead of training: save ``state_dict(consumed=n)`` with the
    number of samples the trainer actually stepped on this epoch.
    """

    def __init__(self, data: Sized | int, *, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):  # fmt: skip
        n = data if isinstance(data, int) else len(data)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ShardwiseError(f"sampler: field 'rank': expected 0 <= rank < num_replicas={num_replicas}, "
                                 f"got {rank}.")
        if n < num_replicas and (drop_last or n == 0):
            raise ShardwiseError(f"sampler: {n} samples cannot feed {num_replicas} ranks "
                                 f"({'drop_last leaves none' if n else 'empty dataset'}).")
        self.n, self.world, self.rank = n, num_replicas, rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch, self.position = 0, 0

    @property
    def num_samples(self) -> int:
        """Samples per rank per epoch (identical on every rank)."""
        return self.n // self.world if self.drop_last else -(-self.n // self.world)

    def __len__(self) -> int:
        return self.num_samples

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's full order for ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        order = np.random.default_rng([self.seed, e]).permutation(self.n) if self.shuffle else np.arange(self.n)
        total = self.num_samples * self.world
        if total > self.n:  # pad by repeating the head (wrapping again if n < world)
            order = np.resize(order, total)
        return order[:total][self.rank :: self.world].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``; a no-op for the current one, so resuming then calling it is safe."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[int]:
        order = self.indices()
        while self.position < len(order):
            i = order[self.position]
            self.position += 1
            yield i
        self.epoch, self.position = self.epoch + 1, 0  # finished: a checkpoint now resumes next epoch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position if consumed is None else consumed,
                "seed": self.seed, "num_replicas": self.world, "rank": self.rank, "dataset_len": self.n,
                "shuffle": self.shuffle, "drop_last": self.drop_last}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; the order must be reproducible, so seed/world/length/shuffle must match."""
        for key, mine in (("seed", self.seed), ("num_replicas", self.world), ("dataset_len", self.n),
                          ("shuffle", self.shuffle), ("drop_last", self.drop_last)):  # fmt: skip
            if key in state and state[key] != mine:
                raise ShardwiseError(f"sampler state: field '{key}': checkpoint has {state[key]!r}, this run "
                                     f"has {mine!r}; the sample order cannot be resumed exactly.")
        pos = int(state["position"])
        if not 0 <= pos <= self.num_samples:
            raise ShardwiseError(f"sampler state: field 'position': expected 0..{self.num_samples}, got {pos}.")
        self.epoch, self.position = int(state["epoch"]), pos
