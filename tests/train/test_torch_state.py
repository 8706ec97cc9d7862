"""DDP and FSDP2 checkpoints through torch's state-dict API: `get_state_dict` /
`set_state_dict` mapped onto the canonical names, on 2 gloo ranks (tests/train/torch_state_worker.py).

The canonical keys are exactly the trained parameters' (a tied weight once, a LoRA base never),
the tensors are the live ones (no copy for a save), the step count is 0 before any update (the
library's own initialisation would take a zero-lr step and leave it at 1), and a save then a
load into a fresh engine restores every tensor, the step count and fp16's GradScaler, so the
next step is bit for bit the same. Cross-engine and cross-world-size resumes are
tests/train/test_resume.py's."""

from __future__ import annotations

import json

import pytest
from conftest import HERE, run_once

pytestmark = pytest.mark.distributed

RUNS = ["ddp:tiny-qwen:fp16-mixed", "fsdp:tiny-qwen:fp16-mixed", "ddp:tiny-llama:fp32:fused",
        "fsdp:tiny-llama:bf16-mixed:fused", "fsdp:tiny-qwen:fp32:lora", "ddp:tiny-llama:fp32:lora"]


@pytest.fixture(scope="module")
def results(shared_dir):
    return run_once(shared_dir / "torch-state", HERE / "torch_state_worker.py", [(RUNS, 2, 400)])


@pytest.mark.parametrize("run", RUNS)
def test_canonical_state_round_trips_through_get_and_set_state_dict(results, run):
    r = json.loads((results / f"{run.replace(':', '-')}.json").read_text())
    assert r["keys_match_trained_params"] and r["n_trained"] > 0
    assert r["aliases_live"]
    assert r["step_before_update"] == 0
    assert r["extra_saved"]["optimizer_step"] == 3 and r["extra_loaded"] == r["extra_saved"]
    if "fp16" in run:  # the GradScaler's scale and growth tracker came back
        assert r["extra_saved"]["scaler"]["_growth_tracker"] == 3
    else:
        assert r["extra_saved"]["scaler"] is None
    assert r["state_equal"] and r["steps_loaded"] == [3.0]
    assert r["next_step_exact"]
    assert r["has_frozen"] == run.endswith(":lora")
