"""Exact and portable resume (2 gloo ranks and 1, CPU, fp32).

Exact: a run resumed from its step-3 checkpoint reproduces the uninterrupted run's losses of
steps 4..8 and its final weights bit for bit, for every engine.
Portable: a checkpoint written by one strategy and world size resumes under another; the
losses continue the uninterrupted curve within 1e-5 (relative). Not bit-exact: the engines
sum gradients in different orders (bucketed all-reduce vs reduce-scatter vs one rank).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import run_once

from shardwise.train.checkpoint.sharded import read_tensors

HERE = Path(__file__).parent
WORKER = HERE / "resume_worker.py"
SAVE_EVERY = 3

EXACT = ("ddp", "fsdp", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def runs(shared_dir):
    """All resume runs: one 2-rank launch (full runs, then same-strategy and cross resumes),
    then one 1-rank launch (2 -> 1 rank resumes)."""
    two = [f"{s}:full" for s in EXACT]
    two += [f"{s}:resume:{s}-full-w2" for s in EXACT]
    two += ["fsdp:resume:zero2-full-w2", "zero3:resume:fsdp-full-w2", "fsdp:evalsave", "zero3:evalsave"]
    one = ["zero3:resume:fsdp-full-w2", "ddp:resume:zero3-full-w2", "fsdp:resume:ddp-full-w2"]
    # 2 -> 4 ranks (4 gloo processes on 2 cores: slower, still a few seconds of steps)
    return run_once(shared_dir / "resume", WORKER,
                    [(two, 2, 600), (one, 1, 300), (["fsdp:resume:zero2-full-w2"], 4, 300)])


def load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("strategy", EXACT)
def test_resume_is_bit_exact(runs, strategy):
    full = load(runs, f"{strategy}-full-w2")
    resumed = load(runs, f"{strategy}-resume-{strategy}-full-w2-w2")
    assert resumed["start_step"] == SAVE_EVERY
    assert len(full["losses"]) == 8 and len(resumed["losses"]) == 8 - SAVE_EVERY
    assert resumed["losses"] == full["losses"][SAVE_EVERY:]
    assert resumed["grad_norms"] == full["grad_norms"][SAVE_EVERY:]
    assert full["weights"].keys() == resumed["weights"].keys()
    for k, v in full["weights"].items():
        assert torch.equal(v, resumed["weights"][k]), k
    # training went on after the checkpoint (the final weights are not the step-3 ones)
    at3 = read_tensors(runs / f"{strategy}-full-w2" / "checkpoints" / "step-00000003")
    moved = max(float((at3[f"model.{k}"] - v).abs().max()) for k, v in full["weights"].items() if f"model.{k}" in at3)
    assert moved > 1e-4


@pytest.mark.parametrize(
    ("resumed", "source"),
    [
        ("fsdp-resume-zero2-full-w2-w2", "zero2-full-w2"),  # zero2 -> fsdp, 2 ranks
        ("zero3-resume-fsdp-full-w2-w2", "fsdp-full-w2"),  # fsdp -> zero3, 2 ranks
        ("zero3-resume-fsdp-full-w2-w1", "fsdp-full-w2"),  # fsdp 2 ranks -> zero3 1 rank
        ("ddp-resume-zero3-full-w2-w1", "zero3-full-w2"),  # zero3 2 ranks -> ddp 1 rank
        ("fsdp-resume-ddp-full-w2-w1", "ddp-full-w2"),  # ddp 2 ranks -> fsdp 1 rank
        ("fsdp-resume-zero2-full-w2-w4", "zero2-full-w2"),  # zero2 2 ranks -> fsdp 4 ranks
    ],
)
def test_resume_across_strategies_and_world_sizes(runs, resumed, source):
    full, res = load(runs, source), load(runs, resumed)
    assert res["start_step"] == SAVE_EVERY
    expect = torch.tensor(full["losses"][SAVE_EVERY:], dtype=torch.float64)
    got = torch.tensor(res["losses"], dtype=torch.float64)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=0)
    for k, v in full["weights"].items():
        torch.testing.assert_close(res["weights"][k], v, rtol=1e-4, atol=1e-5)


def test_manifest_lists_every_file_with_its_hash(runs):
    d = runs / "zero3-full-w2" / "checkpoints" / "step-00000003"
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["strategy"] == "zero3" and manifest["step"] == 3
    assert {"torch", "deepspeed", "shardwise"} <= manifest["versions"].keys()
    on_disk = {p.name for p in d.iterdir()} - {"manifest.json"}
    assert on_disk == set(manifest["files"])
    assert {"rank-00000.json", "rank-00001.json", ".metadata", "trainer_state.json"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (d / name).read_bytes()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert manifest["config"]["strategy"]["name"] == "zero3"


@pytest.mark.parametrize("source", ["fsdp-full-w2", "zero3-full-w2"])
def test_export_from_a_two_rank_checkpoint_on_one_process(runs, source, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from shardwise.train.export.cli import app

    out = tmp_path / "hf"
    res = CliRunner().invoke(app, [str(runs / source), str(out)])  # a run dir: its latest (step 8)
    assert res.exit_code == 0, res.output
    final = load(runs, source)["weights"]  # the engine's consolidated weights after step 8
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() <= final.keys() and len(exported) >= len(final) - 1  # a tied lm_head is stored once
    for k, v in exported.items():
        assert torch.equal(v, final[k]), k
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_config(model.config).eval()
    reference.load_state_dict(final, strict=False)
    reference.tie_weights()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    again = CliRunner().invoke(app, [str(runs / source), str(out)])
    assert again.exit_code == 2 and "--overwrite" in again.output
    merged = CliRunner().invoke(app, [str(runs / source), str(tmp_path / "m"), "--merged"])
    assert merged.exit_code == 2 and "no adapters to merge" in merged.output


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_save_after_an_evaluation_forward(runs, strategy):
    """A forward without backward leaves FSDP2's root unsharded; the save must still see the
    optimizer's sharded parameters, and the loaded engine computes the same outputs."""
    r = load(runs, f"{strategy}-evalsave-w2")
    assert r["before"] == r["after"]
