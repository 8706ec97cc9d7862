"""One rank of the host-sync count (tests/train/test_host_syncs.py), launched through `spawn`.

For each `strategy[:fused]` item, STEPS steps of the loop with `logging.every = EVERY`, while
every way Python code can read a tensor on the host (`.item()`, `.tolist()`, `float()`, `int()`,
`bool()`, `__index__`, `.cpu()`, `.numpy()`) is counted on the training thread. Each read is
attributed to the loop's phase and step at that moment (the recorder is the run's watchdog) and
to the code that made it. Reads of the host-side group's tensors (`_MetaReduce.start` builds
them from Python floats: CPU memory on any device) are not syncs and are left out. The batches
carry input_ids and labels only, so the engines' input checks (which look at the host batch
before copying it) read nothing either. Rank 0 writes `<item>.json`.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train import loop
from shardwise.train.data import build_source
from shardwise.train.launch.rank import run_rank_script

STEPS = 10
EVERY = 4
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
SRC = str(Path(loop.__file__).parents[1])  # .../src/shardwise


def config(strategy: str, fused: bool, out: Path) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"name": "tiny-llama", "attention": "eager"},
        "data": {"kind": "synthetic", "synthetic": {"samples": 64, "seq_len": 32, "seed": 7}},
        "strategy": {"name": strategy},
        "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0, "fused": fused},
        "precision": "fp32",
        "run": {"steps": STEPS, "micro_batch": 2, "grad_accum": 2, "seed": 3, "device": "cpu"},
        "checkpointing": {"output_dir": str(out), "save_every_minutes": None},
        "logging": {"every": EVERY, "every_seconds": None, "progress": False, "tensorboard": False},
    })


class Recorder:
    """The run's watchdog (it is told each phase) and the counter of host reads."""

    def __init__(self) -> None:
        self.where: tuple[str, int] = ("start", 0)
        self.events: list[dict] = []
        self.host: set[int] = set()  # ids of the host-side group's tensors (kept alive below)
        self._keep: list[torch.Tensor] = []
        self._main = threading.get_ident()

    def phase(self, name: str, step: int) -> None:
        self.where = (name, step)

    def install(self) -> None:
        for name in READS:
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        start = loop._MetaReduce.start

        def start_and_mark(meta, values):
            t, work = start(meta, values)
            self.host.add(id(t))
            self._keep.append(t)
            return t, work

        loop._MetaReduce.start = start_and_mark

    def _wrap(self, name, orig):
        def read(t, *args, **kwargs):
            if threading.get_ident() == self._main and id(t) not in self.host:
                f = sys._getframe(1)
                file = f.f_code.co_filename
                self.events.append({
                    "phase": self.where[0], "step": self.where[1], "read": name,
                    "shardwise": file.startswith(SRC),
                    "at": f"{Path(file).name}:{f.f_code.co_name}:{f.f_lineno}",
                })
            return orig(t, *args, **kwargs)

        return read


def batches(run, env):
    """The configured synthetic rows without position_ids (0..S-1 anyway)."""
    for micro in build_source(run, env, run.model.vocab_size):
        yield [{k: v for k, v in b.items() if k != "position_ids"} for b in micro]


def main() -> None:
    runs, env, out = start_worker("strategy[:fused]")
    rec = Recorder()
    rec.install()
    for item in runs:
        strategy, *flags = item.split(":")
        cfg = config(strategy, "fused" in flags, out / item.replace(":", "-"))
        run = run_spec(cfg, env.world_size, "cpu")
        rec.events, rec.where = [], ("build", 0)
        res = loop.train(run, env, steps=batches(run, env), watchdog=rec)
        if env.is_main:
            (out / f"{item.replace(':', '-')}.json").write_text(json.dumps({
                "engine": run.engine_strategy.engine, "events": rec.events, "losses": res.losses,
                "grad_norms": [r.grad_norm for r in res.records],
            }))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
