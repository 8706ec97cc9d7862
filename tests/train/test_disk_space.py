"""Disk space: preflight counts what a run really holds, and a save that finds the disk full
fails cleanly.

- preflight reserves keep_last + 1 checkpoints (a save publishes before it prunes) plus the
  export, less the checkpoints a resumed lineage already has on disk (free disk faked);
- a real ENOSPC: the output dir on a small tmpfs that fills up after the first checkpoint.
  The next save fails on every rank alike: exit 74, the previous checkpoint intact, no temp
  directory left, summary.json `failed` with the path, bytes needed and bytes free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.config.load import load_config
from shardwise.errors import ExitCode, ShardwiseError
from shardwise.run import run_spec
from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
from shardwise.train.checkpoint.sharded import read_manifest
from shardwise.train.outputs import checkpoint_bytes
from shardwise.train.preflight import check_output_space, output_bytes

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"


def _run(tmp_path: Path, *sets: str):
    cfg = load_config(CONFIG, [f"checkpointing.output_dir={tmp_path / 'out'}", *sets])
    return run_spec(cfg, 2, "cpu", environ={})


def test_preflight_reserves_keep_last_plus_one_checkpoints_and_the_export(tmp_path, disk_free):
    run = _run(tmp_path, "checkpointing.keep_last=3", "checkpointing.save_final=true")
    one = checkpoint_bytes(run.model.params)
    need, how = output_bytes(run)
    assert need == 4 * one + 4 * run.model.params  # keep_last 3 + the one being written, + the fp32 export
    assert "4 checkpoint(s)" in how and "keep_last 3 + the one being written" in how
    disk_free(need - 1)
    with pytest.raises(ShardwiseError, match=r"4 checkpoint\(s\) of .* \+ export .* lower checkpointing.keep_last"):
        check_output_space(run)
    disk_free(one + 4 * run.model.params)  # what preflight reserved before: passed, then failed at the 2nd save
    with pytest.raises(ShardwiseError, match="this run needs"):
        check_output_space(run)
    disk_free(need)
    check_output_space(run)
    # a resumed lineage that already holds 2 checkpoints adds at most 2 more before pruning
    assert output_bytes(run, existing_checkpoints=2)[0] == 2 * one + 4 * run.model.params


def test_a_final_export_without_a_last_checkpoint_reserves_the_staged_weights(tmp_path):
    """No checkpoint of the last step to stream the export from: the fp32 weights are staged for
    it (shardwise.train.export.final_weights), 4 bytes per parameter beside the export's own."""
    run = _run(tmp_path, "checkpointing.save_final=true", "checkpointing.save_every_minutes=null",
               "checkpointing.save_on_interrupt=false")
    need, how = output_bytes(run)
    assert need == 4 * run.model.params + 4 * run.model.params
    assert "0 checkpoint(s)" in how and "staged" in how
    saving = _run(tmp_path, "checkpointing.save_final=true", "checkpointing.save_every_steps=10",
                  "checkpointing.save_every_minutes=null")
    assert "staged" not in output_bytes(saving)[1]  # the last step's checkpoint is exported from


def test_a_lora_run_reserves_its_adapters_not_the_base(tmp_path):
    cfg = load_config(REPO / "examples" / "lora-demo.yaml", [f"checkpointing.output_dir={tmp_path}"])
    run = run_spec(cfg, 1, "cpu", environ={})
    need, _ = output_bytes(run)
    assert 0 < need < checkpoint_bytes(run.model.params)  # 3 adapter checkpoints < one full one


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs: real ENOSPC, whatever the host's disk (root only: mount(2))."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI and developer machines run as root)")
    d = tmp_path / "disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(disk: Path, leave: int) -> None:
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    try:
        with open(disk / "filler.bin", "wb") as f:
            f.write(b"\0" * max(0, free - leave))  # tmpfs allocates what is written
    except OSError:  # filled to the last page: what leave=0 asks for
        pass


@pytest.mark.distributed
def test_a_save_that_finds_the_disk_full_fails_cleanly(small_disk):
    out = small_disk / "run"
    sets = [f"checkpointing.output_dir={out}", "run.steps=40", "checkpointing.save_every_steps=20",
            "checkpointing.keep_last=2", "logging.progress=false", "run.timeout_s=60",
            "checkpointing.save_every_minutes=null"]
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--nproc", "2"]
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = checkpoints_dir(out) / step_dir_name(20)
    deadline = time.monotonic() + 180
    while not (first / "manifest.json").is_file():
        assert p.poll() is None, p.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no first checkpoint in 180 s"
        time.sleep(0.01)
    _fill(small_disk, leave=256 << 10)  # room for logs and the summary, not for a 2.7 MB checkpoint
    log, _ = p.communicate(timeout=180)
    assert p.returncode == ExitCode.NO_SPACE, log[-3000:]
    assert "ran out of disk space" in log and "Traceback" not in log, log[-3000:]
    read_manifest(first)  # the previous checkpoint is intact: every file and hash verifies
    assert [d.name for d in checkpoints_dir(out).iterdir()] == [first.name]  # no half-written step-40, no temp dir
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "ran out of disk space" in summary["reason"]
    assert summary["space"]["path"].endswith(step_dir_name(40))
    assert summary["space"]["need_bytes"] > summary["space"]["free_bytes"]
    # the bytes needed are the checkpoint's, each tensor counted once (not once per rank holding it)
    written = sum(f.stat().st_size for f in first.glob("*.distcp"))
    assert 0.9 * written <= summary["space"]["need_bytes"] <= written, (summary["space"], written)
    assert not list(out.glob("summary.json*tmp*")) and not list(out.glob(".tmp-*"))


def test_a_summary_that_cannot_be_written_is_said_not_raised(small_disk, capsys):
    """A full disk at the very end must not turn the run's exit code into a traceback's."""
    from shardwise.train.observe.metrics import read_summary, write_summary

    out = small_disk / "run"
    assert write_summary(out, {"status": "running"}) is not None
    _fill(small_disk, leave=0)
    assert write_summary(out, {"status": "failed", "reason": "x" * (1 << 20)}) is None
    assert "could not write" in capsys.readouterr().err
    assert read_summary(out) == {"status": "running"}  # the earlier one, whole
    assert not list(out.glob(".tmp-*"))
