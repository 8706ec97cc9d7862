"""The one way shardwise reads a DCP checkpoint: nothing in it can run code.

`torch.distributed.checkpoint` keeps a checkpoint's index as a pickle, and a pickle can name any
callable. The unpickler here admits an exact list of (module, qualified name) pairs, read off
torch 2.13's writer, and nothing else: a crafted index that names `os.system`, `builtins.exec`,
`torch.load` or a dotted path through an admitted module is refused (UnsafeCheckpointError).

Allowed classes are not enough: DCP's default load planner reads an index entry of type
`BytesStorageMetadata` with `torch.load(weights_only=False)`, so an index made only of admitted
classes can still point an entry at a pickle that runs code. shardwise's checkpoints hold tensors
only (everything else is JSON beside them), so `read_index` refuses any entry that is not a
tensor, naming its key, and any storage record that reads outside the checkpoint's own regular
files (a path with a separator, a symlink, a range past the file's end, a stream transform
shardwise never writes). Every load goes through `load_tensors` (the guard, with a planner whose
byte path refuses as a second line), before any rank starts (preflight and `shardwise export`
read the index first) and again where DCP loads it (SafeReader). The tensor chunks themselves
are read by DCP with `torch.load(weights_only=True)`. We keep DCP's format (rather than writing
our own index) so that any DCP tool reads a shardwise checkpoint; the price is this guard, which
`tests/security/test_checkpoint_index.py` holds to what a fresh index needs.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from shardwise.config.file import is_plain_file_name
from shardwise.errors import ShardwiseError


class UnsafeCheckpointError(ShardwiseError):
    """A checkpoint index that asks for more than DCP's metadata classes: refused, never skipped."""


