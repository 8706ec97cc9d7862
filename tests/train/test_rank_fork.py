"""CPU ranks forked from the launcher (shardwise.train.launch.fork) train exactly as ranks started
as fresh interpreters, and the launcher forks only where it is safe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.errors import ShardwiseError
from shardwise.train.launch import fork as rank_fork

REPO = Path(__file__).parents[2]


def _run(out: Path, **env: str) -> list[dict]:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(REPO / "examples" / "fsdp-synthetic-cpu.yaml"),
            "--set", "run.steps=3", "--set", "strategy.name=zero2", "--set", "checkpointing.save_final=false",
            "--set", f"checkpointing.output_dir={out}"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, **env}, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_forked_ranks_train_as_execd_ranks(tmp_path):
    """The same 3 ZeRO-2 steps, ranks forked (the default on CPU) and exec'd (SHARDWISE_RANK_START=exec,
    how CUDA ranks start): equal losses and grad norms, to the bit."""
    forked = _run(tmp_path / "forked")
    execd = _run(tmp_path / "exec", SHARDWISE_RANK_START="exec")
    pick = lambda rows: [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]  # noqa: E731
    assert len(pick(forked)) == 3
    assert pick(forked) == pick(execd)


def test_the_launcher_forks_only_where_it_is_safe(monkeypatch):
    """CUDA, one rank, SHARDWISE_RANK_START=exec, or torch already loaded (its OpenMP pool may
    exist): the ranks are exec'd, and nothing in the environment changes. (A launcher that forks:
    test_schedule_and_launch's probe of `shardwise train`.)"""
    import torch  # noqa: F401 - the loaded torch the launcher must not fork from

    monkeypatch.delenv(rank_fork.RANK_START_ENV, raising=False)
    before = dict(os.environ)
    assert rank_fork.single_threaded_launcher("cpu", 2) is None
    assert rank_fork.single_threaded_launcher("cuda", 8) is None
    assert rank_fork.single_threaded_launcher("cpu", 1) is None
    monkeypatch.setenv(rank_fork.RANK_START_ENV, "exec")
    assert rank_fork.single_threaded_launcher("cpu", 2) is None
    monkeypatch.delenv(rank_fork.RANK_START_ENV)
    assert dict(os.environ) == before


def test_a_bad_rank_start_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(rank_fork.RANK_START_ENV, "spawn")
    with pytest.raises(ShardwiseError, match=r"SHARDWISE_RANK_START='spawn': expected one of auto, exec"):
        rank_fork.rank_start()


FORK_PREMISE = """
import os, sys
{threads}
import torch
a = torch.randn(1000, 1000)
(a @ a).sum()  # the launcher's own work, on the threads it was given
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)  # a rank's own pool
    b = torch.randn(1000, 1000)
    (b @ b).sum()
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_single_threaded_launcher_forks_ranks_that_run_their_own_thread_pools():
    """The premise shardwise.train.launch.fork rests on, on the installed torch: a launcher held to
    one OpenMP thread from before torch loaded forks a child whose 2-thread matmul completes (a
    launcher that ran 2 threads first would leave it hung: the check below times out instead)."""
    code = FORK_PREMISE.format(threads='os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                       env={k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    assert r.returncode == 0, r.stderr[-2000:]


def test_auto_that_finds_a_gpu_gives_the_launcher_its_thread_variables_back(monkeypatch):
    """`run.device: auto` is decided after the launcher was made single-threaded; when it finds a
    GPU the ranks are exec'd, and inherit the user's OMP_NUM_THREADS / MKL_NUM_THREADS, not 1."""
    from types import SimpleNamespace

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")

    def single_threaded(device, world):  # as on a launcher whose torch is not loaded yet
        earlier = {name: os.environ.get(name) for name in rank_fork.THREAD_VARS}
        for name in rank_fork.THREAD_VARS:
            monkeypatch.setenv(name, "1")
        return earlier

    monkeypatch.setattr(rank_fork, "single_threaded_launcher", single_threaded)
    cfg = SimpleNamespace(run=SimpleNamespace(device="auto"), resolved_device=lambda: "cuda")
    assert rank_fork.launch_device(cfg, 8) == ("cuda", None)
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["MKL_NUM_THREADS"] == "3"
    cfg = SimpleNamespace(run=SimpleNamespace(device="auto"), resolved_device=lambda: "cpu")
    assert rank_fork.launch_device(cfg, 2) == ("cpu", {"OMP_NUM_THREADS": None, "MKL_NUM_THREADS": "3"})
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "1"


def test_a_rank_execd_by_the_launcher_takes_its_preflight(monkeypatch, tmp_path):
    """A rank exec'd by shardwise's own launcher (CUDA ranks) reads the config again but does not
    repeat preflight: it takes the launcher's verdict, and its run is the one the launcher checked;
    a config file edited since the launcher checked it is refused, naming the file."""
    import hashlib

    from shardwise.config.load import load_config
    from shardwise.run import run_spec
    from shardwise.train import cli, preflight

    config = tmp_path / "run.yaml"
    config.write_text((REPO / "examples" / "fsdp-synthetic-cpu.yaml").read_text())
    overrides = [f"checkpointing.output_dir={tmp_path / 'out'}"]
    memory = {"planned_bytes": 123.0, "capacity_bytes": 456.0, "fits": True, "gpu": "cpu"}
    # the launcher's `checkpointing: auto` (full here, whatever this node's memory would say)
    decided = {"checkpointing": "full", "strategy": "fsdp", "need": "9.99", "have": "1.00 per node (host memory)"}
    monkeypatch.setenv(cli.HANDOFF_ENV, json.dumps({"config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
                                                    "memory": memory, "recompute": decided}))

    def repeated(*_a, **_k):
        raise AssertionError("preflight ran again in an exec'd rank")

    monkeypatch.setattr(preflight, "preflight", repeated)
    _, world, device, run, check, _, lock, _ = cli._checked(config, overrides, {"rank": 1, "world_size": 2},
                                                              True, None, False)
    assert (world, lock, check.planned_bytes, check.fits) == (2, None, 123.0, True)
    from shardwise.plan.recompute import RecomputeChoice

    assert run.train.checkpointing == "full" and run.recompute == RecomputeChoice(**decided)
    assert run == run_spec(load_config(config, overrides), 2, device, recompute=RecomputeChoice(**decided))
    config.write_text(config.read_text() + "\n# edited\n")
    with pytest.raises(ShardwiseError, match=r"run\.yaml: changed since `shardwise train` checked it"):
        cli._checked(config, overrides, {"rank": 1, "world_size": 2}, True, None, False)
