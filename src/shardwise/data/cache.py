"""Tokenise once: the built SFTDataset on disk, keyed by everything that determines it.

The pipeline (parse, validate, template, tokenise, pack) runs once: preflight builds the
dataset, writes it here, and every rank (and a later resume) loads it, memory-mapped, so the
ranks of a node share one copy of the pages instead of each holding its own token arrays and
paying for a tokenisation that can take GBs (docs/data.md "Tokenise once").

Format, no pickle: the flat arrays of :class:`SFTDataset` as ``.npy`` files (read back with
``allow_pickle=False``) and ``meta.json`` (statistics, the "file:line" of every document).
Key: a hash of the cache format, the pipeline's own source, the versions of the libraries
that tokenise and render templates, the DataConfig, the tokenizer files' contents and each
data file's path, size and mtime. A directory is written under a temporary name and renamed
when complete, so a directory named by its key is always whole; a file lock makes one process
build it while the others wait and then load it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from shardwise import strict_json
from shardwise.config.data import DataConfig
from shardwise.data.dataset import DataStats, SFTDataset, build_dataset
from shardwise.data.formats import resolve_files
from shardwise.data.tokenize import EncodeStats
from shardwise.errors import ShardwiseError

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the stored layout changes
ARRAYS = ("tokens", "target", "offsets", "row_docs", "row_offsets", "lengths")
# The pipeline's code is part of the key: a fix to masking or packing must not be hidden by a
# cache built before it.
_PIPELINE = ("data/cache", "data/dataset", "data/formats", "data/labels", "data/packing", "data/template",
             "data/tokenize", "config/data")
_LIBRARIES = ("transformers", "tokenizers", "jinja2", "datasets")


def split_files(cfg: DataConfig, split: str) -> list[Path]:
    """The files `build_dataset` reads for `split` (resolved: missing files fail here)."""
    if split == "validation" and cfg.validation_files:
        return resolve_files(cfg.validation_files, where="data.validation_files")
    return resolve_files(cfg.train_files, where="data.train_files")


def cache_key(cfg: DataConfig, tokenizer_dir: str | Path, split: str = "train") -> str:
    """Hex digest of everything the built split depends on (see the module docstring)."""
    from importlib.metadata import PackageNotFoundError, version

    from shardwise.data import tokenizer_files

    h = hashlib.sha256()

    def add(label: str, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        h.update(f"{label}:{len(data)}:".encode())
        h.update(data)

    add("format", str(FORMAT))
    add("split", split)
    package = Path(__file__).resolve().parent.parent
    for name in _PIPELINE:
        add(f"code/{name}", (package / f"{name}.py").read_bytes())
    for lib in _LIBRARIES:
        try:
            add(f"lib/{lib}", version(lib))
        except PackageNotFoundError:
            add(f"lib/{lib}", "-")
    config = cfg.model_dump(mode="json")
    if cfg.validation_fraction == 0:  # the seed only picks the validation split; else it is the sampler's
        config.pop("seed")
    add("config", json.dumps(config, sort_keys=True))
    for f in tokenizer_files(tokenizer_dir):
        add(f"tokenizer/{f.relative_to(tokenizer_dir)}", f.read_bytes())
    for f in split_files(cfg, split):
        st = f.stat()
        add("file", f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return h.hexdigest()[:32]


def _complete(path: Path) -> bool:
    """A cache directory this code can load (renamed into place, so whole unless tampered with)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format") == FORMAT and all((path / f"{n}.npy").is_file() for n in ARRAYS)


def find_cache(cfg: DataConfig, tokenizer_dir: str | Path, root: str | Path, split: str = "train") -> Path | None:
    """The complete cache directory of this split under `root`, or None."""
    path = Path(root) / cache_key(cfg, tokenizer_dir, split)
    return path if _complete(path) else None


