"""A checkpoint index made only of allowed classes cannot run code through DCP's byte path.

The attack, as a hostile checkpoint author builds it: one optimizer-state entry of `.metadata`
becomes a `BytesStorageMetadata` (an admitted class) whose storage record points at a new file,
`evil.pt`, written by `torch.save` of an object whose `__reduce__` calls `os.system`; the
manifest's size and sha256 of `.metadata` are refreshed. DCP's default load planner reads such an
entry with `torch.load(weights_only=False)`: `test_the_crafted_checkpoint_runs_code_under_stock_dcp`
shows the payload is live. shardwise refuses it by name before loading (the index check) and
again in the load (the planner's byte path), and refuses storage records that read outside the
checkpoint's own files. End to end: `shardwise train --resume latest` (fsdp, the demo, 2 ranks),
`shardwise export`, and a LoRA run under ZeRO-3 with a quiet payload (one that returns a tensor
of the right shape after running its command) all exit 2 naming the key, with no marker written,
no rank started and the checkpoint left as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hostile_runs import REPO, copy_run
from hostile_runs import cli as _cli
from hostile_runs import train_args as _train_args
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint import index as checkpoint_index
from shardwise.train.checkpoint.directory import step_dir_name
from shardwise.train.checkpoint.index import SafeReader, UnsafeCheckpointError, load_tensors, read_index
from shardwise.train.checkpoint.sharded import (
    TrainerState,
    read_manifest,
    read_tensors,
    save_checkpoint,
    tensor_shapes,
)


class _Shell:
    """Runs `cmd` when unpickled; with `shape`, then hands back a tensor of that shape (the quiet
    payload: nothing looks wrong until the optimizer step)."""

    def __init__(self, cmd: str, shape: tuple[int, ...] | None = None):
        self.cmd, self.shape = cmd, shape

    def __reduce__(self):
        if self.shape is None:
            return os.system, (self.cmd,)
        return eval, (f"(__import__('os').system({self.cmd!r}), __import__('torch').zeros({self.shape!r}))[1]",)


def _marker_cmd(marker: Path) -> str:
    return f"echo $$ >> {marker}"  # one line per process that ran it


def craft_bytes_entry(step: Path, key: str, marker: Path, *, quiet: bool = False) -> None:
    """The issue's attack on a published checkpoint directory, exactly as described."""
    meta = pickle.loads((step / ".metadata").read_bytes())  # the author's own tools: plain pickle
    shape = tuple(meta.state_dict_metadata[key].size)
    torch.save(_Shell(_marker_cmd(marker), shape if quiet else None), step / "evil.pt")
    meta.state_dict_metadata[key] = BytesStorageMetadata()
    for idx in [i for i in meta.storage_data if i.fqn == key]:
        del meta.storage_data[idx]
    meta.storage_data[MetadataIndex(key)] = _StorageInfo("evil.pt", 0, (step / "evil.pt").stat().st_size)
    _replace_index(step, pickle.dumps(meta))


