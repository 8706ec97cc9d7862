"""`plan --emit` into a directory that already holds things: it never writes
through a symlink already there, and an emit removes the files of an earlier emit that it does
not write again (a `ds_config.json` beside a new FSDP plan), nothing else; what it cannot tell
apart (an edited earlier file, stale emit files without a record) is refused before anything is
written."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardwise.catalog import build_hardware, get_model
from shardwise.emit import emit_configs
from shardwise.emit.safe_write import EMIT_MANIFEST
from shardwise.errors import ShardwiseError
from shardwise.specs import Strategy, TrainSpec

MODEL = get_model("llama-2-7b")
HW = build_hardware(gpus=8)
TRAIN = TrainSpec(seq_len=2048, micro_batch=2, grad_accum=4, checkpointing="full")
DS_ONLY = {"ds_config.json", "ds_config_hf.json", "launch_deepspeed.sh"}


def emit(strategy: str, out: Path) -> set[str]:
    return {p.name for p in emit_configs(MODEL, HW, TRAIN, Strategy.from_name(strategy), out)}


def listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_symlinks_in_the_target_are_replaced_never_followed(tmp_path):
    out, outside = tmp_path / "emit", tmp_path / "outside"
    out.mkdir(), outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    (out / "README.md").symlink_to(victim)
    (out / "shardwise.yaml").symlink_to(outside / "created-through-a-dangling-link")
    (out / "launch_torchrun.sh").symlink_to(outside)  # a link to a directory
    names = emit("fsdp", out)
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    for name in ("README.md", "shardwise.yaml", "launch_torchrun.sh"):
        p = out / name
        assert not p.is_symlink() and p.is_file(), name
    assert "# shardwise train config for fsdp" in (out / "shardwise.yaml").read_text()
    assert "GiB" in (out / "README.md").read_text()
    assert listing(out) == names | {EMIT_MANIFEST}  # no temp directory left behind


def test_emitted_files_have_the_umask_modes(tmp_path):
    out = tmp_path / "emit"
    old = os.umask(0o022)
    try:
        names = emit("zero3", out)
    finally:
        os.umask(old)
    for name in names:
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == (0o755 if name.endswith((".sh", ".sbatch")) else 0o644), (name, oct(mode))


def test_a_new_emit_removes_the_earlier_emits_files_and_nothing_else(tmp_path):
    out = tmp_path / "emit"
    first = emit("zero3", out)
    assert DS_ONLY <= first
    (out / "notes.txt").write_text("mine")  # a user's file beside the emitted ones
    second = emit("fsdp", out)
    assert not DS_ONLY & second
    assert listing(out) == second | {EMIT_MANIFEST, "notes.txt"}  # ds_config*.json and launch_deepspeed.sh gone
    assert (out / "notes.txt").read_text() == "mine"
    record = json.loads((out / EMIT_MANIFEST).read_text())
    assert set(record["files"]) == second
    # and back: the DeepSpeed files return, nothing of the FSDP emit is left that zero3 does not write
    assert listing(out) - {EMIT_MANIFEST, "notes.txt"} == second
    third = emit("zero3", out)
    assert listing(out) == third | {EMIT_MANIFEST, "notes.txt"} and third == first


def test_an_edited_earlier_file_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "emit"
    emit("zero3", out)
    (out / "ds_config.json").write_text('{"edited": true}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ShardwiseError, match=r"--emit .*ds_config.json was written by an earlier `plan --emit` "
                                             r"and changed since"):
        emit("fsdp", out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched, no temp dir


def test_stale_emit_files_without_a_record_are_refused(tmp_path):
    """A directory emitted by an older shardwise (no manifest) or a user's own ds_config.json:
    left beside an FSDP plan it would be taken for part of it."""
    out = tmp_path / "emit"
    out.mkdir()
    (out / "ds_config.json").write_text("{}\n")
    with pytest.raises(ShardwiseError, match=r"holds ds_config.json, which this plan does not use and no earlier"):
        emit("fsdp", out)
    assert listing(out) == {"ds_config.json"}
    assert DS_ONLY <= emit("zero2", out)  # a DeepSpeed plan writes it anew, as before


def test_a_manifest_cannot_make_an_emit_remove_anything_else(tmp_path):
    out, outside = tmp_path / "emit", tmp_path / "outside"
    out.mkdir(), outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    inside = out / "keep.txt"
    inside.write_text("mine")
    (out / "link.txt").symlink_to(victim)
    digest = __import__("hashlib").sha256(b"precious").hexdigest()
    entries = {"../outside/victim.txt": digest, str(victim): digest, "link.txt": digest,
               "keep.txt": "0" * 64}  # fmt: skip
    (out / EMIT_MANIFEST).write_text(json.dumps({"format": "shardwise-emit/1", "files": entries}))
    with pytest.raises(ShardwiseError, match=r"link.txt, keep.txt was written by an earlier"):
        emit("fsdp", out)  # a symlink and a file that does not match are not removed: refused
    del entries["link.txt"], entries["keep.txt"]
    (out / EMIT_MANIFEST).write_text(json.dumps({"format": "shardwise-emit/1", "files": entries}))
    emit("fsdp", out)
    assert victim.read_text() == "precious" and inside.read_text() == "mine" and (out / "link.txt").is_symlink()


def test_plan_emit_cli_for_another_strategy_leaves_no_ds_config(tmp_path):
    """The issue's reproduction: `plan --emit DIR` for ZeRO-2, then for DDP into the same DIR."""
    from shardwise.cli.app import app

    out = tmp_path / "emit"
    for strategy in ("zero2", "ddp"):
        r = CliRunner().invoke(app, ["plan", "-m", "tiny-llama", "--gpus", "1", "--emit", str(out),
                                     "--emit-strategy", strategy])  # fmt: skip
        assert r.exit_code == 0, r.output
        if strategy == "zero2":
            assert (out / "ds_config.json").is_file()
    assert not any((out / n).exists() for n in DS_ONLY), listing(out)
    assert "ddp" in (out / "shardwise.yaml").read_text()
