"""A Llama checkpoint of real size on disk for the load-memory tests: random bf16 weights in
sharded safetensors with an index, written tensor by tensor (the full model never exists in
memory), cached across sessions in pytest's cache directory.

`llama-1.36b`: hidden 2048, 24 layers, MLP 5632, vocab 32000, untied (1,364,297,728 params,
2.73 GB); `llama-374m`: hidden 1024, 24 layers, MLP 2816, vocab 32000, untied (373,867,520 params);
`llama-134m`: hidden 768, 12 layers, MLP 2048, vocab 32000 (134M params);
`llama-8x1024`: hidden 1024, 8 layers, MLP 2816, vocab 1280 (the bundled tokenizer's 1172 tokens
fit; 104M params, almost all in the layers, each weight 2-6 MiB in bf16)."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    "llama-1.36b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000},
    "llama-134m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": 32000},
    "llama-374m": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000},
    "llama-8x1024": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                     "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1280},
}
MAX_SHARD_BYTES = 500_000_000  # save_pretrained(max_shard_size="500MB")


def make_checkpoint(root: Path, name: str) -> Path:
    """`root/name`, written once: under a file lock (pytest-xdist workers share the cache), into a
    temporary directory renamed into place when complete, so no reader ever sees a partial one."""
    import shutil

    from filelock import FileLock

    out = root / name
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if not (out / "DONE").exists():
            tmp = root / f".{name}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            _write(tmp, name)
            (tmp / "DONE").touch()
            tmp.rename(out)
    return out


def _write(out: Path, name: str) -> None:
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True)
    cfg = LlamaConfig(**SHAPES[name], tie_word_embeddings=False, dtype="bfloat16")
    with init_empty_weights():
        shapes = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).named_parameters()}
    groups: list[list[str]] = [[]]  # the shard of each tensor, from the sizes alone
    size = 0
    for n, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if size and size + nbytes > MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate(groups):  # one shard in memory at a time
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {n: (torch.ones(shapes[n]) if n.endswith("norm.weight")
                     else torch.randn(shapes[n], generator=g) * 0.02).to(torch.bfloat16) for n in names}
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        del shard
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg.save_pretrained(out)


def as_downloaded(checkpoint: Path, dest: Path) -> Path:
    """`dest`: `checkpoint`'s files (symlinked) with the bundled tokenizer beside them, as a hub
    download looks."""
    import os
    import shutil

    from shardwise.data import default_tokenizer_path

    dest.mkdir()
    for f in checkpoint.iterdir():
        os.symlink(f, dest / f.name)
    for f in default_tokenizer_path().iterdir():
        if f.is_file() and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)
    return dest
