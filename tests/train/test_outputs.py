"""The output directory is checked before compute, owned by one run, and only ever holds
complete files (issue: runs that survive, item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.errors import ExitCode, ShardwiseError
from shardwise.train.outputs import OutputLock, atomic_dir, check_output_dir

REPO = Path(__file__).parent.parent.parent
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"


def train(out: Path, *sets: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--nproc", "1"]
    for s in (f"checkpointing.output_dir={out}", "run.steps=2", "logging.progress=false",
              "logging.trackers=[]", *sets):  # fmt: skip
        argv += ["--set", s]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "out"
    f.write_text("not a directory")
    with pytest.raises(ShardwiseError, match=r"checkpointing.output_dir: .*out' is a file"):
        check_output_dir(f, 0)
    res = train(f)
    assert res.returncode == ExitCode.USER_ERROR and "is a file" in res.stderr
    assert f.read_text() == "not a directory"  # nothing lost


def test_unwritable_output_dir_is_refused():
    # /proc refuses new directories even to root (a chmod would not stop root)
    with pytest.raises(ShardwiseError, match="is not writable"):
        check_output_dir("/proc/shardwise-test/out", 0)


def test_too_little_free_space_is_refused_with_the_numbers(tmp_path, disk_free):
    disk_free(5 << 30)  # the free space is faked (tests/conftest.py): the host's does not matter
    with pytest.raises(ShardwiseError, match=r"has 5.00 GiB free; this run needs 6.00 GiB"):
        check_output_dir(tmp_path, 6 << 30)
    check_output_dir(tmp_path, 5 << 30)  # exactly enough
    check_output_dir(tmp_path, 1)  # room for one byte


def test_two_runs_cannot_share_an_output_dir(tmp_path):
    with OutputLock(tmp_path):
        res = train(tmp_path)
        assert res.returncode == ExitCode.USER_ERROR
        assert "in use by another run" in res.stderr and f'"pid": {os.getpid()}' in res.stderr
        with pytest.raises(ShardwiseError, match="in use by another run"):
            OutputLock(tmp_path).acquire()
    OutputLock(tmp_path).acquire().release()  # released with its holder


def test_stale_temp_files_are_removed_and_named_and_summary_has_a_status(tmp_path):
    """Start-up clean-up removes what shardwise's killed saves and exports left (their `.tmp-`
    names, each directory with shardwise's marker inside, as they are created) and nothing else:
    a user's own `.tmp-important/thesis.tex` and `.tmp-notes.txt` survive."""
    from shardwise.train.outputs import TMP_MARKER

    stale = tmp_path / ".tmp-model-4242"
    stale.mkdir()
    (stale / TMP_MARKER).touch()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)  # an export killed half-way
    half = tmp_path / "checkpoints" / ".tmp-step-00000004"
    half.mkdir(parents=True)
    (half / TMP_MARKER).touch()
    (half / "__0_0.distcp").write_bytes(b"\0" * 64)  # a save killed half-way
    mine = tmp_path / ".tmp-important"
    mine.mkdir()
    (mine / "thesis.tex").write_text("\\chapter{One}")
    notes = tmp_path / ".tmp-notes.txt"
    notes.write_text("keep me")
    lookalike = tmp_path / "checkpoints" / ".tmp-step-00000009"  # shardwise's name, not its marker
    lookalike.mkdir()
    (lookalike / "data.bin").write_bytes(b"1")
    res = train(tmp_path, "checkpointing.save_final=true")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "removed unfinished files of an earlier run: .tmp-model-4242, .tmp-step-00000004" in res.stdout
    assert not stale.exists() and not half.exists()
    assert (mine / "thesis.tex").read_text() == "\\chapter{One}" and notes.read_text() == "keep me"
    assert (lookalike / "data.bin").read_bytes() == b"1"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["export"] == str(tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == [".tmp-important", ".tmp-notes.txt"]
    assert not list((tmp_path / "model").glob(".shardwise-tmp"))  # the marker never ships in an export

def test_atomic_dir_leaves_nothing_on_failure_and_replaces_on_success(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "old").write_text("previous export")
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("killed mid-export")
    assert (target / "old").read_text() == "previous export" and not list(tmp_path.glob(".tmp-*"))
    with atomic_dir(target) as tmp:
        (tmp / "new").write_text("complete")
    assert sorted(p.name for p in target.iterdir()) == ["new"] and not list(tmp_path.glob(".tmp-*"))


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    res = train(tmp_path, "checkpointing.save_every_steps=2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "step-00000002" / "manifest.json").is_file()
    res = train(tmp_path, "model.name=tiny-llama", "checkpointing.resume=latest", "run.steps=4")
    assert res.returncode == ExitCode.USER_ERROR
    assert "'tiny-llama' cannot resume" in res.stderr and "'tiny-qwen'" in res.stderr
    res = train(tmp_path, "checkpointing.resume=latest", "run.steps=1")
    assert res.returncode == ExitCode.USER_ERROR and "already at step 2" in res.stderr


@pytest.mark.parametrize(("kind", "planned"), [("GPU max allocated", "planned per GPU (-50%)"),
                                               ("host peak RSS", "planned per rank (host RSS) (-20%)")])
def test_summary_sets_the_measured_peak_beside_its_own_plan(capsys, kind, planned):
    """A GPU's allocated peak against the GPU plan; a CPU rank's host RSS against the plan of a
    CPU rank's resident set (shardwise.plan.host_cpu), never against the GPU plan."""
    from shardwise.train.observe.metrics import print_summary

    print_summary({"status": "completed", "steps": 3, "first_loss": 7.0, "final_loss": 6.0, "median_step_s": 0.1,
                   "tokens_per_s": 1000.0, "planned_gpu_bytes": 2 * 2**30, "planned_host_bytes": 1.25 * 2**30,
                   "measured_memory_bytes": 2**30, "measured_memory_kind": kind})
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # table cells wrap
    assert "1.00 GiB measured" in out
    assert f"vs {'2.00' if kind.startswith('GPU') else '1.25'} GiB {planned}" in out


def test_a_cpu_summary_without_a_host_plan_says_so(capsys):
    from shardwise.train.observe.metrics import print_summary

    print_summary({"status": "completed", "steps": 3, "first_loss": 7.0, "final_loss": 6.0, "median_step_s": 0.1,
                   "tokens_per_s": 1000.0, "planned_gpu_bytes": 2 * 2**30, "measured_memory_bytes": 2**30,
                   "measured_memory_kind": "host peak RSS"})
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "1.00 GiB measured (host peak RSS); no plan" in out and "per GPU" not in out


def test_a_fresh_temp_dir_replaces_what_a_killed_writer_left_and_nothing_else(tmp_path):
    """Ours (marker) or empty (a kill between mkdir and marker): replaced by a fresh marked
    directory. A user's own `.tmp-*` with content: refused, its files intact."""
    from shardwise.train.outputs import TMP_MARKER, fresh_own_tmp_dir, publish_own_tmp_dir

    tmp = tmp_path / ".tmp-step-00000008"
    tmp.mkdir()  # killed before the marker
    assert (fresh_own_tmp_dir(tmp) / TMP_MARKER).is_file()
    (tmp / "__0_0.distcp").write_bytes(b"partial")  # killed mid-save
    fresh_own_tmp_dir(tmp)
    assert sorted(p.name for p in tmp.iterdir()) == [TMP_MARKER]
    mine = tmp_path / ".tmp-thesis"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        fresh_own_tmp_dir(mine)
    assert (mine / "notes.txt").read_text() == "mine"
    # published: renamed first, the marker dropped after (a kill between leaves no unmarked .tmp-)
    publish_own_tmp_dir(tmp, tmp_path / "step-00000008")
    assert not tmp.exists() and list((tmp_path / "step-00000008").iterdir()) == []
