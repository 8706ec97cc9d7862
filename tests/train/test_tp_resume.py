"""Checkpoints across tensor-parallel degrees, CPU gloo, fp32, synthetic data.

The canonical checkpoint names full tensors (DCP saves each DTensor as its global tensor, by
name): a `strategy.tp: 2` run resumes bit-exact on its own layout (2 ranks TP alone, 4 ranks
FSDP2 × TP), and continues within 1e-5 (losses) on another: tp 2 → 1, 1 → 2, FSDP2 × TP (4
ranks) → ZeRO-3 (2 ranks). `shardwise export` writes the HF model from a TP checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_once

HERE = Path(__file__).parent
WORKER = HERE / "resume_worker.py"
SAVE_EVERY = 3
TP = "fsdp@tp2"

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(shared_dir):
    return run_once(shared_dir / "tp-resume", WORKER, [
        (["fsdp:full"], 1, 300),
        ([f"{TP}:full", f"{TP}:resume:{TP}-full-w2", f"{TP}:resume:fsdp-full-w1"], 2, 600),
        ([f"{TP}:full", f"{TP}:resume:{TP}-full-w4"], 4, 600),
        ([f"zero3:resume:{TP}-full-w4"], 2, 300),
        ([f"fsdp:resume:{TP}-full-w2"], 1, 300),
    ])


def load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_resume_is_bit_exact(runs, world):
    full = load(runs, f"{TP}-full-w{world}")
    resumed = load(runs, f"{TP}-resume-{TP}-full-w{world}-w{world}")
    assert resumed["start_step"] == SAVE_EVERY
    assert resumed["losses"] == full["losses"][SAVE_EVERY:]
    assert resumed["grad_norms"] == full["grad_norms"][SAVE_EVERY:]
    assert full["weights"].keys() == resumed["weights"].keys()
    for k, v in full["weights"].items():
        assert torch.equal(v, resumed["weights"][k]), k


@pytest.mark.parametrize(("resumed", "source"), [
    (f"fsdp-resume-{TP}-full-w2-w1", f"{TP}-full-w2"),  # tp 2 -> 1 (one process)
    (f"{TP}-resume-fsdp-full-w1-w2", "fsdp-full-w1"),  # tp 1 -> 2
    (f"zero3-resume-{TP}-full-w4-w2", f"{TP}-full-w4"),  # fsdp x tp (2 x 2) -> zero3 on 2 ranks
])
def test_tp_resume_across_degrees(runs, resumed, source):
    full, res = load(runs, source), load(runs, resumed)
    assert res["start_step"] == SAVE_EVERY
    expect = torch.tensor(full["losses"][SAVE_EVERY:], dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(res["losses"], dtype=torch.float64), expect, rtol=1e-5, atol=0)
    for k, v in full["weights"].items():
        torch.testing.assert_close(res["weights"][k], v, rtol=1e-4, atol=1e-5)


def test_checkpoint_holds_full_tensors_by_name(runs):
    from shardwise.train.checkpoint.sharded import read_tensors

    at3 = read_tensors(runs / f"{TP}-full-w2" / "checkpoints" / "step-00000003")
    one = read_tensors(runs / "fsdp-full-w1" / "checkpoints" / "step-00000003")
    assert at3.keys() == one.keys()
    for k, v in one.items():
        assert at3[k].shape == v.shape, k  # whole tensors, not a rank's shard


def test_export_from_a_tp_checkpoint(runs, tmp_path):
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from shardwise.train.export.cli import app

    out = tmp_path / "hf"
    res = CliRunner().invoke(app, [str(runs / f"{TP}-full-w2"), str(out)])
    assert res.exit_code == 0, res.output
    final = load(runs, f"{TP}-full-w2")["weights"]
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == final.keys()
    for k, v in exported.items():
        assert torch.equal(v, final[k]), k
