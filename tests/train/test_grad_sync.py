"""FSDP2 under gradient accumulation: the planner and the trainer make one choice, on 2 gloo ranks.

`strategy.fsdp.reduce_every_micro_batch: auto` (the default) holds the unsharded gradients between
micro-batches only where the plan with them held fits the run's device memory (shardwise.plan.grad_sync).
The device memory is the run's hardware spec (`hardware.machine`, its `gpu_memory_gb`: never the
host's RAM): 80 GB, where the held grads fit, and a figure set between what the two plans need,
where only the sharded ones do. For each, the planner's choice (the memory plan the preflight
checks) and the trainer's (RunSpec.grad_sync) are the same, and the engine's reduce-scatters,
counted as it trains (tests/train/grad_sync_worker.py), are what the choice says: one per
`fully_shard` unit per step when held, one per unit per micro-batch otherwise. And `shardwise
train` says which in its start-up log and in summary.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HERE, run_once

WORKER = HERE / "grad_sync_worker.py"
pytestmark = pytest.mark.distributed


def _machine(path: Path, memory_gb: float) -> str:
    path.write_text(json.dumps({"format": "shardwise-hardware/1", "gpu": "a100-80g", "gpu_memory_gb": memory_gb,
                                "gpus_per_node": 2}))
    return str(path)


def tight_memory_gb(tmp: Path) -> float:
    """GPU memory (GB) between the usable memory the held-grads plan needs and the sharded one's."""
    from grad_sync_worker import config

    from shardwise.plan.grad_sync import with_knob
    from shardwise.plan.memory import plan_memory
    from shardwise.run import run_spec

    run = run_spec(config(_machine(tmp / "probe.json", 80), tmp / "probe"), 2, "cpu", environ={})
    need = {}
    for every in (False, True):
        p = plan_memory(run.model, run.hardware, run.train, with_knob(run.strategy, every))
        need[every] = p.gpu.required / (1 - p.margin)  # the capacity at which it just fits
    assert need[False] > need[True] * (1 + 1e-6), need  # the held grads (4 bytes × Ψ) need more
    return (need[False] + need[True]) / 2 / 1e9


@pytest.fixture(scope="module")
def synced(shared_dir) -> tuple[Path, dict[str, float]]:
    out = shared_dir / "grad-sync"
    out.mkdir(exist_ok=True)
    memory = {"roomy": 80.0, "tight": tight_memory_gb(out)}
    items = [f"{name}={_machine(out / f'{name}.machine.json', gb)}" for name, gb in memory.items()]
    return run_once(out, WORKER, [(items, 2, 400)]), memory


@pytest.mark.parametrize("name, hold", [("roomy", True), ("tight", False)])
def test_planner_and_trainer_make_one_choice_and_the_engine_runs_it(synced, name, hold):
    from grad_sync_worker import GA

    out, memory = synced
    rec = json.loads((out / f"{name}.json").read_text())
    assert rec["planned"] == rec["trainer"], rec
    assert rec["trainer"]["hold_unsharded_grads"] is hold and rec["trainer"]["chosen"] == "auto", (memory, rec)
    assert rec["planned_fits"], rec  # the sharded plan fits the tight memory too
    assert (rec["planned_held_grads"] > 0) is hold
    # measured: a reduce-scatter per fully_shard unit (4 decoder layers and the root) once per step
    # when held, on every micro-batch when not
    (units,) = rec["units"]
    assert units == 5
    assert rec["reduce_scatter_calls_per_step"] == units * (1 if hold else GA), rec
    assert rec["trainer"]["reduce_scatters_per_step"] == (1 if hold else GA)
    assert len(rec["losses"]) == 2 and all(x == x for x in rec["losses"])
    if not hold:
        assert "would not fit" in rec["trainer"]["reason"], rec


def test_shardwise_train_says_it_reduces_every_micro_batch(synced, tmp_path):
    """`shardwise train` on 2 ranks with the tight device memory: the start-up log and
    summary.json say it reduce-scatters every micro-batch, and why."""
    from grad_sync_worker import config

    memory = synced[1]
    run_dir = tmp_path / "run"
    cfg = config(_machine(tmp_path / "tight.json", memory["tight"]), run_dir).model_dump(mode="json",
                                                                                      exclude={"source"})
    cfg["run"] |= {"steps": 1, "nproc": 2}
    yaml = tmp_path / "run.yaml"
    yaml.write_text(json.dumps(cfg))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(yaml)], capture_output=True, text=True,
                       timeout=300, check=False, env={**env, "DS_ACCELERATOR": "cpu"}, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "shardwise: fsdp: reduce-scatter every micro-batch (holding" in r.stdout + r.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["grad_sync"]["reduce_every_micro_batch"] is True
    assert summary["grad_sync"]["reduce_scatters_per_step"] == cfg["run"]["grad_accum"]
