"""The SFT pipeline (shardwise.data) wired to the trainer's config: dataset, collator, sampler."""

from __future__ import annotations

from typing import Any

from shardwise.train.config import TrainConfig
from shardwise.train.engines.base import DistEnv

COMPUTE_DTYPES = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}


def data_config(cfg: TrainConfig):
    """`data.sft` as a validated DataConfig; the bundled sample data when no files are given."""
    from shardwise.data import load_data_config, sample_data_path

    raw = dict(cfg.data.sft)
    raw.setdefault("train_files", [str(sample_data_path())])
    raw.setdefault("seed", cfg.run.seed)
    return load_data_config(raw, source=cfg.source)


def build_sft(cfg: TrainConfig, env: DistEnv) -> tuple[Any, Any, Any]:
    import torch

    from shardwise.data import ResumableDistributedSampler, SFTCollator, build_dataset, load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    dc = data_config(cfg)
    ds = build_dataset(dc, tok, split="train")
    # Additive 4-D mask in the compute dtype: documents packed in a row never see each other.
    collate = SFTCollator(
        tok.pad_token_id,
        mask="additive",
        pad_to_multiple_of=8,
        mask_dtype=getattr(torch, COMPUTE_DTYPES[cfg.precision]),
    )
    sampler = ResumableDistributedSampler(
        ds, num_replicas=env.world_size, rank=env.rank, seed=dc.seed, shuffle=True, drop_last=True
    )
    return ds, collate, sampler