def _replace_index(step: Path, data: bytes) -> None:
    (step / ".metadata").write_bytes(data)
    mf = json.loads((step / "manifest.json").read_text())
    mf["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(mf))


class _Stand:
    def checkpoint_state(self):
        return {"model.w": torch.ones(3, 4), "optim.exp_avg.w": torch.zeros(3, 4),
                "model.b": torch.arange(5.0)}, {"optimizer_step": 1}


@pytest.fixture
def step(tmp_path) -> Path:
    return save_checkpoint(_Stand(), TrainerState(step=1, samples_consumed=1, global_batch=1), tmp_path / "run",
                           config={}, strategy="ddp", keep_last=2)


def _stock_load(step: Path, key: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({key: torch.empty(3, 4)}, storage_reader=FileSystemReader(str(step)), no_dist=True)


@pytest.mark.parametrize("quiet", [False, True], ids=["loud", "quiet"])
def test_the_crafted_checkpoint_runs_code_under_stock_dcp(tmp_path, step, quiet):
    """The attack is real: DCP's own reader and planner run the payload (so the refusals below
    test something). The stock FileSystemReader is used on purpose here and nowhere in shardwise."""
    marker = tmp_path / "PWNED"
    craft_bytes_entry(step, "optim.exp_avg.w", marker, quiet=quiet)
    try:
        _stock_load(step, "optim.exp_avg.w")
    except Exception:  # the loud payload returns os.system's int where a tensor was expected
        pass
    assert marker.is_file() and marker.read_text().strip(), "stock DCP did not run the crafted entry"


@pytest.mark.parametrize("quiet", [False, True], ids=["loud", "quiet"])
def test_every_reader_refuses_the_bytes_entry_by_key(tmp_path, step, quiet):
    marker = tmp_path / "PWNED"
    craft_bytes_entry(step, "optim.exp_avg.w", marker, quiet=quiet)
    readers = {
        "read_index": lambda: read_index(step),
        "read_manifest": lambda: read_manifest(step),
        "tensor_shapes": lambda: tensor_shapes(step),
        "read_tensors": lambda: read_tensors(step),
        "read_tensors(key)": lambda: read_tensors(step, ["optim.exp_avg.w"]),
        "load_tensors": lambda: load_tensors({"optim.exp_avg.w": torch.empty(3, 4)}, SafeReader(str(step)),
                                             no_dist=True),
    }
    for name, read in readers.items():
        with pytest.raises(UnsafeCheckpointError, match=r"entry 'optim\.exp_avg\.w' is a BytesStorageMetadata") as e:
            read()
        assert str(step / ".metadata") in str(e.value), name
    assert not marker.exists()
    assert (step / "evil.pt").is_file() and (step / "__0_0.distcp").is_file()  # refused, nothing removed


def test_the_load_planner_refuses_bytes_even_past_the_index_check(tmp_path, step, monkeypatch):
    """The second line: with the index check switched off, the load itself refuses the byte
    entry instead of unpickling it."""
    marker = tmp_path / "PWNED"
    craft_bytes_entry(step, "optim.exp_avg.w", marker)
    monkeypatch.setattr(checkpoint_index, "check_index", lambda meta, path: None)
    with pytest.raises(Exception, match=r"'optim\.exp_avg\.w' is bytes, not a tensor"):
        load_tensors({"optim.exp_avg.w": torch.empty(3, 4)}, SafeReader(str(step)), no_dist=True)
    assert not marker.exists()


def _point(step: Path, key: str, **info) -> None:
    meta = pickle.loads((step / ".metadata").read_bytes())
    for idx, old in list(meta.storage_data.items()):
        if idx.fqn == key:
            meta.storage_data[idx] = _StorageInfo(**{**old.__dict__, **info})
    _replace_index(step, pickle.dumps(meta))


@pytest.mark.parametrize("info, says", [
    ({"relative_path": "../outside.distcp"}, "outside the checkpoint's own files"),
    ({"relative_path": "/etc/hostname"}, "outside the checkpoint's own files"),
    ({"relative_path": ".."}, "outside the checkpoint's own files"),
    ({"relative_path": "sub\\x.distcp"}, "outside the checkpoint's own files"),
    ({"relative_path": "link.distcp"}, "not a regular file"),
    ({"relative_path": "missing.distcp"}, "not a regular file"),
    ({"offset": 10**12}, "which has"),
    ({"length": -1}, "which has"),
    ({"offset": 1.5}, "which has"),
    ({"transform_descriptors": ["zstd"]}, "stream transforms"),
], ids=["dotdot", "absolute", "parent", "backslash", "symlink", "missing", "offset", "length", "float", "transform"])
def test_storage_records_that_read_elsewhere_are_refused(tmp_path, step, info, says):
    outside = tmp_path / "outside.distcp"
    shutil.copy(step / "__0_0.distcp", outside)
    os.symlink(outside, step / "link.distcp")
    _point(step, "model.w", **info)
    with pytest.raises(UnsafeCheckpointError, match=says) as e:
        read_tensors(step)
    assert "'model.w'" in str(e.value) and str(step / ".metadata") in str(e.value)


def test_an_index_that_is_not_a_regular_file_or_too_big_is_refused(tmp_path, step, monkeypatch):
    real = step / ".metadata"
    data = real.read_bytes()
    monkeypatch.setattr(checkpoint_index, "_MAX_INDEX_BYTES", len(data) - 1)
    with pytest.raises(UnsafeCheckpointError, match="over the"):
        read_index(step)
    monkeypatch.undo()
    real.unlink()
    os.symlink("/dev/zero", real)  # would be read forever
    with pytest.raises(UnsafeCheckpointError, match="not a regular file"):
        read_index(step)


def test_no_dcp_or_torch_load_outside_the_guard():
    """Every DCP load in src/ is the guard's; every torch.load passes weights_only=True."""
    import ast

    for path in (REPO / "src" / "shardwise").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"):
                continue
            owner = ast.unparse(node.func.value)
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if owner in ("dcp", "torch.distributed.checkpoint", "checkpoint"):
                assert path.parent.name == "checkpoint" and path.name == "index.py", f"{where}: DCP load outside checkpoint.index.load_tensors"
            if owner == "torch":
                kw = {k.arg: k.value for k in node.keywords}
                assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, \
                    f"{where}: torch.load without weights_only=True"


# --- end to end, through the user's commands ---------------------------------------------------


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.mark.distributed
def test_crafted_bytes_entry_is_refused_by_resume_and_export_fsdp_demo(tmp_path, trained):
    """The issue's reproduction on the demo's own checkpoint (fsdp, 2 ranks)."""
    out = copy_run(trained("fsdp-demo"), tmp_path / "run")
    step = out / "checkpoints" / step_dir_name(4)
    key = next(k for k in tensor_shapes(step) if k.startswith("optim."))
    marker = tmp_path / "PWNED"
    craft_bytes_entry(step, key, marker)
    before = _snapshot(out / "checkpoints")
    heartbeats = sorted((out / ".shardwise").rglob("rank-*.json"))
    stamps = [p.stat().st_mtime_ns for p in heartbeats]

    t = _cli(*_train_args(REPO / "examples" / "demo.yaml", out), "--resume", "latest", cwd=tmp_path)
    text = t.stdout + t.stderr
    assert t.returncode == 2, text[-3000:]
    assert text.count(f"entry {key!r} is a BytesStorageMetadata") == 1, text[-3000:]  # once, before any rank
    assert "Traceback" not in text, text[-3000:]

    e = _cli(str(step), str(tmp_path / "exported"), cwd=tmp_path, module="shardwise.train.export.cli")
    assert e.returncode == 2, e.stdout + e.stderr
    assert f"entry {key!r} is a BytesStorageMetadata" in e.stderr and "Traceback" not in e.stderr, e.stderr
    assert not (tmp_path / "exported").exists()

    assert not marker.exists(), marker.read_text()
    assert [p.stat().st_mtime_ns for p in heartbeats] == stamps  # no rank started
    assert _snapshot(out / "checkpoints") == before  # nothing saved was lost or rewritten


@pytest.mark.distributed
def test_quiet_payload_in_a_zero3_lora_checkpoint_is_refused(tmp_path, trained):
    """A LoRA run under ZeRO-3, its adapter's optimizer state replaced by a payload that returns
    a tensor of the right shape after running its command."""
    out = copy_run(trained("zero3-lora"), tmp_path / "run")
    step = out / "checkpoints" / step_dir_name(4)
    key = next(k for k in tensor_shapes(step) if k.startswith("optim.") and "lora" in k)
    marker = tmp_path / "PWNED"
    craft_bytes_entry(step, key, marker, quiet=True)
    before = _snapshot(out / "checkpoints")
    t = _cli(*_train_args(REPO / "examples" / "lora-demo.yaml", out, "lora.save_merged=false"),
             "--resume", "latest", cwd=tmp_path)
    text = t.stdout + t.stderr
    assert t.returncode == 2, text[-3000:]
    assert f"entry {key!r} is a BytesStorageMetadata" in text and "Traceback" not in text, text[-3000:]
    e = _cli(str(out), str(tmp_path / "adapter"), cwd=tmp_path, module="shardwise.train.export.cli")
    assert e.returncode == 2 and f"entry {key!r}" in e.stderr, e.stdout + e.stderr
    assert not marker.exists(), marker.read_text()
    assert _snapshot(out / "checkpoints") == before


@pytest.mark.parametrize("key, info", [("model.b", {"offset": 0}), ("model.w", {"length": 10})],
                         ids=["another-tensors-bytes", "cut-short"])
def test_records_within_the_files_but_not_the_tensor_are_refused_as_damaged(step, key, info):
    """Found by the index fuzz: a record inside the file's bounds whose bytes are not the tensor
    the index describes (another tensor's, or cut short) was a CheckpointException traceback."""
    _point(step, key, **info)
    with pytest.raises(ShardwiseError, match="cannot be read as the index describes them") as e:
        read_tensors(step)
    assert str(step) in str(e.value)
