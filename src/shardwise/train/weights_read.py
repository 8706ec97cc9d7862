"""Reading a checkpoint's tensors into a model's parts (shardwise.train.weights):

- safetensors: `torch.distributed.checkpoint.load` with `HuggingFaceStorageReader` fills every
  tensor of the model (plain tensors or DTensor shards; the read casts into the target's dtype)
  with exactly the slice the rank holds (`load_safetensors`);
- PyTorch `.bin` (pickles cannot be read by slices): rank 0 reads one tensor at a time
  (`torch.load(weights_only=True, mmap=True)`: torch's own allow-list, no code runs) and
  broadcasts it; every rank keeps its slice (`load_broadcast`).

Both refuse a checkpoint that lacks a tensor of the model its config.json builds, or holds one in
another shape, naming them, before any weight is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Module-path segments PEFT and activation checkpointing insert: a model key without them is the
# checkpoint's key (`q_proj.base_layer.weight` -> `q_proj.weight`; a `modules_to_save` copy starts
# from the weights it copies).
WRAPPER_SEGMENTS = ("base_layer", "original_module", "_checkpoint_wrapped_module", "_orig_mod")
ADAPTER_MARK = "lora_"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
Groups = dict[str, list[tuple[str, Any]]]


def safetensors_files(path: str | Path) -> list[Path] | None:
    """The checkpoint's safetensors files (the index's, in order), or None if it has none.
    An index naming a file that is not there is an error naming both."""
    root = Path(path)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
            names = sorted(set(doc["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ShardwiseError(f"{index}: cannot be read as a safetensors index ({exc}); expected JSON "
                                 "with a 'weight_map' of tensor name -> file name") from None
        files = [root / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ShardwiseError(f"{index}: weight_map names {missing[:3]} ({len(missing)} file(s)), not in {root}")
        return files
    single = root / SAFETENSORS
    return [single] if single.is_file() else None


def checkpoint_key(fqn: str) -> str | None:
    """The checkpoint key a model parameter or buffer is read from; None for an adapter."""
    parts = fqn.split(".")
    if any(p.startswith(ADAPTER_MARK) for p in parts):
        return None
    out, i = [], 0
    while i < len(parts):
        if parts[i] in WRAPPER_SEGMENTS:
            i += 1
        elif parts[i] == "modules_to_save" and i + 1 < len(parts):
            i += 2  # `modules_to_save.<adapter>`
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def copy_full(target: Any, full: Any) -> None:
    """Copy a full tensor into `target`: a plain tensor, or this rank's shard of a DTensor (every
    rank holds the same `full`: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        part = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.data.copy_(full)


def bin_files(path: str | Path) -> list[Path] | None:
    root = Path(path)
    index = root / BIN_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ShardwiseError(f"{index}: cannot be read as an index ({exc}); expected JSON with a 'weight_map'") from None
        return [root / n for n in names]
    return [root / BIN] if (root / BIN).is_file() else None


