"""Evaluation under tensor parallelism: `strategy.tp: 2` on 2 gloo ranks evaluates the
validation split (the bundled SFT sample, tests/train/validation_worker.py) through the engine's
own TP forward and the vocab-parallel loss (`zero1`: DeepSpeed's AutoTP, the chunked loss on its
replicated lm_head); its eval losses and step losses equal one process's
within 1e-5 relative."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_once

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def runs(shared_dir) -> Path:
    return run_once(shared_dir / "tp-eval", HERE / "validation_worker.py", [(["ddp"], 1, 300), (["fsdp:tp2", "zero1:tp2"], 2, 300)])


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])  # zero1: DeepSpeed's AutoTP, lm_head replicated
def test_tp_evaluation_equals_one_process(runs, strategy):
    ref = torch.load(runs / "ddp-w1.pt", weights_only=False)
    got = torch.load(runs / f"{strategy}-tp2-w2.pt", weights_only=False)
    assert [e["step"] for e in got["evals"]] == [e["step"] for e in ref["evals"]] and got["evals"]
    for a, b in zip(got["evals"], ref["evals"], strict=True):
        assert a["eval_tokens"] == b["eval_tokens"]
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * b["eval_loss"], (a, b)
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * b
