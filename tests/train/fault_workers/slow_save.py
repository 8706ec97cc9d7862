"""Two checkpoints through the real `save_checkpoint` of an engine-shaped stand-in: step 1 is
small and completes; step 2 carries a 256 MB tensor so that writing, fsync and hashing take
long enough for the test to SIGKILL this process in the middle of it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardwise.train.checkpoint.sharded import TrainerState, save_checkpoint
from shardwise.train.launch.rank import init_distributed


class Stand:
    def __init__(self, value: float, big: bool):
        self.value, self.big = value, big

    def checkpoint_state(self):
        tensors = {"model.w": torch.full((4,), self.value)}
        if self.big:
            tensors["model.big"] = torch.full((64 * 2**20,), self.value)
        return tensors, {"optimizer_step": int(self.value)}


def main() -> None:
    out = Path(sys.argv[1])
    init_distributed("cpu")
    for step, big in ((1, False), (2, True)):
        state = TrainerState(step=step, samples_consumed=step, global_batch=1)
        save_checkpoint(Stand(float(step), big), state, out, config={}, strategy="ddp", keep_last=5)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
