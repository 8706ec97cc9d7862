"""`checkpointing.activation: auto` (the schema's default) in the trainer: decided before any rank
starts, as `plan` decides it (shardwise.plan.recompute): none where the run fits without
recomputation, else full. On CPU the fit is the node's host memory (`hardware.host_memory_gb`
here, never this machine's), so a node sized between the two plans makes the trainer checkpoint:
`shardwise train` says so with the figure, its ranks (forked, or exec'd with the launcher's
decision handed to them) run it, and summary.json records it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.config.load import load_config
from shardwise.plan.host_cpu import cpu_rank_memory
from shardwise.run import run_spec
from shardwise.specs.hardware import GIB

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "fsdp-synthetic-cpu.yaml"  # tiny Qwen2, FSDP2, 2 CPU ranks


def _node_bytes(checkpointing: str, forked: bool | None = None) -> float:
    """The example's node while it trains (both ranks and the launcher) planned with `checkpointing`,
    its ranks forked (None: as `shardwise train` starts them) or exec'd (False)."""
    run = run_spec(load_config(EXAMPLE, ["checkpointing.activation=none"]), 2, "cpu", environ={})
    mem = cpu_rank_memory(run.model, run.hardware, run.train.model_copy(update={"checkpointing": checkpointing}),
                          run.strategy, forked=forked)
    return mem.training * mem.ranks_per_node + mem.launcher


def test_the_example_leaves_it_to_the_plan():
    assert load_config(EXAMPLE).checkpointing.activation == "auto"


@pytest.mark.parametrize("room", [1.05, 0.999])
def test_cpu_auto_is_none_where_the_node_holds_it_else_full(room):
    none, full = _node_bytes("none"), _node_bytes("full")
    assert full < none
    gb = max(room * none, (none + full) / 2) / 1e9
    run = run_spec(load_config(EXAMPLE, [f"hardware.host_memory_gb={gb!r}"]), 2, "cpu", environ={})
    want = "none" if room > 1 else "full"
    assert run.train.checkpointing == want and run.recompute.checkpointing == want
    assert f"{none / GIB:.2f} GiB of {gb * 1e9 / GIB:.2f} per node (host memory)" in run.recompute.reason


def test_a_pinned_value_is_not_decided():
    run = run_spec(load_config(EXAMPLE, ["checkpointing.activation=none", "hardware.host_memory_gb=0.001"]), 2,
                   "cpu", environ={})
    assert run.train.checkpointing == "none" and run.recompute is None


@pytest.mark.distributed
@pytest.mark.parametrize("start", ["auto", "exec"])  # auto: forked
def test_shardwise_train_checkpoints_where_the_node_needs_it(tmp_path, start):
    forked = False if start == "exec" else None  # exec'd ranks each hold a whole interpreter
    none, full = _node_bytes("none", forked), _node_bytes("full", forked)
    gb = (none + full) / 2 / 1e9
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise.train.cli", str(EXAMPLE), "--set", "run.steps=1",
           "--set", f"hardware.host_memory_gb={gb!r}", "--set", f"checkpointing.output_dir={out}",
           "--set", "logging.progress=false"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["SHARDWISE_RANK_START"] = start
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env=env, cwd=tmp_path)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    said = (f"shardwise: fsdp: checkpointing full (auto: without recomputation it would need {none / GIB:.2f} GiB "
            f"of {gb * 1e9 / GIB:.2f} per node (host memory))")
    assert said in log, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpointing"] == "full"
    assert summary["checkpointing_choice"] == {"checkpointing": "full", "chosen": "auto",
                                               "reason": said.split("(", 1)[1][:-1]}
