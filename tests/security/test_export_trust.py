"""`shardwise export` takes what it trusts from the user and replaces only an earlier export.

- A LoRA checkpoint's manifest names its base model (`model.path`) and `model.trust_remote_code`.
  Whoever can write the checkpoint directory can write those: a manifest pointing at a directory
  whose config.json has an `auto_map` (its own Python file would write a marker when imported) and
  saying `trust_remote_code: true` is refused, naming the file, `auto_map` and `--trust-remote-code`;
  with that flag the user (not the file) opts in, and the code is let through.
- `--overwrite` replaces an earlier export: never the run being exported (`export RUN RUN`),
  its checkpoints (`export CKPT RUN/checkpoints`), a directory inside the checkpoint, or any
  directory holding what only a run writes. Each is refused with exit 2 and every file of the
  run is unchanged; a real earlier export is still replaced.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hostile_runs import cli, copy_run
from test_remote_code import model_with_auto_map

from shardwise.train.checkpoint.directory import step_dir_name


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _export(*args: str, cwd: Path):
    return cli(*args, cwd=cwd, module="shardwise.train.export.cli")


@pytest.mark.distributed
def test_a_manifest_cannot_opt_in_to_the_base_models_code(tmp_path, trained):
    run = copy_run(trained("zero3-lora"), tmp_path / "run")
    step = run / "checkpoints" / step_dir_name(4)
    marker = tmp_path / "MARKER"
    base = model_with_auto_map(tmp_path, marker)
    mf = json.loads((step / "manifest.json").read_text())
    assert mf["config"]["lora"] is not None
    mf["config"]["model"] = {"path": str(base), "random_init": True, "trust_remote_code": True}
    (step / "manifest.json").write_text(json.dumps(mf))  # the manifest hashes the other files, not itself

    r = _export(str(step), str(tmp_path / "adapter"), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert not marker.exists(), "the base model's code ran"
    message = " ".join(r.stderr.split())
    for fragment in (str(base / "config.json"), "auto_map", "pass --trust-remote-code to shardwise export"):
        assert fragment in message, message
    assert "Traceback" not in out and not (tmp_path / "adapter").exists()

    # the user's own opt-in lets it through (the code runs: that is what was asked)
    r = _export(str(step), str(tmp_path / "adapter"), "--trust-remote-code", cwd=tmp_path)
    assert marker.exists(), (r.stdout + r.stderr)[-3000:]


@pytest.fixture
def run(tmp_path, trained) -> Path:
    return copy_run(trained("fsdp-demo"), tmp_path / "run")


@pytest.mark.distributed
def test_overwrite_never_replaces_the_run_or_its_checkpoints(tmp_path, run):
    """The issue's two cases through the command itself, the rest through the same command
    in-process (typer's runner: the same code, without a second interpreter start each)."""
    from typer.testing import CliRunner

    from shardwise.train.export.cli import app

    step = run / "checkpoints" / step_dir_name(4)
    before = _snapshot(run)
    for checkpoint, out in ((run, run), (step, run / "checkpoints")):
        r = _export(str(checkpoint), str(out), "--overwrite", cwd=tmp_path)
        text = r.stdout + r.stderr
        assert r.returncode == 2, (checkpoint, out, text[-2000:])
        assert "overlaps the checkpoint" in " ".join(r.stderr.split()) and "Traceback" not in text, text[-2000:]
    other = copy_run(run, tmp_path / "other-run")  # a different run's directory as OUT
    other_before = _snapshot(other)
    cases = [(step, step, "overlaps the checkpoint"), (step, step / "inside", "overlaps the checkpoint"),
             (step, run / ".shardwise", "not an earlier export"), (step, other, "which a training run wrote"),
             (step, other / "checkpoints", "which a training run wrote")]
    for checkpoint, out, says in cases:
        r = CliRunner().invoke(app, [str(checkpoint), str(out), "--overwrite"])
        assert r.exit_code == 2, (checkpoint, out, r.output)
        assert says in " ".join(r.output.split()), (checkpoint, out, r.output)
    assert _snapshot(run) == before
    assert _snapshot(other) == other_before

    # an earlier export is what --overwrite is for
    earlier = tmp_path / "exported"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    (earlier / "stale.txt").write_text("from the earlier export")
    r = _export(str(run), str(earlier), "--overwrite", cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert (earlier / "model.safetensors").is_file() and not (earlier / "stale.txt").exists()
    assert _snapshot(run) == before


def test_export_on_a_full_disk_exits_74_and_leaves_out_as_it_was(tmp_path, monkeypatch):
    """`shardwise export` whose write finds the disk full: exit 74 (as the end-of-run export),
    the message naming OUT, no temp directory left, an earlier export at OUT untouched."""
    import errno

    import safetensors.torch
    import torch
    from typer.testing import CliRunner

    from shardwise.train.checkpoint.sharded import TrainerState, save_checkpoint
    from shardwise.train.export.cli import app

    class Stand:
        def checkpoint_state(self):
            return {"model.w": torch.ones(2, 2)}, {"optimizer_step": 1}

    config = {"model": {"name": "tiny-llama"}, "data": {"kind": "synthetic"}, "precision": "fp32",
              "run": {"device": "cpu", "steps": 1}}
    step = save_checkpoint(Stand(), TrainerState(step=1, samples_consumed=1, global_batch=1), tmp_path / "run",
                           config=config, strategy="ddp", keep_last=1)
    earlier = tmp_path / "exported"
    earlier.mkdir()
    (earlier / "config.json").write_text('{"earlier": true}')

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    r = CliRunner().invoke(app, [str(step), str(earlier), "--overwrite"])
    assert r.exit_code == 74, r.output
    assert "ran out of disk space" in " ".join(r.output.split()) and str(earlier) in " ".join(r.output.split())
    assert (earlier / "config.json").read_text() == '{"earlier": true}'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
