"""Sharded training checkpoints that any engine and any world size can resume.

One format for every engine: a `torch.distributed.checkpoint` (DCP) directory holding the
*canonical* training state, keyed by parameter name, never by engine or rank:

- `model.<fqn>`: the master weights (what the optimizer updates): fp32, bf16 under bf16-pure;
- `optim.exp_avg.<fqn>`, `optim.exp_avg_sq.<fqn>`: AdamW's moments, same shape and dtype (a
  low-bit optimizer's quantized moments as plain codes and scales instead:
  `optim.exp_avg_codes.<fqn>`, `optim.exp_avg_scale.<fqn>`, ...; shardwise.train.engines.low_bit).

A checkpoint of one dtype resumes a run of the other: DCP casts each tensor into the engine's
as it loads (shardwise.train.checkpoint.resume_checks.precision_note says what that does).

Each engine maps its own layout onto these names (`Engine.checkpoint_state`): FSDP2 hands
over its DTensor shards, DDP its replicated tensors (DCP writes one copy), DeepSpeed ZeRO
the full tensors assembled from its flat partitions (each rank keeps a size-balanced share, so
the writes spread over ranks). DCP reshards on load, so a checkpoint written by 2 FSDP2
ranks loads into 1 ZeRO-3 rank and the other way round. Everything that is not a tensor
(step, data position, optimizer step count, loss scaler, RNG streams) is JSON beside it.

Publishing is atomic: all ranks write into `checkpoints/.tmp-step-N/`; rank 0 then hashes
every file (each rank hashes its own shards), writes `manifest.json` last (files, sizes,
sha256, config, world size, strategy, run id and lineage, versions) and renames the directory
to `step-N`; `keep_last` then prunes that run's lineage only (shardwise.train.checkpoint.lineage). A
directory without a complete, matching manifest is never loaded; a save killed half-way leaves
only a `.tmp-*` directory (with shardwise's marker), removed and named when the next run starts.
A save refuses a non-finite state, and any rank's failure is every rank's (out of space: exit 74).

The reading side: `read_manifest` verifies a published checkpoint against its manifest (sizes,
sha256, the trainer state and every rank's RNG file), and `resolve_resume` turns
`checkpointing.resume` into one that verifies (`latest`: the newest of this run's lineage,
damaged ones skipped and named). DCP keeps its own index (`.metadata`) as a pickle; it is read
through an exact allow-list (shardwise.train.checkpoint.index), also by `read_manifest`, so
preflight and export refuse a crafted index before anything loads it, and every load goes
through its `load_tensors` (tensors only: an index entry of bytes, which DCP would unpickle, is
refused by name; the tensor files are read with `torch.load(weights_only=True)` by DCP itself).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
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
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from shardwise import strict_json
from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint.directory import (
    _ANY,
    FORMAT,
    MANIFEST,
    RANK_FILE,
    TRAINER_STATE,
    checkpoints_dir,
    incomplete,
    published,
    read_manifest_json,
    read_rank_rng,
    read_trainer_state,
    step_dir_name,
)
from shardwise.train.checkpoint.index import SafeReader, UnsafeCheckpointError, load_tensors, read_index
from shardwise.train.checkpoint.lineage import read_lineage
from shardwise.train.checkpoint.save_failure import (
    describe,
    free_bytes,
    gather,
    raise_save_failure,
    space_errno,
)
from shardwise.train.outputs import (
    TMP_PREFIX,
    TMP_SUFFIX,
    fresh_own_tmp_dir,
    publish_own_tmp_dir,
)

Reader = Callable[[dict[str, torch.Tensor]], None]
_HASH_CHUNK = 1 << 22


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
        load_tensors(out, SafeReader(str(path)), no_dist=True)
    return out


def nonfinite_tensors(tensors: dict[str, Any]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or Inf (DTensors: this rank's shard)."""
    bad = []
    for name, t in tensors.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
            if not bool(torch.isfinite(local).all()):
                bad.append(name)
    return bad


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
    # consecutive skipped non-finite steps up to `step` (a stop right after one saves the state the
    # skip left, which is the last finite step's): a resumed run goes on counting from here
    nonfinite_streak: int = 0


# --- the manifest: file entries, verification, `--resume` resolved ---------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _file_entries(d: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: {"bytes": (d / n).stat().st_size, "sha256": _sha256(d / n)} for n in names}


def versions() -> dict[str, str]:
    """What the manifest records (shardwise.versions.run_versions)."""
    from shardwise.versions import run_versions

    return run_versions()


def read_manifest(path: Path, verify_hashes: bool = True) -> dict[str, Any]:
    """The manifest of a published checkpoint, after checking every file it lists (size, and
    sha256 unless `verify_hashes` is off) and reading DCP's index through the restricted
    unpickler (a crafted index raises UnsafeCheckpointError: the manifest is no signature, whoever
    can write the directory can refresh its hashes), then the trainer state and every rank's
    random streams checked field by field; ShardwiseError naming what is wrong otherwise."""
    manifest = read_manifest_json(path)
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
    read_index(path)
    if TRAINER_STATE not in manifest["files"]:
        raise ShardwiseError(f"{path}: the manifest lists no {TRAINER_STATE}: not a complete checkpoint")
    read_trainer_state(path)
    for name in manifest["files"]:
        if RANK_FILE.fullmatch(name):
            read_rank_rng(path, name)
    return manifest


