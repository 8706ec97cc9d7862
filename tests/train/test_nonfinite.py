"""Non-finite steps are skipped, counted and never published.

- every engine skips the update of a step whose global gradient norm is NaN or Inf: weights
  stay as they were, and the next finite step's gradient norm is the same on every engine (so
  AdamW's state was not touched either), on 2 gloo ranks (tests/train/nonfinite_worker.py);
  before, DDP, FSDP2 and DeepSpeed ZeRO-0 applied the step and every weight went NaN;
- the loop counts skipped steps against run.nonfinite_patience and ends with NonFiniteError
  (exit 3) when the patience runs out or when the last step was skipped, even within it;
- a checkpoint save refuses a non-finite state on any rank (every rank agrees), an export
  refuses non-finite weights, and lr = inf is refused before any rank starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HERE, run_once

from shardwise.errors import ExitCode, NonFiniteError

REPO = HERE.parent.parent
WORKER = HERE / "nonfinite_worker.py"
# `:fused`: fused AdamW skips on the device (found_inf), without a host sync (the CUDA default)
RUNS = ["ddp:fp32", "fsdp:fp32", "zero0:fp32", "zero1:fp32", "zero3:fp32", "zero2:bf16-mixed", "fsdp:bf16-mixed",
        "ddp:fp32:fused", "fsdp:fp32:fused", "fsdp:fp32:pp2"]  # pp2: two pipeline stages (gpipe)


@pytest.fixture(scope="module")
def engines(shared_dir) -> Path:
    return run_once(shared_dir / "nonfinite", WORKER, [([*RUNS, "save"], 2, 400)])


@pytest.mark.distributed
@pytest.mark.parametrize("run", RUNS)
def test_every_engine_skips_a_non_finite_update(engines, run):
    rec = json.loads((engines / f"{run.replace(':', '-')}.json").read_text())
    assert [r["scale"] for r in rec] == ["1.0", "nan", "inf", "1.0"]
    first, nan, inf, last = rec
    assert first["changed"] and first["finite"] and float(first["grad_norm"]) > 0
    for r in (nan, inf):  # NaN and Inf gradients: no update at all, weights finite
        assert not torch.isfinite(torch.tensor(float(r["grad_norm"]))), r
        assert not r["changed"] and r["finite"], (run, r)
    assert last["changed"] and last["finite"] and float(last["grad_norm"]) > 0


@pytest.mark.distributed
def test_the_step_after_skipped_ones_is_the_same_on_every_engine(engines):
    """fp32 engines (fused AdamW too): the finite step after two skipped ones has the same gradient
    norm everywhere, which it would not if any engine had moved weights or AdamW moments on a
    skipped step."""
    norms = {r: float(json.loads((engines / f"{r.replace(':', '-')}.json").read_text())[3]["grad_norm"])
             for r in RUNS if ":fp32" in r}  # fmt: skip
    ref = norms["ddp:fp32"]
    assert all(abs(n - ref) <= 1e-5 * ref for n in norms.values()), norms


@pytest.mark.distributed
def test_a_save_with_a_nan_on_one_rank_is_refused_on_every_rank(engines):
    for rank in (0, 1):
        outcome = (engines / f"save-agreement-rank{rank}.txt").read_text()
        assert outcome.startswith("NonFiniteError") and "no checkpoint was written" in outcome, outcome
    assert not list((engines / "save-agreement" / "checkpoints").glob("*"))  # no step-1, no temp dir


# --- the loop's decisions, in-process on one rank ------------------------------------------------


def _cfg(tmp_path: Path, steps: int, patience: int, save_every: int | None = None):
    from shardwise.config.schema import TrainConfig

    return TrainConfig.model_validate({
        "model": {"name": "tiny-llama", "attention": "eager"},
        "data": {"kind": "synthetic", "synthetic": {"samples": 64, "seq_len": 16, "seed": 7}},
        "strategy": {"name": "ddp"},
        "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0},
        "run": {"steps": steps, "micro_batch": 2, "grad_accum": 1, "seed": 3, "device": "cpu",
                "nonfinite_patience": patience},
        "checkpointing": {"output_dir": str(tmp_path), "save_every_steps": save_every, "save_every_minutes": None},
        "logging": {"progress": False, "tensorboard": False},
    })


def _train_with_nan_at(monkeypatch, cfg, bad_steps: set[int], *, stop=None, seen=None, resume=None):
    """train() on one rank, with the loss scale of the given steps (1-based) made NaN: their
    gradients are all NaN, the rest of the run is untouched. `seen["step"]`: the steps done."""
    import shardwise.train.loop as loop
    from shardwise.run import run_spec
    from shardwise.train.engines.base import DistEnv

    real_build = loop.build_engine
    seen = {"step": 0} if seen is None else seen

    def build(model, run, env):
        engine = real_build(model, run, env)
        real_fb, real_step = engine.forward_backward, engine.step

        def forward_backward(batch, scale):
            return real_fb(batch, float("nan") if seen["step"] + 1 in bad_steps else scale)

        def step():
            seen["step"] += 1
            return real_step()

        engine.forward_backward, engine.step = forward_backward, step
        return engine

    monkeypatch.setattr(loop, "build_engine", build)
    return loop.train(run_spec(cfg, 1, "cpu"), DistEnv(), export_weights=True, stop=stop, resume=resume)


def test_within_the_patience_a_nan_step_is_skipped_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    result = _train_with_nan_at(monkeypatch, _cfg(tmp_path, steps=5, patience=1, save_every=1), {3})
    norms = [r.grad_norm for r in result.records]
    assert [n != n for n in norms] == [False, False, True, False, False]  # step 3 only is NaN
    assert "grad norm nan: update skipped (1 of run.nonfinite_patience=1 consecutive)" in capsys.readouterr().out
    assert all(bool(torch.isfinite(v).all()) for v in result.final_weights.values())
    from shardwise.train.checkpoint.directory import checkpoints_dir
    from shardwise.train.checkpoint.sharded import read_tensors

    # step 3 was not checkpointed; every checkpoint written holds finite weights
    names = sorted(d.name for d in checkpoints_dir(tmp_path).glob("step-*"))
    assert "step-00000003" not in names and names[-1] == "step-00000005", names
    for d in checkpoints_dir(tmp_path).glob("step-*"):
        assert all(bool(torch.isfinite(t).all()) for t in read_tensors(d).values())


def test_past_the_patience_the_run_stops(tmp_path, monkeypatch):
    with pytest.raises(NonFiniteError, match=r"step 3: .*non-finite for 2 consecutive step\(s\) "
                       r"\(run.nonfinite_patience=1\)"):
        _train_with_nan_at(monkeypatch, _cfg(tmp_path, steps=6, patience=1), {2, 3})


def test_a_skipped_last_step_ends_the_run_non_finite_even_within_the_patience(tmp_path, monkeypatch):
    with pytest.raises(NonFiniteError, match=r"step 4 \(the last\).*1 skipped non-finite step\(s\) \(within "
                       r"run.nonfinite_patience=3\); nothing was exported"):
        _train_with_nan_at(monkeypatch, _cfg(tmp_path, steps=4, patience=3, save_every=2), {4})
    from shardwise.train.checkpoint.directory import checkpoints_dir

    assert sorted(d.name for d in checkpoints_dir(tmp_path).glob("step-*")) == ["step-00000002"]


def test_export_refuses_non_finite_weights(tmp_path):
    from shardwise.train.export.hf_dir import refuse_nonfinite

    with pytest.raises(NonFiniteError, match=r"refusing to export non-finite weights \(1 of 2 tensors, e.g. b\)"):
        refuse_nonfinite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}, tmp_path / "model")
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("value", [".inf", "inf", "nan", "-inf"])
def test_an_infinite_learning_rate_is_refused_before_any_rank_starts(tmp_path, value):
    argv = [sys.executable, "-m", "shardwise.train.cli", str(REPO / "examples" / "fsdp-synthetic-cpu.yaml"),
            "--set", f"checkpointing.output_dir={tmp_path / 'out'}", "--set", f"optimizer.lr={value}"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == ExitCode.USER_ERROR, r.stdout + r.stderr
    assert "optimizer.lr" in r.stderr and "finite" in r.stderr, r.stderr
    assert not (tmp_path / "out" / ".shardwise").exists()  # no rank started (none wrote a heartbeat)


def test_a_stop_right_after_a_skipped_step_saves_and_the_resumed_run_keeps_counting(tmp_path, monkeypatch):
    """A stop voted at the boundary after a skipped step: the checkpoint holds the state the skip
    left (the last finite step's) and says one step was skipped; the run resumed from it counts
    its next skipped step as the second in a row (patience 1: the run stops), as the uninterrupted
    run would."""
    import signal

    import shardwise.train.loop as loop
    from shardwise.train.checkpoint.directory import checkpoints_dir
    from shardwise.train.checkpoint.sharded import read_tensors

    real_build = loop.build_engine

    class Stop:
        requested = property(lambda self: seen["step"] >= 2)  # voted during step 3: stops after it
        signum = signal.SIGTERM

    seen = {"step": 0}
    cfg = _cfg(tmp_path, steps=6, patience=1)
    with pytest.raises(loop.Interrupted, match=r"after step 3: checkpoint .*step-00000003 \(step 3's update was "
                       r"skipped: .*its 1 skipped step\(s\)"):
        _train_with_nan_at(monkeypatch, cfg, {3}, stop=Stop(), seen=seen)
    ckpt = checkpoints_dir(tmp_path) / "step-00000003"
    assert json.loads((ckpt / "trainer_state.json").read_text())["nonfinite_streak"] == 1
    assert all(bool(torch.isfinite(t).all()) for t in read_tensors(ckpt).values())
    monkeypatch.setattr(loop, "build_engine", real_build)  # not the first run's wrapper
    seen["step"] = 3  # the resumed run's first step is step 4
    with pytest.raises(NonFiniteError, match=r"step 4: .*non-finite for 2 consecutive step\(s\)"):
        _train_with_nan_at(monkeypatch, cfg, {4}, seen=seen, resume=ckpt)
