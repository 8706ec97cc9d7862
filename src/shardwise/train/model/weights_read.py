"""Reading a checkpoint's tensors into a model's parts (shardwise.train.model.weights):

- safetensors: `torch.distributed.checkpoint.load` with `HuggingFaceStorageReader` fills every
  tensor of the model (plain tensors or DTensor shards; the read casts into the target's dtype)
  with exactly the slice the rank holds (`load_safetensors`);
- PyTorch `.bin` (pickles cannot be read by slices): rank 0 reads one tensor at a time
  (`torch.load(weights_only=True, mmap=True)`: torch's own allow-list, no code runs) and
  broadcasts it; every rank keeps its slice (`load_broadcast`).

Both refuse a checkpoint that lacks a tensor of the model its config.json builds, or holds one in
another shape, naming them, before any weight is written. `check_files` opens every file as the
ranks will (a safetensors header's length checked against the file before the library maps it; a
`.bin`'s zip directory checked before torch reads its pickle), so preflight refuses a bad file
before any rank starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.config.file import is_plain_file_name
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
# safetensors' own cap on its JSON header (safetensors/src/tensor.rs MAX_HEADER_SIZE).
MAX_SAFETENSORS_HEADER = 100_000_000
# A state dict's pickle names each tensor once: a few hundred KiB for the largest models.
MAX_PICKLE_BYTES = 256 << 20
# An index lists each tensor once: a few MiB for the largest models.
MAX_INDEX_BYTES = 64 << 20
Groups = dict[str, list[tuple[str, Any]]]


def _index_files(index: Path, what: str) -> list[Path]:
    """The files an index's `weight_map` names, each a plain file name beside the index that exists."""
    root = index.parent
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise ValueError(f"larger than {MAX_INDEX_BYTES >> 20} MiB")
        doc = json.loads(index.read_text(encoding="utf-8"))
        names = sorted(set(doc["weight_map"].values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ShardwiseError(f"{index}: cannot be read as a {what} index ({exc}); expected JSON with a "
                             "'weight_map' of tensor name -> file name") from None
    odd = [n for n in names if not is_plain_file_name(n)]
    if odd:
        raise ShardwiseError(f"{index}: weight_map names {odd[:3]!r}: expected file names in {root} (no "
                             "directories, nothing outside it)")
    files = [root / n for n in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ShardwiseError(f"{index}: weight_map names {missing[:3]} ({len(missing)} file(s)), not in {root}")
    return files


def safetensors_files(path: str | Path) -> list[Path] | None:
    """The checkpoint's safetensors files (the index's, in order), or None if it has none.
    An index naming a file that is not there (or not a plain name in the directory) is an error
    naming both."""
    root = Path(path)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        return _index_files(index, "safetensors")
    single = root / SAFETENSORS
    return [single] if single.is_file() else None


def check_safetensors_header(f: Path) -> None:
    """The 8-byte header length of a safetensors file against the file's size and the format's
    cap, read before the library maps it: a claimed length is never allocated."""
    try:
        size = f.stat().st_size
        with f.open("rb") as h:
            head = h.read(8)
    except OSError as exc:
        raise ShardwiseError(f"{f}: cannot be read ({exc.strerror or exc})") from None
    if len(head) < 8:
        raise ShardwiseError(f"{f}: {size} bytes, shorter than a safetensors header; expected a safetensors file")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise ShardwiseError(f"{f}: header length {n} bytes, beyond the file ({size} bytes) or safetensors' cap "
                             f"({MAX_SAFETENSORS_HEADER} bytes); expected a safetensors file")


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
    """The checkpoint's `.bin` files (the index's, in order), or None if it has none."""
    root = Path(path)
    index = root / BIN_INDEX
    if index.is_file():
        return _index_files(index, "PyTorch weights")
    return [root / BIN] if (root / BIN).is_file() else None


def check_bin_archive(f: Path) -> None:
    """A `.bin` is a torch.save zip archive whose members are stored (torch writes them so; mmap
    needs it) and whose pickle is at most MAX_PICKLE_BYTES: checked from the zip's directory
    before torch reads it, so a crafted archive cannot make the read unbounded."""
    import zipfile

    try:
        with zipfile.ZipFile(f) as z:
            members = z.infolist()
    except Exception as exc:  # zipfile's errors for a malformed archive vary (BadZipFile, NotImplementedError, ...)
        raise ShardwiseError(f"{f}: not a PyTorch zip archive ({exc}); expected a state dict written by torch.save "
                             "(legacy pre-zip pickles are not read)") from None
    pickles = [m for m in members if m.filename.endswith("/data.pkl") or m.filename == "data.pkl"]
    if len(pickles) != 1:
        raise ShardwiseError(f"{f}: {len(pickles)} data.pkl records; expected one (a torch.save archive)")
    packed = [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise ShardwiseError(f"{f}: compressed records {packed[:3]}; torch.save stores them uncompressed")
    if pickles[0].file_size > MAX_PICKLE_BYTES:
        raise ShardwiseError(f"{f}: data.pkl is {pickles[0].file_size} bytes, over {MAX_PICKLE_BYTES >> 20} MiB; "
                             "a state dict's pickle is a few hundred KiB")


def check_files(path: str | Path) -> str | None:
    """Every weights file of the checkpoint at `path` opened as the ranks open it (headers read,
    `.bin` pickles through torch's weights_only allow-list, tensors mapped, never read), before any
    rank starts: a ShardwiseError naming the file. Returns the format, None without weights."""
    files = TensorFiles(path)
    return files.format if files.keys() else None


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
                check_safetensors_header(f)
                try:
                    with safe_open(str(f), framework="pt") as h:
                        for k in h.keys():
                            self._where[k] = f
                            self._shapes[k] = tuple(h.get_slice(k).get_shape())
                except Exception as exc:  # safetensors' own checks: JSON, dtypes, offsets, overlaps
                    raise ShardwiseError(f"{f}: cannot be read as safetensors ({type(exc).__name__}: "
                                         f"{str(exc)[:200]})") from None
        else:
            for f in bin_files(path) or []:
                for k, t in self._map(f).items():
                    self._where[k] = f
                    self._shapes[k] = tuple(t.shape)

    def keys(self) -> list[str]:
        return list(self._where)

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
            check_bin_archive(f)
            try:
                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # an unpicklable or crafted file: torch's allow-list refused it
                raise ShardwiseError(f"{f}: cannot be read as a PyTorch state dict with weights_only=True "
                                     f"({type(exc).__name__}: {str(exc)[:200]})") from None
            if not isinstance(state, dict) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
                raise ShardwiseError(f"{f}: holds a {type(state).__name__}, not a state dict of tensor name -> "
                                     "tensor")
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

    from shardwise.train.checkpoint.index import load_tensors

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
