"""DeepSpeed ZeRO-3's load (shardwise.train.model.weights): the model built inside `deepspeed.zero.Init`
(each module partitioned as it is constructed), then its partitions filled from the checkpoint in
chunks gathered on every rank, rank 0 copying one tensor at a time (safetensors or `.bin`:
`weights_read.TensorFiles`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardwise.train.model.weights import ZERO3_CHUNK_BYTES
from shardwise.train.model.weights_read import TensorFiles, agree, check_keys, model_keys


def zero3_model(run: Any, attn_implementation: str) -> Any:
    """The run's HF model built inside `deepspeed.zero.Init` with its DeepSpeed config: every
    rank holds its partitions only, in the dtype DeepSpeed computes in (it does not cast a
    `zero.Init` model; fp32 masters of trainable parameters are made from these values)."""
    import os

    if run.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.run import deepspeed_config
    from shardwise.train.engines._torch_common import compute_dtype
    from shardwise.train.engines.deepspeed import deepspeed_comm

    cfg = run.config.model
    hf_cfg = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    dtype = compute_dtype(run)
    # zero.Init patches tensor construction: modules imported lazily inside it (transformers'
    # modeling and masking code, which imports torch._dynamo) must be imported before.
    import torch._dynamo  # noqa: F401
    import transformers.masking_utils  # noqa: F401

    AutoModelForCausalLM._model_mapping[type(hf_cfg)]  # imports the architecture's modeling module
    deepspeed_comm()  # zero.Init reads the world size off deepspeed.comm
    # The dtype comes from the config (bf16/fp16/fp32 as DeepSpeed trains): an explicit `dtype=`
    # is ignored where the accelerator lacks fp16 (DeepSpeed 0.19 `_set_dtype` precedence: bf16 on CPU).
    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config(run)):
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation=attn_implementation,
                                                trust_remote_code=cfg.trust_remote_code)


def load_zero3(model: Any, path: Path, rank: int) -> None:
    """Fill a `zero.Init` model's partitions from `path`: chunks of parameters gathered on every
    rank (at most ZERO3_CHUNK_BYTES of full tensors, overrun by one tensor), rank 0 copying each
    tensor from the files, DeepSpeed partitioning the modified values on exit. Rank 0 checks the
    files' keys and shapes first and every rank learns its verdict."""
    import deepspeed
    import torch

    files = TensorFiles(path) if rank == 0 else None
    groups = {k: g for k, g in model_keys(model).items() if hasattr(g[0][1], "ds_id")}  # parameters
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    agree(check_keys(groups, files.shape, tied, path, _full_shape) if files is not None else "")
    named = [(key, group) for key, group in groups.items()]
    for chunk in _chunks(named, ZERO3_CHUNK_BYTES):
        params = [t for _, group in chunk for _, t in group]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if files is not None:
                with torch.no_grad():
                    for key, group in chunk:
                        if files.shape(key) is not None:
                            value = files.get(key)
                            for _, t in group:
                                t.data.copy_(value)


def _full_shape(t: Any) -> tuple[int, ...]:
    return tuple(t.ds_shape) if hasattr(t, "ds_shape") else tuple(t.shape)


def _chunks(named: list[tuple[str, Any]], limit: int) -> Iterable[list[tuple[str, Any]]]:
    chunk, size = [], 0
    for key, group in named:
        p = group[0][1]
        n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        chunk.append((key, group))
        size += n * p.element_size()
        if size >= limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
