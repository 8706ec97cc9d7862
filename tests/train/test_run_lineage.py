"""Checkpoints belong to a run: pruning and `--resume latest` never
cross runs, a fresh run never mixes with an earlier one, and damaged checkpoints are named.

The runs are real `shardwise train` processes on one CPU rank (lineage is rank 0's business:
it writes the manifests and prunes); tests/train/test_faults_e2e.py covers 2 ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from shardwise.errors import ExitCode
from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
from shardwise.train.checkpoint.lineage import read_lineage
from shardwise.train.checkpoint.sharded import read_manifest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"


def train(out: Path, *extra: str, steps: int, every: int, keep: int) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--nproc", "1"]
    for s in (f"checkpointing.output_dir={out}", f"run.steps={steps}", f"checkpointing.save_every_steps={every}",
              f"checkpointing.keep_last={keep}", "checkpointing.save_final=true", "logging.progress=false",
              "logging.trackers=[]", "data.synthetic.seq_len=16"):  # fmt: skip
        argv += ["--set", s]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([*argv, *extra], env=env, capture_output=True, text=True, timeout=240)


def steps_in(out: Path) -> list[int]:
    return sorted(int(d.name.removeprefix("step-")) for d in checkpoints_dir(out).glob("step-*"))


def lineage_of(out: Path, step: int) -> str:
    return json.loads((checkpoints_dir(out) / step_dir_name(step) / "manifest.json").read_text())["lineage"]


def tree_digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and ".shardwise" not in p.parts}  # fmt: skip


def ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_a_fresh_run_into_a_used_directory_is_refused_and_overwrite_replaces_it(tmp_path):
    ok(train(tmp_path, steps=12, every=6, keep=2))
    assert steps_in(tmp_path) == [6, 12] and (tmp_path / "model" / "model.safetensors").is_file()
    before = tree_digest(tmp_path)

    r = train(tmp_path, steps=4, every=2, keep=2)  # the reproduction: it used to delete its own step-2/4
    assert r.returncode == ExitCode.USER_ERROR, r.stdout + r.stderr
    assert "holds an earlier run's outputs (checkpoints/step-00000006, checkpoints/step-00000012, model)" in r.stderr
    assert "--resume latest" in r.stderr and "--overwrite" in r.stderr
    assert tree_digest(tmp_path) == before  # nothing lost, nothing written

    r = train(tmp_path, "--overwrite", steps=4, every=2, keep=2)
    ok(r)
    assert "removed the earlier run's" in r.stdout
    assert steps_in(tmp_path) == [2, 4]  # its own checkpoints, kept
    lineage = read_lineage(tmp_path)
    assert lineage is not None and {lineage_of(tmp_path, 2), lineage_of(tmp_path, 4)} == {lineage.lineage}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and Path(summary["checkpoint"]).is_dir()
    assert summary["checkpoint"].endswith(step_dir_name(4))
    metrics = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3, 4]  # only this run's steps


def test_a_branch_prunes_and_resumes_only_its_own_lineage(tmp_path):
    ok(train(tmp_path, steps=12, every=4, keep=3))
    assert steps_in(tmp_path) == [4, 8, 12]
    first = lineage_of(tmp_path, 12)
    old4 = tree_digest(checkpoints_dir(tmp_path) / step_dir_name(4))
    old12 = tree_digest(checkpoints_dir(tmp_path) / step_dir_name(12))

    # resume from an earlier checkpoint of the same directory: a branch (a new lineage)
    step4 = checkpoints_dir(tmp_path) / step_dir_name(4)
    ok(train(tmp_path, "--resume", str(step4), steps=10, every=2, keep=2))
    branch = read_lineage(tmp_path)
    assert branch is not None and branch.lineage != first and branch.parent == str(step4.resolve())
    # its keep_last=2 counts its own 6, 8, 10 only: before, the abandoned run's 12 (and 8) outranked them
    assert steps_in(tmp_path) == [4, 8, 10, 12]
    assert {lineage_of(tmp_path, s) for s in (8, 10)} == {branch.lineage}
    assert lineage_of(tmp_path, 4) == lineage_of(tmp_path, 12) == first
    assert tree_digest(checkpoints_dir(tmp_path) / step_dir_name(4)) == old4  # the other timeline: untouched
    assert tree_digest(checkpoints_dir(tmp_path) / step_dir_name(12)) == old12
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert Path(summary["checkpoint"]).name == step_dir_name(10) and Path(summary["checkpoint"]).is_dir()

    # `--resume latest` continues the branch (step 10), not the other run's higher step 12
    r = train(tmp_path, "--resume", "latest", steps=12, every=2, keep=2)
    ok(r)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_step"] == 10, summary
    assert read_lineage(tmp_path).lineage == branch.lineage  # the newest of its lineage: continued
    assert steps_in(tmp_path) == [4, 10, 12] and lineage_of(tmp_path, 12) == branch.lineage  # same name: replaced
    assert lineage_of(tmp_path, 4) == first


def test_latest_refuses_when_every_checkpoint_is_damaged_and_names_each(tmp_path):
    ok(train(tmp_path, steps=4, every=2, keep=2))
    for s in (2, 4):
        shard = next((checkpoints_dir(tmp_path) / step_dir_name(s)).glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-1] + b"\x01")  # same size, other bytes: the sha256 differs
    incomplete = checkpoints_dir(tmp_path) / "step-00000099"
    incomplete.mkdir()  # no manifest: never loaded, but named
    before = tree_digest(tmp_path)
    r = train(tmp_path, "--resume", "latest", steps=6, every=2, keep=2)
    assert r.returncode == ExitCode.USER_ERROR, r.stdout[-2000:] + r.stderr[-2000:]
    text = r.stdout + r.stderr
    assert "step-00000099: no manifest.json" in text
    for s in (2, 4):
        assert f"skipping checkpoint {checkpoints_dir(tmp_path) / step_dir_name(s)}" in text
    assert "no valid checkpoint of this run's lineage among step-00000099, step-00000002, step-00000004" in text
    assert tree_digest(tmp_path) == before  # it trained nothing from step 0 over them


def test_latest_of_a_branch_that_saved_nothing_is_its_parent(tmp_path):
    """A branch that crashed before its first save: `latest` means the checkpoint it started from."""
    ok(train(tmp_path, steps=8, every=4, keep=3))
    step4 = checkpoints_dir(tmp_path) / step_dir_name(4)
    r = train(tmp_path, "--resume", str(step4), "--set", "run.timeout_s=abc", steps=8, every=4, keep=3)
    assert r.returncode == ExitCode.USER_ERROR  # a bad start writes no lineage
    from shardwise.train.checkpoint.lineage import Lineage, write_lineage

    write_lineage(tmp_path, Lineage("crashed", "crashed", parent=str(step4.resolve())))  # as a branch killed early
    r = train(tmp_path, "--resume", "latest", steps=8, every=4, keep=3)
    ok(r)
    assert "has saved no checkpoint yet; resuming its parent" in r.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 4
    read_manifest(checkpoints_dir(tmp_path) / step_dir_name(8))
