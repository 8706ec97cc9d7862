"""Sharded training checkpoints that any engine and any world size can resume.

One format for every engine: a `torch.distributed.checkpoint` (DCP) directory holding the
*canonical* training state, keyed by parameter name, never by engine or rank:

- `model.<fqn>`: the fp32 master weights (what the optimizer updates);
- `optim.exp_avg.<fqn>`, `optim.exp_avg_sq.<fqn>`: AdamW's moments, fp32, same shape.

Each engine maps its own layout onto these names (`Engine.checkpoint_state`): FSDP2 hands
over its DTensor shards, DDP its replicated tensors (DCP writes one copy), DeepSpeed ZeRO
the full tensors assembled from its flat partitions (each rank keeps a size-balanced share, so
the writes spread over ranks). DCP reshards on load, so a checkpoint written by 2 FSDP2
ranks loads into 1 ZeRO-3 rank and the other way round. Everything that is not a tensor
(step, data position, optimizer step count, loss scaler, RNG streams) is JSON beside it.

Publishing is atomic: all ranks write into `checkpoints/.tmp-step-N/`; rank 0 then hashes
every file (each rank hashes its own shards), writes `manifest.json` last (files, sizes,
sha256, config, world size, strategy, versions) and renames the directory to `step-N`. A
directory without a complete, matching manifest is never loaded; a save killed half-way
leaves only a `.tmp-*` directory, removed (and named) when the next run starts.

DCP keeps its own index (`.metadata`) as a pickle; it is read here through an unpickler
that admits only DCP's metadata classes, so a checkpoint cannot run code (the tensor files
are read with `torch.load(weights_only=True)` by DCP itself).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from shardwise.errors import ShardwiseError

FORMAT = "shardwise-checkpoint/1"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
TMP_PREFIX = ".tmp-"
_HASH_CHUNK = 1 << 22

Reader = Callable[[dict[str, torch.Tensor]], None]


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


# --- reading DCP's index without running code --------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Only the classes DCP's `.metadata` is made of (checked against torch 2.13's writer)."""

    _MODULES = ("torch.distributed.checkpoint.metadata",)
    _NAMES: frozenset[tuple[str, str]] = frozenset({
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    })

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which a DCP index never does")


