"""Reading DCP's index (`.metadata`, a pickle) without running code.

`torch.distributed.checkpoint` keeps a checkpoint's index as a pickle, and a pickle can name any
callable. The unpickler here admits an exact list of (module, qualified name) pairs, read off
torch 2.13's writer, and nothing else: a crafted index that names `os.system`, `builtins.exec`,
`torch.load` or a dotted path through an admitted module is refused (UnsafeCheckpointError),
before any rank starts (preflight and `shardwise export` read the index first) and again where
DCP loads it (SafeReader). The tensor files themselves are read by DCP with
`torch.load(weights_only=True)`. We keep DCP's format (rather than writing our own index) so
that any DCP tool reads a shardwise checkpoint; the price is this allow-list, which
`tests/security/test_checkpoint_index.py` holds to what a fresh index needs.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

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

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"refers to {module}:{name}, which a DCP index never does (a crafted file that would run code?)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("uses a persistent id, which a DCP index never does")


def read_index(path: Path) -> Any:
    """DCP's index of the checkpoint at `path`, unpickled with only its own classes admitted.
    ShardwiseError (UnsafeCheckpointError for a forbidden name) naming the file otherwise."""
    f = Path(path) / ".metadata"
    try:
        with open(f, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{f}: checkpoint index {e}; it is not loaded") from None
    except FileNotFoundError:
        raise ShardwiseError(f"{f}: missing: not a complete checkpoint") from None
    except Exception as e:  # any malformed pickle: truncated, wrong opcodes, bad arguments
        raise ShardwiseError(f"{f}: not a valid checkpoint index ({type(e).__name__}: {e})") from None


class SafeReader(FileSystemReader):
    """FileSystemReader whose index load cannot execute code (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        metadata = read_index(Path(self.path))
        if not isinstance(metadata, Metadata):
            raise ShardwiseError(f"{Path(self.path) / '.metadata'}: not a checkpoint index (a "
                                 f"{type(metadata).__name__}, not DCP's Metadata)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
