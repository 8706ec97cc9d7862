"""The SFT pipeline (shardwise.data) wired to the trainer's config: dataset, collator, sampler."""

from __future__ import annotations

from typing import Any

from shardwise.run import RunSpec
from shardwise.train.config import TrainConfig
from shardwise.train.engines.base import DistEnv


def data_config(cfg: TrainConfig):
    """`data.sft` as the pipeline's DataConfig: the bundled sample data when no files are given,
    run.seed when no data seed is."""
    from shardwise.data import DataConfig, sample_data_path

    sft = cfg.data.sft
    raw = sft.model_dump() | {
        "train_files": sft.train_files or [str(sample_data_path())],
        "seed": cfg.run.seed if sft.seed is None else sft.seed,
    }
    return DataConfig.model_validate(raw)


def build_sft(run: RunSpec, env: DistEnv) -> tuple[Any, Any, Any]:
    from shardwise.data import ResumableDistributedSampler, SFTCollator, build_dataset, load_tokenizer
    from shardwise.train.engines._torch_common import compute_dtype

    cfg = run.config
    tok = load_tokenizer(cfg.data.tokenizer)
    dc = data_config(cfg)
    ds = build_dataset(dc, tok, split="train")
    # Additive 4-D mask in the compute dtype: documents packed in a row never see each other.
    collate = SFTCollator(tok.pad_token_id, mask="additive", pad_to_multiple_of=8, mask_dtype=compute_dtype(run))
    sampler = ResumableDistributedSampler(
        ds, num_replicas=env.world_size, rank=env.rank, seed=dc.seed, shuffle=True, drop_last=True
    )
    return ds, collate, sampler