def resolve_resume(spec: str | None, output_dir: str | Path, verify_hashes: bool = True) -> Path | None:
    """`latest` -> the newest valid checkpoint of the output dir's current lineage (damaged
    ones are skipped and named), the branch's parent when the lineage has saved nothing yet, or
    None when the directory holds no checkpoint at all; if it holds some and none is valid, a
    ShardwiseError naming each. An explicit checkpoint dir must verify; a run dir (or its
    `checkpoints/`) means its latest. A crafted index is refused, never skipped."""
    if spec is None:
        return None
    if spec != "latest":
        p = Path(spec)
        if p.is_dir() and not (p / MANIFEST).exists() and (checkpoints_dir(p).is_dir() or p.name == "checkpoints"):
            root = p if p.name == "checkpoints" else checkpoints_dir(p)
            lin = read_lineage(root.parent)
            found = _newest_valid(root, verify_hashes, lin.lineage if lin else _ANY)
            if found is None:
                raise ShardwiseError(f"{root}: no complete checkpoint")
            return found
        read_manifest(p, verify_hashes)
        return p
    root = checkpoints_dir(output_dir)
    lin = read_lineage(output_dir)
    found = _newest_valid(root, verify_hashes, lin.lineage if lin else _ANY)
    if found is None and lin is not None and lin.parent is not None:
        parent = Path(lin.parent)
        print(f"shardwise: --resume latest: the branch started from {parent} has saved no checkpoint yet; "
              "resuming its parent")
        read_manifest(parent, verify_hashes)
        return parent
    if found is None and (published(root) or incomplete(root)):
        names = ", ".join(d.name for d in [*incomplete(root), *(d for _, d in published(root))])
        raise ShardwiseError(
            f"{root}: --resume latest: no valid checkpoint of this run's lineage among {names} (each is named "
            "above with what is wrong); nothing was started. Pass one explicitly with --resume PATH, or start "
            "over with --overwrite.")
    return found


def _newest_valid(root: Path, verify_hashes: bool, lineage: Any) -> Path | None:
    for d in incomplete(root):
        print(f"shardwise: skipping {d}: no {MANIFEST} (an incomplete or foreign directory); never loaded")
    for _, d in reversed(published(root, lineage)):
        try:
            read_manifest(d, verify_hashes)
            return d
        except UnsafeCheckpointError:
            raise
        except ShardwiseError as e:
            print(f"shardwise: skipping checkpoint {d}: {e}")
    return None


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
    lineage: Any = None,
    protect: int | None = None,
) -> Path:
    """Write, verify and publish `checkpoints/step-N` (collective: every rank calls it).

    Refused (NonFiniteError, nothing written) when any rank's state holds a NaN/Inf. Every
    failure is agreed on by all ranks, so none is left waiting in a collective: the temp
    directory is removed, the previous checkpoints are untouched, and all ranks raise the same
    error (OutOfSpaceError, with the bytes needed and free, when the disk or quota is full).
    `lineage` (shardwise.train.checkpoint.lineage.Lineage) goes into the manifest, and `keep_last` prunes
    only that lineage's checkpoints; the checkpoint of step `protect` (the best evaluation's,
    `checkpointing.save_best`) is kept besides them."""
    from shardwise.errors import NonFiniteError
    rank, world = _world()
    root = checkpoints_dir(output_dir)
    final = root / step_dir_name(state.step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    tensors, extra = engine.checkpoint_state()
    # what each rank holds: its non-finite tensors, and every tensor's full size (a DTensor's
    # numel is the global one; DCP writes a replicated tensor once), merged over ranks below
    sizes = {k: int(t.numel()) * t.element_size() for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    votes = gather((nonfinite_tensors(tensors), sizes))
    bad = [(r, names) for r, (names, _) in enumerate(votes) if names]
    if bad:
        r, names = bad[0]
        raise NonFiniteError(f"step {state.step}: the training state is not finite ({len(names)} tensors on rank "
                             f"{r}, e.g. {names[0]}); no checkpoint was written")
    need = sum({k: n for _, held in votes for k, n in held.items()}.values())
    state.engine = extra
    failure = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            fresh_own_tmp_dir(tmp)  # a save of this step that died before us left it
        except OSError as e:
            failure = describe(e)
    failures = gather(failure)
    gathered: list[Any] = []
    if not any(failures):
        entries: dict[str, Any] = {}
        try:
            dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True),
                     no_dist=not dist.is_initialized())
            del tensors
            rank_file = f"rank-{rank:05d}.json"
            (tmp / rank_file).write_text(strict_json.dumps({"rank": rank, "rng": rng_state()}))
            mine = [rank_file] + [p.name for p in tmp.glob(f"__{rank}_*.distcp")]
            entries = _file_entries(tmp, mine)
        except (Exception, CheckpointException) as e:  # DCP's (a BaseException) is raised on every rank alike
            failure = describe(e)
            if space_errno([], e):
                failure["errno"] = errno.ENOSPC  # wherever DCP wrapped it
        outcomes = gather((failure, entries))
        failures, gathered = [f for f, _ in outcomes], [e for _, e in outcomes]
    if rank == 0 and not any(failures):
        try:
            _publish(tmp, final, root, state, gathered=gathered, config=config, strategy=strategy, world=world,
                     lineage=lineage, keep_last=keep_last, publish=publish_own_tmp_dir, protect=protect)
        except OSError as e:
            failure = describe(e)
    failures = gather(failure)
    if any(failures):
        free = gather(free_bytes(root) if rank == 0 else 0)[0]  # at the failure, before the clean-up
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise_save_failure(failures, final, need, free)
    _barrier()
    return final


