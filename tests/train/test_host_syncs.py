"""A step that does not wait on the host.

- Host reads per step, counted on 2 gloo ranks (tests/train/sync_worker.py: every `.item()`,
  `.tolist()`, `float()`, `int()`, `bool()`, `__index__`, `.cpu()`, `.numpy()` on the training
  thread, by phase and step): shardwise's own code reads a tensor at most once per step between
  logging steps (the engine's non-finite skip decision; none with fused AdamW, which skips on the
  device, nor under ZeRO-2, whose optimizer decides inside DeepSpeed), plus exactly one read at a
  logging step (all the interval's loss sums and grad norms in one copy).
- The records completed at the interval are the step-by-step loop's, bit for bit.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import HERE, run_once
from one_rank import loop_config, train_one_rank

WORKER = HERE / "sync_worker.py"
# shardwise's host reads per step between logging steps, by run
PER_STEP = {"ddp": 1, "fsdp": 1, "zero0": 1, "zero2": 0, "ddp:fused": 0, "fsdp:fused": 0}


@pytest.fixture(scope="module")
def syncs(shared_dir) -> Path:
    return run_once(shared_dir / "host-syncs", WORKER, [(list(PER_STEP), 2, 400)])


@pytest.mark.distributed
@pytest.mark.parametrize("item", list(PER_STEP))
def test_at_most_one_host_sync_per_step_between_logging_steps(syncs, item):
    from sync_worker import EVERY, STEPS

    rec = json.loads((syncs / f"{item.replace(':', '-')}.json").read_text())
    ours = [e for e in rec["events"] if e["shardwise"] and e["step"] > 0]
    logging_steps = {s for s in range(1, STEPS + 1) if s % EVERY == 0 or s == STEPS}
    for step in range(1, STEPS + 1):
        at = [e for e in ours if e["step"] == step]
        flush = [e for e in at if e["phase"] == "host sync (losses, grad norms)"]
        in_step = [e for e in at if e not in flush]
        assert len(in_step) == PER_STEP[item], (step, in_step)
        assert all(e["phase"] == "optimizer step" and ":step:" in e["at"] for e in in_step), in_step
        # the logging step's one copy of every pending loss sum and grad norm
        assert [e["at"].split(":")[:2] for e in flush] == ([["step_log.py", "to_host"]] if step in logging_steps
                                                           else []), (step, flush)
    library = Counter(f"{e['phase']}: {e['at']} {e['read']}" for e in rec["events"] if not e["shardwise"])
    print(f"{item} ({rec['engine']}): shardwise {PER_STEP[item]}/step + 1 per logging step; "
          f"library reads on the training thread: {dict(library)}")
    assert len(rec["losses"]) == STEPS and all(n == n and n > 0 for n in rec["grad_norms"])


@pytest.mark.distributed
def test_fused_adamw_trains_like_the_foreach_one(syncs):
    """The device-side skip path (fused AdamW's found_inf) changes no finite step."""
    for engine in ("ddp", "fsdp"):
        a = json.loads((syncs / f"{engine}.json").read_text())
        b = json.loads((syncs / f"{engine}-fused.json").read_text())
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-6, atol=0)


# --- in-process, one rank ----------------------------------------------------------------------




class _Phases:
    def __init__(self):
        self.now = ("start", 0)

    def phase(self, name, step):
        self.now = (name, step)


class _Metrics:
    """Records when (in which phase) each step record was logged."""

    def __init__(self, phases: _Phases):
        self.phases, self.logged = phases, []

    def start(self, *args, **kwargs):
        pass

    def log_step(self, rec):
        self.logged.append((rec.step, self.phases.now))


def test_records_completed_at_the_interval_are_the_step_by_step_ones(tmp_path):
    every_step = train_one_rank(loop_config(tmp_path / "a", every=1))
    phases = _Phases()
    metrics = _Metrics(phases)
    batched = train_one_rank(loop_config(tmp_path / "b", every=3), metrics=metrics, watchdog=phases)
    assert [r.loss for r in batched.records] == [r.loss for r in every_step.records]
    assert [r.grad_norm for r in batched.records] == [r.grad_norm for r in every_step.records]
    assert [r.step for r in batched.records] == list(range(1, 8))
    # one line per step, written at the logging steps 3 and 6 and at the end (7)
    flush = "host sync (losses, grad norms)"
    assert metrics.logged == [(s, (flush, 3)) for s in (1, 2, 3)] + [(s, (flush, 6)) for s in (4, 5, 6)] + [
        (7, (flush, 7))]