def save_dataset(ds: SFTDataset, path: Path, key: str = "") -> None:
    """Write `ds` into the (existing, empty) directory `path`."""
    row_lens = np.fromiter((len(r) for r in ds.rows), dtype=np.int64, count=len(ds.rows))
    arrays = {
        "tokens": np.asarray(ds.tokens, dtype=np.int32),
        "target": np.asarray(ds.target, dtype=bool),
        "offsets": np.asarray(ds.offsets, dtype=np.int64),
        "row_docs": np.fromiter((d for r in ds.rows for d in r), dtype=np.int64, count=int(row_lens.sum())),
        "row_offsets": np.concatenate(([0], np.cumsum(row_lens))).astype(np.int64),
        "lengths": np.asarray(ds.stats.encode.lengths, dtype=np.int64),
    }
    for name, arr in arrays.items():
        np.save(path / f"{name}.npy", np.ascontiguousarray(arr), allow_pickle=False)
    stats = asdict(ds.stats)
    stats["encode"].pop("lengths")
    meta = {"format": FORMAT, "key": key, "max_length": ds.max_length, "stats": stats, "where": ds.where}
    (path / "meta.json").write_text(strict_json.dumps(meta))


def _load_array(path: Path, mmap: bool) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError:  # an empty array cannot be memory-mapped
        return np.load(path, allow_pickle=False)


def load_dataset(path: str | Path, *, mmap: bool = True) -> SFTDataset:
    """The SFTDataset stored in `path`: same documents, order and packing as when it was built."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT}")
        a = {n: _load_array(path / f"{n}.npy", mmap and n in ("tokens", "target", "offsets")) for n in ARRAYS}
    except (OSError, ValueError, KeyError) as exc:
        raise ShardwiseError(f"data cache {path}: cannot be read ({exc}); delete the directory to rebuild it.") \
            from None  # fmt: skip
    bounds = a["row_offsets"].tolist()
    docs = a["row_docs"]
    rows = [docs[s:e].tolist() for s, e in pairwise(bounds)]
    stats_raw = meta["stats"]
    encode = EncodeStats(**stats_raw.pop("encode"), lengths=a["lengths"].tolist())
    stats = DataStats(**stats_raw, encode=encode)
    return SFTDataset.from_arrays(a["tokens"], a["target"], a["offsets"], list(meta["where"]), rows,
                                  int(meta["max_length"]), stats)  # fmt: skip


def ensure_cache(cfg: DataConfig, tokenizer: Any, tokenizer_dir: str | Path, root: str | Path,
                 split: str = "train") -> Path:  # fmt: skip
    """The cache directory of this split, built first if missing. Safe to call from every rank
    at once: the first process to take the lock builds, the others wait and then find it. A
    ShardwiseError of the builder is left beside the cache for the waiters, so N ranks print
    the data error once each instead of tokenising N times in turn to find it again."""
    from filelock import FileLock, Timeout

    root = Path(root)
    key = cache_key(cfg, tokenizer_dir, split)
    final = root / key
    if _complete(final):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardwiseError(f"data cache: cannot create {str(root)!r} ({exc.strerror}); expected a writable "
                             "checkpointing.output_dir.") from None  # fmt: skip
    started = time.time()
    error = root / f"{key}.error"
    lock = FileLock(str(root / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process to build the data cache %s", final)
        lock.acquire()
    except OSError as exc:
        raise ShardwiseError(f"data cache: cannot lock in {str(root)!r} ({exc.strerror}); expected a writable "
                             "checkpointing.output_dir.") from None  # fmt: skip
    try:
        if _complete(final):
            return final
        if error.is_file() and error.stat().st_mtime >= started:  # the builder we waited for failed
            raise ShardwiseError(error.read_text())
        _clear(root, key)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root))
        try:
            t0 = time.perf_counter()
            ds = build_dataset(cfg, tokenizer, split=split)
            save_dataset(ds, tmp, key)
            os.rename(tmp, final)
            log.info("data cache %s written in %.1fs (%s)", final, time.perf_counter() - t0, ds.stats.summary())
        except ShardwiseError as exc:
            try:
                error.write_text(str(exc))
            except OSError:
                pass  # the waiters then build and find the error themselves
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename
        return final
    finally:
        lock.release()


def _clear(root: Path, key: str) -> None:
    """Under the lock: leftovers of this key from killed or failed builders, and a directory
    with the key's name that does not load (moved aside: a reader may still map its files)."""
    for p in root.glob(f"{key}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    (root / f"{key}.error").unlink(missing_ok=True)
    final = root / key
    if final.exists():
        final.rename(root / f"{key}.stale-{os.getpid()}-{time.time_ns()}")