class TensorFiles:
    """One process's reader of a checkpoint's tensors by key: safetensors (one tensor read at a
    time) or `.bin` (one file mapped at a time, tensors paged in when read)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._mapped: tuple[Path, dict[str, Any]] | None = None
        st = safetensors_files(path)
        self.format = "safetensors" if st else "bin"
        if st:
            for f in st:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        self._where[k] = f
                        self._shapes[k] = tuple(h.get_slice(k).get_shape())
        else:
            for f in bin_files(path) or []:
                for k, t in self._map(f).items():
                    self._where[k] = f
                    self._shapes[k] = tuple(t.shape)

    def shape(self, key: str) -> tuple[int, ...] | None:
        return self._shapes.get(key)

    def get(self, key: str) -> Any:
        f = self._where[key]
        if self.format == "bin":
            return self._map(f)[key]
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(key)

    def _map(self, f: Path) -> dict[str, Any]:
        import torch

        if self._mapped is None or self._mapped[0] != f:
            self._mapped = None  # the previous file's pages go before the next is mapped
            try:
                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # an unpicklable or crafted file: torch's allow-list refused it
                raise ShardwiseError(f"{f}: cannot be read as a PyTorch state dict with weights_only=True "
                                     f"({type(exc).__name__}: {str(exc)[:200]})") from None
            self._mapped = (f, state)
        return self._mapped[1]


def model_keys(module: Any) -> Groups:
    """Checkpoint key -> the model's (fqn, tensor) it fills: adapters skipped, a tensor tied to
    one already listed (lm_head to the embedding) skipped, a `modules_to_save` copy sharing the
    key of the weights it copies."""
    groups: Groups = {}
    seen: set[int] = set()
    for fqn, t in module.state_dict(keep_vars=True).items():
        key = checkpoint_key(fqn)
        if key is None or id(t) in seen:
            continue
        seen.add(id(t))
        groups.setdefault(key, []).append((fqn, t))
    return groups


def check_keys(groups: Groups, shape_of: Callable[[str], tuple[int, ...] | None], tied: bool, path: Path,
               shape: Callable[[Any], tuple[int, ...]] = lambda t: tuple(t.shape)) -> str:
    """"" (the checkpoint holds every key in its shape), or the message naming what it lacks or
    holds in another shape (a layout transformers converts on load: MoE experts, legacy names).
    A tied lm_head absent from the files is filled with the embedding."""
    missing, wrong = [], []
    for key, group in groups.items():
        want, have = shape(group[0][1]), shape_of(key)
        if have is None:
            if not (tied and key == "lm_head.weight"):
                missing.append(key)
        elif tuple(want) != tuple(have):
            wrong.append(f"{key} {tuple(want)} vs {tuple(have)}")
    if not missing and not wrong:
        return ""
    return (f"{path}: the checkpoint does not match the model built from its config.json: "
            + (f"{len(missing)} tensor(s) missing (e.g. {missing[:3]})" if missing else "")
            + ("; " if missing and wrong else "")
            + (f"{len(wrong)} of another shape (e.g. {wrong[:2]})" if wrong else "")
            + ". A layout transformers converts while loading (fused MoE experts, legacy names) is not read by "
              "slices: convert the checkpoint with save_pretrained once, or set model.random_init: true")


def agree(verdict: str) -> None:
    """Rank 0's verdict (the ranks that cannot see the files pass ""), raised on every rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        verdict = _broadcast_text(verdict, _comm_device())
    if verdict:
        raise ShardwiseError(verdict)


def _comm_device() -> Any:
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _tied(module: Any) -> bool:
    return bool(getattr(getattr(module, "config", None), "tie_word_embeddings", False))


def load_safetensors(module: Any, path: Path) -> None:
    """DCP's HuggingFaceStorageReader fills every checkpoint tensor of `module` from `path`
    (every rank reads the files' headers itself)."""
    import torch.distributed.checkpoint as dcp

    from shardwise.train.checkpoint_index import load_tensors

    files = TensorFiles(path)
    groups = model_keys(module)
    verdict = check_keys(groups, files.shape, _tied(module), path)
    if verdict:
        raise ShardwiseError(verdict)
    groups = {k: g for k, g in groups.items() if files.shape(k) is not None}  # a tied lm_head the files lack
    state = {key: group[0][1] for key, group in groups.items()}
    load_tensors(state, dcp.HuggingFaceStorageReader(str(path)))
    for key, group in groups.items():
        for _, t in group[1:]:  # a second module holding the same weights (modules_to_save)
            t.data.copy_(state[key].data)


def load_broadcast(module: Any, path: Path) -> None:
    """Rank 0 reads each tensor of a `.bin` checkpoint and broadcasts it; every rank copies its
    part (one full tensor in flight per rank). Collective."""
    import torch
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if on else 0
    device = _comm_device() if on else torch.device("cpu")
    files = TensorFiles(path) if rank == 0 else None
    groups = model_keys(module)
    agree(check_keys(groups, files.shape, _tied(module), path) if files is not None else "")
    present = torch.tensor([1 if files is None or files.shape(k) is not None else 0 for k in groups],
                           dtype=torch.int64, device=device)
    if on:
        dist.broadcast(present, src=0)  # a tied lm_head the files lack is skipped on every rank
    for (key, group), here in zip(groups.items(), present.tolist(), strict=True):
        if not here:
            continue
        first = group[0][1]
        buf = torch.empty(tuple(first.shape), dtype=first.dtype, device=device)
        if files is not None:
            buf.copy_(files.get(key))
        if on:
            dist.broadcast(buf, src=0)
        for _, t in group:
            copy_full(t, buf)
        del buf


def _broadcast_text(text: str, device: Any) -> str:
    """Rank 0's `text` on every rank, as UTF-8 bytes in a tensor (no pickle)."""
    import torch
    import torch.distributed as dist

    data = text.encode("utf-8")
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).decode("utf-8")
