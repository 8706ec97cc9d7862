"""The SFT pipeline (shardwise.data) wired to the trainer's config: tokenizer, dataset, collator,
sampler, and the data cache that lets preflight tokenise once for every rank and every resume."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec

if TYPE_CHECKING:
    from shardwise.train.engines.base import DistEnv


def data_config(cfg: TrainConfig):
    """`data.sft` as the pipeline's DataConfig: the bundled sample data when no files are given,
    run.seed when no data seed is."""
    from shardwise.config.data import DataConfig
    from shardwise.data import sample_data_path

    sft = cfg.data.sft
    raw = sft.model_dump(exclude={"packed_attention"}) | {  # the trainer's: rows and cache do not depend on it
        "train_files": sft.train_files or [str(sample_data_path())],
        "seed": cfg.run.seed if sft.seed is None else sft.seed,
    }
    return DataConfig.model_validate(raw)


def resolved_tokenizer_path(cfg: TrainConfig) -> str:
    """The tokenizer directory this run trains with: `data.tokenizer`; else, with `model.path`,
    the model directory's own tokenizer; else (a catalog model, random init) the bundled one.

    A model directory without tokenizer files is refused rather than paired with the bundled
    toy tokenizer: its ids would mean nothing to the pretrained embeddings. A tokenizer that
    ships its own code (`auto_map`) is refused unless `model.trust_remote_code` is set, and
    files too big, not strict JSON or too deep are refused naming the file, here, before any
    rank starts. The export calls this too, so the exported directory carries the
    tokenizer the model trained with.
    """
    from shardwise.data import TOKENIZER_FILES, check_remote_code, default_tokenizer_path, tokenizer_files
    from shardwise.data.tokenizer_check import check_tokenizer_files

    expected = ", ".join(TOKENIZER_FILES[:3])
    if cfg.data.tokenizer is not None:
        p = Path(cfg.data.tokenizer).expanduser()
        if not p.is_dir():
            raise ShardwiseError(f"{cfg.source}: data.tokenizer {cfg.data.tokenizer!r} is not a directory "
                                 f"(expected a local tokenizer directory with {expected}).")  # fmt: skip
        if not tokenizer_files(p):
            raise ShardwiseError(f"{cfg.source}: data.tokenizer {cfg.data.tokenizer!r} has no tokenizer files "
                                 f"(expected {expected}, ...).")  # fmt: skip
        check_remote_code(p, cfg.model.trust_remote_code, where=f"{cfg.source}: data.tokenizer")
        check_tokenizer_files(p, where=f"{cfg.source}: data.tokenizer")
        return str(p)
    if cfg.model.path is not None:
        p = Path(cfg.model.path).expanduser()
        if tokenizer_files(p):
            check_remote_code(p, cfg.model.trust_remote_code, where=f"{cfg.source}: model.path's tokenizer")
            check_tokenizer_files(p, where=f"{cfg.source}: model.path's tokenizer")
            return str(p)
        raise ShardwiseError(
            f"{cfg.source}: model.path {cfg.model.path!r} has no tokenizer files (expected {expected}, ...) and "
            "data.tokenizer is not set; set data.tokenizer to the tokenizer directory this model was trained "
            "with (the bundled toy tokenizer's ids would mean nothing to its embeddings).")
    return str(default_tokenizer_path())


def data_cache_dir(cfg: TrainConfig) -> Path:
    """Where the tokenised dataset is cached: beside the run's outputs, so a resume finds it."""
    return Path(cfg.checkpointing.output_dir) / ".shardwise" / "data-cache"


def check_vocab(cfg: TrainConfig, tokenizer: Any, vocab_size: int, tokenizer_dir: str) -> None:
    """Every id the tokenizer can produce (added tokens included) must index the embedding;
    otherwise the first out-of-range id is a CUDA device-side assert, or silent garbage."""
    n = len(tokenizer)
    if n > vocab_size:
        model = f"model.path {cfg.model.path!r}" if cfg.model.path else f"model.name {cfg.model.name!r}"
        raise ShardwiseError(
            f"{cfg.source}: the tokenizer {tokenizer_dir!r} has {n} tokens (len(tokenizer), added tokens "
            f"included) but {model} has vocab_size {vocab_size}: ids >= {vocab_size} have no embedding. "
            "Set data.tokenizer to the model's own tokenizer, or use a model whose vocabulary covers it.")


def prepare_sft(run: RunSpec) -> Path:
    """Preflight's data step: load the tokenizer, check it against the model, and parse,
    validate, template, tokenise and pack the training files once into the data cache
    (errors name file and line). Returns the cache directory every rank then loads."""
    from shardwise.data import ensure_cache, load_tokenizer

    cfg = run.config
    tok_dir = resolved_tokenizer_path(cfg)
    tok = load_tokenizer(tok_dir, trust_remote_code=cfg.model.trust_remote_code)
    check_vocab(cfg, tok, run.model.vocab_size, tok_dir)  # config.json's or the catalog's
    dc = data_config(cfg)
    if cfg.run.eval_every_steps is not None:  # the validation split the evaluations read, cached too
        ensure_cache(dc, tok, tok_dir, data_cache_dir(cfg), split="validation")
    return ensure_cache(dc, tok, tok_dir, data_cache_dir(cfg), split="train")


def build_sft_split(run: RunSpec, split: str) -> tuple[Any, Any]:
    """Dataset and collator of one split ("train" or "validation"): from the data cache preflight
    wrote, else built in memory (the same rows)."""
    from shardwise.data import SFTCollator, build_dataset, find_cache, load_dataset, load_tokenizer
    from shardwise.train.engines._torch_common import compute_dtype

    cfg = run.config
    tok_dir = resolved_tokenizer_path(cfg)
    tok = load_tokenizer(tok_dir, trust_remote_code=cfg.model.trust_remote_code)
    dc = data_config(cfg)
    cached = find_cache(dc, tok_dir, data_cache_dir(cfg), split=split)
    ds = load_dataset(cached) if cached is not None else build_dataset(dc, tok, split=split)
    # Pipeline stages fix their buffers' shape at the first step (shardwise.train.engines.pipeline):
    # there every micro-batch is padded to its longest possible shape (ignored labels: same loss).
    rows = dc.max_length if run.layout.pp > 1 else None
    if run.train.packed_attention == "dense":
        # The stated fallback: an additive [B, 1, S, S] mask in the compute dtype (eager attention).
        collate = SFTCollator(tok.pad_token_id, mask="additive", pad_to_multiple_of=8, mask_dtype=compute_dtype(run),
                              pad_to=rows)
    else:
        # Padding-free [1, T]: the documents' boundaries from position_ids / cu_seq_lens, no mask
        # (shardwise.train.model.packed_attention); the same target tokens, so the same loss.
        collate = SFTCollator(tok.pad_token_id, mask="varlen",
                              pad_to=rows * cfg.run.micro_batch if rows is not None else None)
    return ds, collate


def build_sft(run: RunSpec, env: DistEnv) -> tuple[Any, Any, Any]:
    """Dataset, collator and sampler of this rank. The dataset comes from the data cache that
    preflight wrote (the same rows as building it here, without tokenising again); without
    one (a caller that skipped preflight) it is built in memory."""
    from shardwise.data import ResumableDistributedSampler

    ds, collate = build_sft_split(run, "train")
    dc = data_config(run.config)
    sampler = ResumableDistributedSampler(
        ds, num_replicas=env.world_size, rank=env.rank, seed=dc.seed, shuffle=True, drop_last=True
    )
    return ds, collate, sampler
