"""What `shardwise train` says when a run ends badly is what happened, its exit code is the
documented one, and a fresh run never deletes files it did not write.

Each run is a real CLI run (`python -m shardwise.train.cli`): 2 gloo ranks where the finding is
about ranks (a killed rank, a stop while the launcher checks), else one in-process rank with the
fault injected where a run meets it (tests/train/fault_workers/cli_faults.py):

- SIGTERM right after a skipped non-finite step: exit 75 with a checkpoint of the last finite
  state (the skip is named, not `save_on_interrupt`), and every JSON file the run wrote parses
  with a strict parser (non-finite numbers as "NaN"/"Infinity" strings); a foreign
  `tensorboard/` the run does not write to is left as it was;
- a SIGKILLed rank: summary.json names that rank and SIGKILL, rank 0's error as collateral;
- a full disk (a filled tmpfs) at the end-of-run export: exit 74, no traceback, summary.json
  `failed` (not `running`, though 0 bytes are free) with the export's path and bytes, the
  checkpoint intact;
- SIGTERM to the launcher while it checks the run: exit 75 at once, no rank started, the
  output directory as it was;
- a fresh run into a directory holding another tool's summary.json, metrics.jsonl and
  tensorboard/: refused (exit 2) naming them, nothing deleted.

(A hung rank's summary naming the stopped rank: tests/train/test_stop_signals_e2e.py.)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_disk_space import small_disk  # noqa: F401 - the fixture
from test_faults_e2e import CONFIG, finish, rank_pids, wait_for_step
from test_stop_signals import wait_until
from test_stop_signals_e2e import start, summary

from shardwise.errors import ExitCode

HERE = Path(__file__).parent
FAULTS = HERE / "fault_workers" / "cli_faults.py"
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def one_rank(out: Path, *faults: str, sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(FAULTS), *faults, "--", str(CONFIG), "--nproc", "1"]
    for s in (f"checkpointing.output_dir={out}", "logging.progress=false", "logging.trackers=[]",
              "checkpointing.save_every_minutes=null", *sets):  # fmt: skip
        argv += ["--set", s]
    return subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=240)


def strict(text: str, where: Path):
    def refuse(name: str):
        raise AssertionError(f"{where}: bare {name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}  # fmt: skip


def test_sigterm_after_a_skipped_step_saves_the_last_finite_state_in_strict_json(tmp_path):
    from shardwise.train.checkpoint.sharded import read_tensors

    out = tmp_path / "out"
    theirs = out / "tensorboard" / "events.out.tfevents.123.other-tool"  # this run writes no TensorBoard
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b"another tool's events")
    r = one_rank(out, "--nan-then-sigterm", "3", sets=("run.steps=6", "run.nonfinite_patience=2"))
    log = r.stdout + r.stderr
    assert r.returncode == ExitCode.INTERRUPTED, log[-3000:]
    s = summary(out)
    assert s["status"] == "interrupted" and "stopped by SIGTERM after step 3" in s["reason"], s
    assert "save_on_interrupt" not in s["reason"] and "step 3's update was skipped" in s["reason"], s
    assert "1 skipped step(s)" in s["reason"], s
    ckpt = Path(s["checkpoint"])
    assert ckpt.name == "step-00000003" and (ckpt / "manifest.json").is_file()
    assert all(bool(torch.isfinite(t).all()) for t in read_tensors(ckpt).values())
    assert json.loads((ckpt / "trainer_state.json").read_text())["nonfinite_streak"] == 1
    # strict JSON everywhere: the skipped step's grad norm is "NaN" in metrics.jsonl
    written = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")]
    assert {"summary.json", "metrics.jsonl", "manifest.json", "trainer_state.json"} <= {p.name for p in written}
    for p in written:
        for line in p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]:
            strict(line, p)
    rows = [strict(line, out) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] for r in rows if r["step"] == 3] == ["NaN"], rows
    assert theirs.read_bytes() == b"another tool's events"  # not ours, not written to: left as it was
    assert "left tensorboard as it is" in log


@pytest.mark.distributed
def test_a_sigkilled_rank_is_named_in_the_summary_with_its_signal(tmp_path):
    p = start(tmp_path, steps=400)
    wait_for_step(tmp_path, 2, p)
    pids = rank_pids(tmp_path)
    os.kill(pids[1], signal.SIGKILL)
    rc, log = finish(p)
    assert rc == 128 + signal.SIGKILL, log[-3000:]
    s = summary(tmp_path)
    assert s["status"] == "failed" and s["failed_rank"] == 1 and s["signal"] == "SIGKILL", s
    assert s["exit_code"] == 128 + signal.SIGKILL
    assert s["reason"].startswith(f"rank 1 (pid {pids[1]}) was killed by signal SIGKILL"), s
    # what rank 0 made of its peer's death (a broken collective) is secondary, when it said anything
    assert all(c.startswith("rank 0") for c in s.get("collateral", [])), s


def test_a_full_disk_at_the_export_exits_74_with_a_summary(small_disk):  # noqa: F811
    from shardwise.train.checkpoint.sharded import read_manifest

    out = small_disk / "run"
    r = one_rank(out, "--fill-before-export", str(small_disk),
                 sets=("run.steps=4", "checkpointing.save_every_steps=4", "checkpointing.save_final=true"))
    log = r.stdout + r.stderr
    assert r.returncode == ExitCode.NO_SPACE, log[-3000:]
    assert "Traceback" not in log and "the export ran out of disk space" in log, log[-3000:]
    s = summary(out)  # written with 0 bytes free: not left `running`
    assert s["status"] == "failed" and "the export ran out of disk space" in s["reason"], s
    assert s["space"]["path"] == str(out / "model") and s["space"]["need_bytes"] > s["space"]["free_bytes"], s
    ckpt = out / "checkpoints" / "step-00000004"
    read_manifest(ckpt)  # the checkpoint, every file and hash, is intact: `shardwise export` can write it
    assert s["checkpoint"] == str(ckpt)
    assert not (out / "model").exists() and not list(out.glob(".tmp-*"))


def _catches(pid: int, sig: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def _loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.distributed
def test_sigterm_while_the_launcher_checks_exits_75_with_nothing_started(tmp_path):
    from test_stop_signals_e2e import an_earlier_completed_run

    an_earlier_completed_run(tmp_path)
    before = tree(tmp_path)
    # the SFT demo: the launcher tokenises its data before any rank starts (transformers'
    # tokenizer loads torch: seconds of checks); a synthetic run's checks load no torch and take
    # well under a second
    p = start(tmp_path, steps=400, config=CONFIG.parent / "demo.yaml")
    # the launcher handles SIGTERM from its first checks on (before, it died of it: 143); the
    # signal comes once it has loaded torch for its checks (a few seconds before any rank starts)
    assert wait_until(lambda: (_catches(p.pid, signal.SIGTERM) and _loaded(p.pid, "libtorch_cpu"))
                      or p.poll() is not None, 60)
    assert not (tmp_path / ".shardwise" / "heartbeat").exists(), "the ranks had started"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc, log = finish(p)
    assert rc == ExitCode.INTERRUPTED, log[-3000:]
    assert "stopped by SIGTERM before any rank started" in log and "Traceback" not in log, log[-3000:]
    assert time.monotonic() - t0 < 10  # at once, not after the checks
    assert not (tmp_path / ".shardwise" / "heartbeat").exists()  # no rank started
    assert tree(tmp_path) == before  # summary.json (an earlier run's) and everything else as it was


def test_a_fresh_run_never_deletes_another_tools_logs(tmp_path):
    theirs = {"summary.json": b'{"accuracy": 0.93}', "metrics.jsonl": b'{"epoch": 1}\n',
              "tensorboard/events.out.tfevents.1.other": b"events"}  # fmt: skip
    for name, data in theirs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    r = one_rank(tmp_path, sets=("run.steps=2", "logging.trackers=[tensorboard]"))
    assert r.returncode == ExitCode.USER_ERROR, r.stdout + r.stderr
    assert "holds files that shardwise did not write" in r.stderr, r.stderr
    for name in theirs:
        assert name in r.stderr.replace("\n", ""), (name, r.stderr)
        assert (tmp_path / name).read_bytes() == theirs[name]
    r2 = one_rank(tmp_path, sets=("run.steps=2", "logging.trackers=[tensorboard]", "checkpointing.overwrite=true"))
    assert r2.returncode == ExitCode.USER_ERROR and "with or without --overwrite" in r2.stderr
    assert all((tmp_path / name).read_bytes() == data for name, data in theirs.items())


def test_only_logs_recorded_as_shardwises_are_replaced(tmp_path):
    """In-process: what write_summary and the record say; a file replaced by another tool (a new
    inode at the same name) is no longer shardwise's."""
    from shardwise.train.observe.metrics import write_summary
    from shardwise.train.outputs import check_fresh_output, clear_earlier_run, foreign

    write_summary(tmp_path, {"status": "completed"})
    assert foreign(tmp_path, "summary.json") == []
    check_fresh_output(tmp_path, resume=None, overwrite=False, where="x")
    assert clear_earlier_run(tmp_path, overwrite=False) == (["summary.json"], [])
    write_summary(tmp_path, {"status": "completed"})
    (tmp_path / "new.json").write_text("{}")
    os.replace(tmp_path / "new.json", tmp_path / "summary.json")  # another tool's, at our name
    assert foreign(tmp_path, "summary.json") == ["summary.json"]
    from shardwise.errors import ShardwiseError

    with pytest.raises(ShardwiseError, match=r"shardwise did not write .*\(summary.json\)"):
        check_fresh_output(tmp_path, resume=None, overwrite=True, where="x")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "theirs").write_text("x")
    assert clear_earlier_run(tmp_path, overwrite=False) == ([], ["summary.json", "tensorboard"])
    assert (tmp_path / "summary.json").read_text() == "{}" and (tmp_path / "tensorboard" / "theirs").is_file()
