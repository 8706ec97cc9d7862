"""A tiny-llama run on one in-process rank, with a given logging interval, for the loop tests
(tests/train/test_host_syncs.py, tests/train/test_prefetch.py)."""

from __future__ import annotations

from pathlib import Path


def loop_config(tmp_path: Path, every: int, steps: int = 7, data: str = "synthetic", save_every: int | None = None):
    from shardwise.config.schema import TrainConfig

    return TrainConfig.model_validate({
        "model": {"name": "tiny-llama", "attention": "eager"},
        "data": {"kind": data, "synthetic": {"samples": 64, "seq_len": 16, "seed": 7},
                 "sft": {"max_length": 64}},
        "strategy": {"name": "ddp"},
        "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0},
        "run": {"steps": steps, "micro_batch": 2, "grad_accum": 2, "seed": 3, "device": "cpu"},
        "checkpointing": {"output_dir": str(tmp_path), "save_every_steps": save_every, "save_every_minutes": None,
                          "keep_last": 5},
        "logging": {"every": every, "every_seconds": None, "progress": False, "tensorboard": False},
    })


def train_one_rank(cfg, **kw):
    from shardwise.run import run_spec
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.loop import train

    return train(run_spec(cfg, 1, "cpu"), DistEnv(), **kw)