def _torch_dtypes() -> frozenset[tuple[str, str]]:
    return frozenset(("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    """Admits exactly the (module, qualified name) pairs DCP's `.metadata` is made of, read off
    torch 2.13's writer (`tests/security/test_checkpoint_index.py` checks a fresh index needs
    nothing else), and nothing else: no module-level wildcard and no dotted names. A dotted name
    is how protocol 4 reaches through an allowed module to what it imports
    (`torch.distributed.checkpoint.metadata` + `os.system`); an exact pair never matches one.
    Every admitted callable only builds a value (a dataclass, an enum member, `torch.Size`, a
    path, a layout looked up by name): none reads or writes anything."""

    _ALLOWED: frozenset[tuple[str, str]] = frozenset({
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }) | _torch_dtypes()

    @staticmethod
    def resolve(module: str, name: str) -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refers to {module}:{name}, which a DCP index never does (a crafted file that would run code?)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("uses a persistent id, which a DCP index never does")


@contextmanager
def _admitted_unchanged() -> Iterator[None]:
    """Pickle's BUILD opcode sets attributes on whatever it is given, an admitted class included
    (`Metadata` + BUILD `{"storage_data": ...}` would change every index read afterwards in this
    process). Each admitted object's attributes are put back as they were and the index refused."""
    found = [_MetadataUnpickler.resolve(m, n) for m, n in sorted(_MetadataUnpickler._ALLOWED)]
    objs = [o for o in found if hasattr(o, "__dict__")]
    before = [dict(vars(o)) for o in objs]
    try:
        yield
    finally:  # also when the load failed half-way: nothing it set stays set
        changed = []
        for o, was in zip(objs, before, strict=True):
            now = vars(o)
            if now.keys() != was.keys() or any(now[k] is not v for k, v in was.items()):
                changed.append(getattr(o, "__qualname__", repr(o)))
                for k in [k for k in now if k not in was]:
                    delattr(o, k)
                for k, v in was.items():
                    if now.get(k) is not v:
                        setattr(o, k, v)
    if changed:
        raise UnsafeCheckpointError(f"sets attributes of {', '.join(changed)} (pickle's BUILD on an admitted "
                                    "class), which a DCP index never does")


_MAX_INDEX_BYTES = 1 << 30  # a 70B run's index is a few MB (one record per tensor chunk per rank)


def read_index(path: Path) -> Any:
    """DCP's index of the checkpoint at `path`, unpickled with only its own classes admitted and
    checked to describe tensors stored in the directory's own files (`check_index`).
    ShardwiseError (UnsafeCheckpointError for what could run code or read elsewhere) naming the
    file otherwise."""
    f = Path(path) / ".metadata"
    try:
        if f.is_symlink() or (f.exists() and not f.is_file()):
            raise UnsafeCheckpointError("is not a regular file")
        if f.stat().st_size > _MAX_INDEX_BYTES:
            raise UnsafeCheckpointError(f"has {f.stat().st_size} bytes, over the {_MAX_INDEX_BYTES} an index "
                                        "of any real run stays under")
        with open(f, "rb") as fh, _admitted_unchanged():
            meta = _MetadataUnpickler(fh).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{f}: checkpoint index {e}; it is not loaded") from None
    except FileNotFoundError:
        raise ShardwiseError(f"{f}: missing: not a complete checkpoint") from None
    except Exception as e:  # any malformed pickle: truncated, wrong opcodes, bad arguments
        raise ShardwiseError(f"{f}: not a valid checkpoint index ({type(e).__name__}: {e})") from None
    check_index(meta, Path(path))
    return meta


def check_index(meta: Any, path: Path) -> None:
    """Refuse an index that is not DCP's `Metadata`, holds an entry that is not a tensor (a
    `BytesStorageMetadata` is read with `torch.load(weights_only=False)` by DCP's default planner),
    or stores a chunk anywhere but in a regular file of `path` itself, within its size, untransformed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    f = path / ".metadata"
    if not isinstance(meta, Metadata):
        raise ShardwiseError(f"{f}: not a checkpoint index (a {type(meta).__name__}, not DCP's Metadata)")
    entries = meta.state_dict_metadata
    if not isinstance(entries, dict):
        raise ShardwiseError(f"{f}: not a valid checkpoint index (its entries are a {type(entries).__name__})")
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{f}: checkpoint index entry {key!r} is a {type(entry).__name__}, not a tensor: shardwise "
                "checkpoints hold only tensors, and DCP would unpickle this entry's bytes (code could run); "
                "it is not loaded")
    storage = meta.storage_data
    if not isinstance(storage, dict):
        raise ShardwiseError(f"{f}: not a valid checkpoint index (its storage records are a "
                             f"{type(storage).__name__})")
    sizes: dict[str, int] = {}
    for where, info in storage.items():
        if not isinstance(info, _StorageInfo):
            raise ShardwiseError(f"{f}: not a valid checkpoint index (a storage record is a {type(info).__name__})")
        name, offset, length = info.relative_path, info.offset, info.length
        fqn = getattr(where, "fqn", where)
        if not is_plain_file_name(name):
            raise UnsafeCheckpointError(f"{f}: checkpoint index stores {fqn!r} at {name!r}, outside the "
                                        "checkpoint's own files; it is not loaded")
        if info.transform_descriptors:
            raise UnsafeCheckpointError(f"{f}: checkpoint index reads {fqn!r} through stream transforms "
                                        f"{list(info.transform_descriptors)!r}, which shardwise never writes; "
                                        "it is not loaded")
        if name not in sizes:
            data = path / name
            if data.is_symlink() or not data.is_file():
                raise UnsafeCheckpointError(f"{f}: checkpoint index stores {fqn!r} in {name}, which is "
                                            "not a regular file of the checkpoint; it is not loaded")
            sizes[name] = data.stat().st_size
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0
                and offset + length <= sizes[name]):
            raise UnsafeCheckpointError(f"{f}: checkpoint index stores {fqn!r} at bytes {offset!r}+{length!r} "
                                        f"of {name}, which has {sizes[name]}; it is not loaded")


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner with its byte path closed: `check_index` refuses byte entries first,
    and should one reach the load anyway, it is refused here instead of `torch.load(weights_only=False)`."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UnsafeCheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is bytes, not a tensor: "
                                    "shardwise never unpickles a checkpoint's bytes; it is not loaded")


def load_tensors(state: dict[str, Any], storage_reader: Any, *, no_dist: bool = False) -> None:
    """`torch.distributed.checkpoint.load` of tensors only: every DCP load in shardwise goes
    through here (a checkpoint's SafeReader, or DCP's HuggingFaceStorageReader for safetensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(storage_reader, SafeReader):  # refused here as itself (DCP would re-raise a read failure
        read_index(Path(storage_reader.path))   # of the index as an AssertionError with only its text)
    try:
        dcp.load(state, storage_reader=storage_reader, planner=_TensorsOnlyPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # DCP wraps each rank's failure: a refusal is raised as itself
        failures = [exc for _, (exc, _tb) in sorted(e.failures.items())]
        refused = [exc for exc in failures if isinstance(exc, ShardwiseError)]
        if refused:
            raise refused[0] from None
        first = failures[0] if failures else e
        if isinstance(first, (pickle.UnpicklingError, EOFError, ValueError, RuntimeError, AssertionError)):
            # a chunk whose bytes are not the tensor the index says (torch.load(weights_only=True)
            # refused them, or they are cut short): a damaged or crafted checkpoint, not a crash
            where = getattr(storage_reader, "path", "the checkpoint")
            raise ShardwiseError(f"{where}: a tensor's stored bytes cannot be read as the index describes them "
                                 f"({type(first).__name__}: {str(first).strip().splitlines()[0][:200]}); the "
                                 "checkpoint is damaged and is not loaded") from None
        raise


class SafeReader(FileSystemReader):
    """FileSystemReader whose index load cannot execute code (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_index(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