class SafeReader(FileSystemReader):
    """FileSystemReader whose index load cannot execute code (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError) as e:
            raise ShardwiseError(f"{path}: not a valid checkpoint index ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def tensor_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor in a checkpoint: key -> (global shape, dtype), from the index alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = SafeReader(str(path)).read_metadata()
    return {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def read_tensors(path: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors from a checkpoint without a process group: export and
    tests use it, whatever the world size that wrote it."""
    shapes = tensor_shapes(path)
    wanted = shapes if keys is None else {k: shapes[k] for k in keys}
    out = {k: torch.empty(s, dtype=d) for k, (s, d) in wanted.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(out, storage_reader=SafeReader(str(path)), no_dist=True)
    return out


# --- manifest ------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_entries(d: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (d / n).stat().st_size, "sha256": _sha256(d / n)} for n in names}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("shardwise", "torch", "deepspeed", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def read_manifest(path: Path, verify_hashes: bool = True) -> dict[str, Any]:
    """The manifest of a published checkpoint, after checking every file it lists (size, and
    sha256 unless `verify_hashes` is off); ShardwiseError naming what is wrong otherwise."""
    mf = path / MANIFEST
    if not path.is_dir():
        raise ShardwiseError(f"{path}: checkpoint directory not found")
    if not mf.is_file():
        raise ShardwiseError(f"{path}: no {MANIFEST}: an incomplete checkpoint (a save that did not finish); "
                             "it is never loaded")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardwiseError(f"{mf}: not valid JSON ({e}); the checkpoint is not loaded") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ShardwiseError(f"{mf}: field 'format': expected {FORMAT!r}, got "
                             f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    for name, entry in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise ShardwiseError(f"{path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != entry["bytes"]:
            raise ShardwiseError(f"{path}: file {name} has {f.stat().st_size} bytes, the manifest says "
                                 f"{entry['bytes']}: the checkpoint is damaged")
        if verify_hashes and _sha256(f) != entry["sha256"]:
            raise ShardwiseError(f"{path}: file {name} does not match its sha256 in the manifest: "
                                 "the checkpoint is damaged")
    return manifest


def published(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every directory that looks published (a manifest is present), oldest first."""
    out = []
    for d in root.glob("step-*") if root.is_dir() else ():
        try:
            step = int(d.name.removeprefix("step-"))
        except ValueError:
            continue
        if d.is_dir() and (d / MANIFEST).is_file():
            out.append((step, d))
    return sorted(out)


def resolve_resume(spec: str | None, output_dir: str | Path, verify_hashes: bool = True) -> Path | None:
    """`latest` -> the newest checkpoint under output_dir whose manifest verifies (damaged ones
    are skipped with a message; None when there is none), or an explicit checkpoint dir
    (its manifest must verify; a run dir is accepted and means its latest)."""
    if spec is None:
        return None
    if spec != "latest":
        p = Path(spec)
        if p.is_dir() and not (p / MANIFEST).exists() and (checkpoints_dir(p).is_dir() or p.name == "checkpoints"):
            root = p if p.name == "checkpoints" else checkpoints_dir(p)
            return _newest_valid(root, verify_hashes, required=True)
        read_manifest(p, verify_hashes)
        return p
    return _newest_valid(checkpoints_dir(output_dir), verify_hashes, required=False)


def _newest_valid(root: Path, verify_hashes: bool, required: bool) -> Path | None:
    problems = []
    for _, d in reversed(published(root)):
        try:
            read_manifest(d, verify_hashes)
            return d
        except ShardwiseError as e:
            problems.append(str(e))
            print(f"shardwise: skipping checkpoint {d}: {e}")
    if required:
        raise ShardwiseError(f"{root}: no complete checkpoint" + (f" ({'; '.join(problems)})" if problems else ""))
    return None


def clean_stale(root: Path) -> list[str]:
    """Remove the `.tmp-*` directories of saves that never finished; return their names."""
    removed = []
    for d in sorted(root.glob(TMP_PREFIX + "*")) if root.is_dir() else ():
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


# --- RNG and per-rank state ------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every random stream a step can draw from, JSON-safe (no pickles in a checkpoint)."""
    import numpy as np

    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


@dataclass
class TrainerState:
    """What the loop needs to continue exactly where it stopped (JSON in the checkpoint)."""

    step: int  # optimizer steps completed
    samples_consumed: int  # global: step × global batch (the data position on any world size)
    global_batch: int
    engine: dict[str, Any] = field(default_factory=dict)  # Engine.checkpoint_state's extra (step count, scaler)
    train_time_s: float = 0.0


# --- save / load -----------------------------------------------------------------------------


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    engine: Any,
    state: TrainerState,
    output_dir: str | Path,
    *,
    config: dict[str, Any],
    strategy: str,
    keep_last: int,
) -> Path:
    """Write, verify and publish `checkpoints/step-N` (collective: every rank calls it)."""
    rank, world = _world()
    root = checkpoints_dir(output_dir)
    final = root / step_dir_name(state.step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that died before us
        tmp.mkdir()
    _barrier()
    tensors, extra = engine.checkpoint_state()
    state.engine = extra
    dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True))
    del tensors
    rank_file = f"rank-{rank:05d}.json"
    (tmp / rank_file).write_text(json.dumps({"rank": rank, "rng": rng_state()}))
    mine = [rank_file] + [p.name for p in tmp.glob(f"__{rank}_*.distcp")]
    entries = _file_entries(tmp, mine)
    gathered: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, entries)
    else:
        gathered = [entries]
    if rank == 0:
        (tmp / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))
        files: dict[str, Any] = {}
        for g in gathered:
            files.update(g)
        files.update(_file_entries(tmp, [".metadata", TRAINER_STATE]))
        manifest = {
            "format": FORMAT,
            "step": state.step,
            "world_size": world,
            "strategy": strategy,
            "created_unix": time.time(),
            "versions": versions(),
            "config": config,
            "files": files,
        }
        with open(tmp / MANIFEST, "w") as f:  # written last: its presence means complete
            f.write(json.dumps(manifest, indent=2))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # an abandoned timeline's checkpoint of the same step: replace it
            old = root / f"{TMP_PREFIX}replaced-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        for _, d in published(root)[:-keep_last]:
            shutil.rmtree(d, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(engine: Any, path: Path) -> TrainerState:
    """Load `path` into `engine` (collective) and this rank's RNG streams; return the loop's
    state. The manifest was verified by preflight; here its presence and sizes are checked
    again (cheap), since another run may have pruned the directory since."""
    read_manifest(path, verify_hashes=False)
    rank, _ = _world()
    state = TrainerState(**json.loads((path / TRAINER_STATE).read_text()))

    def read(tensors: dict[str, torch.Tensor]) -> None:
        dcp.load(tensors, storage_reader=SafeReader(str(path)))

    engine.load_checkpoint_state(read, state.engine)
    rank_file = path / f"rank-{rank:05d}.json"
    if rank_file.is_file():  # a new rank (resumed on more ranks) keeps its seeded streams
        set_rng_state(json.loads(rank_file.read_text())["rng"])
    return state