def _publish(tmp: Path, final: Path, root: Path, state: TrainerState, *, gathered: list[Any], config: dict[str, Any],
             strategy: str, world: int, lineage: Any, keep_last: int, publish: Callable[[Path, Path], None],
             protect: int | None = None) -> None:
    """Rank 0: trainer state and manifest (last, fsynced), the atomic rename, then pruning."""
    (tmp / TRAINER_STATE).write_text(strict_json.dumps(asdict(state), indent=2))
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
        **(lineage.manifest_fields() if lineage is not None else {}),
        "versions": versions(),
        "config": config,
        "files": files,
    }
    with open(tmp / MANIFEST, "w") as f:  # written last: its presence means complete
        f.write(strict_json.dumps(manifest, indent=2))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # an abandoned timeline's checkpoint of the same step: replace it
        old = root / f"{TMP_PREFIX}replaced-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        publish(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        publish(tmp, final)
    _fsync_dir(root)
    for step, d in published(root, lineage.lineage if lineage is not None else None)[:-keep_last]:
        if step != protect:
            shutil.rmtree(d, ignore_errors=True)


BEST = "best.json"


def write_best(output_dir: str | Path, step: int, eval_loss: float, lineage: Any = None) -> Path:
    """`checkpoints/best.json` (rank 0, atomic): the step whose checkpoint had the lowest eval
    loss so far (`checkpointing.save_best: eval_loss`); pruning keeps that checkpoint."""
    root = checkpoints_dir(output_dir)
    record = {"metric": "eval_loss", "step": step, "eval_loss": eval_loss, "checkpoint": step_dir_name(step),
              "lineage": lineage.lineage if lineage is not None else None}
    tmp = root / f"{TMP_PREFIX}{BEST}-{os.getpid()}{TMP_SUFFIX}"  # start-up clean-up removes a stray one
    tmp.write_text(strict_json.dumps(record, indent=2) + "\n")
    os.replace(tmp, root / BEST)
    return root / BEST


def read_best(output_dir: str | Path, lineage: Any = _ANY) -> dict[str, Any] | None:
    """The best.json record, when its checkpoint is still published (and, with `lineage`, of that
    lineage); None otherwise."""
    from shardwise.config.file import read_json_object

    root = checkpoints_dir(output_dir)
    if not (root / BEST).exists():
        return None
    try:
        record = read_json_object(root / BEST, 1 << 20, "best-checkpoint record")
        step = int(record["step"])
        float(record["eval_loss"])
    except (ShardwiseError, ValueError, KeyError, TypeError):
        return None
    if lineage is not _ANY and record.get("lineage") != lineage:
        return None
    return record if any(s == step for s, _ in published(root)) else None


class CheckpointReader:
    """What an engine's `load_checkpoint_state` reads with: called with a dict of tensors, it
    fills them in place from the checkpoint (DCP reshards each key into this rank's tensors);
    `saved` is every tensor the checkpoint holds (key -> global shape and dtype, from its index),
    for an engine whose keys depend on what was saved (low-bit optimizer states)."""

    def __init__(self, path: Path):
        self.path = path
        self.saved = tensor_shapes(path)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> None:
        load_tensors(tensors, SafeReader(str(self.path)))


def load_checkpoint(engine: Any, path: Path) -> TrainerState:
    """Load `path` into `engine` (collective) and this rank's RNG streams; return the loop's
    state. The manifest was verified by preflight; here its presence and sizes are checked
    again (cheap), since another run may have pruned the directory since."""
    read_manifest(path, verify_hashes=False)
    rank, _ = _world()
    state = TrainerState(**read_trainer_state(path))
    engine.load_checkpoint_state(CheckpointReader(path), state.engine)
    rank_file = f"rank-{rank:05d}.json"
    if (path / rank_file).is_file():  # a new rank (resumed on more ranks) keeps its seeded streams
        set_rng_state(read_rank_rng(path, rank_file))
    return state
