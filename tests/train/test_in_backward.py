"""The optimizer step in backward (`optimizer.in_backward`): each parameter updated by its
post-accumulate-grad hook as soon as its gradient is final, the gradient then freed.

- `shardwise train` (FSDP2, 2 ranks and 1; 8 steps, no clipping, no accumulation) trains exactly
  as the stock step: the same losses (within 1e-6; measured equal) and grad norms within 1e-4
  (the squares are summed per parameter instead of by clip_grad_norm_'s foreach norm).
- A run resumed from its step-4 checkpoint ends with the same losses and the same checkpoint,
  every tensor bit-exact (weights and AdamW moments).
- What it saves, counted on the engine's tensors on 2 gloo ranks (tests/train/in_backward_worker.py):
  the gradient bytes a rank holds at its peak, stock minus in backward, within 10% of the plan's
  change of its `grads` term.
- Refused before any rank starts, naming the field: clipping by the global norm, accumulation,
  DeepSpeed, DDP's reducer, tensor parallelism, fp16; the planner refuses the same strategies
  (left out of a bare plan with the reason, refused when named) and never recommends them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint.sharded import read_tensors

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"
IN_BACKWARD = ["--set", "run.grad_accum=1", "--set", "optimizer.max_grad_norm=0", "--set", "checkpointing.save_final=false"]


def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--set", "run.steps=8", *IN_BACKWARD,
            "--set", f"checkpointing.output_dir={out}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})


def steps(out: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


@pytest.mark.parametrize("nproc", [2, 1])
def test_it_trains_as_the_stock_step(tmp_path, nproc) -> None:
    runs = {}
    for mode in ("false", "true"):
        r = train(tmp_path / mode, "--nproc", str(nproc), "--set", f"optimizer.in_backward={mode}")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = steps(tmp_path / mode)
    stock, ours = runs["false"], runs["true"]
    assert sorted(stock) == sorted(ours) == list(range(1, 9))
    for s in stock:
        assert abs(ours[s][0] - stock[s][0]) <= 1e-6 * abs(stock[s][0]), (s, ours[s], stock[s])
        assert abs(ours[s][1] - stock[s][1]) <= 1e-4 * abs(stock[s][1]), (s, ours[s], stock[s])


def test_a_resumed_run_is_bit_exact(tmp_path) -> None:
    keep = ["--set", "optimizer.in_backward=true", "--set", "checkpointing.save_every_steps=4",
            "--set", "checkpointing.keep_last=4"]
    r = train(tmp_path / "whole", *keep)
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(tmp_path / "half", *keep, "--set", "run.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(tmp_path / "half", *keep, "--resume", "latest")
    assert r.returncode == 0, r.stderr[-3000:]
    whole, half = steps(tmp_path / "whole"), steps(tmp_path / "half")
    assert [whole[s] for s in range(5, 9)] == [half[s] for s in range(5, 9)]
    a = read_tensors(tmp_path / "whole" / "checkpoints" / "step-00000008")
    b = read_tensors(tmp_path / "half" / "checkpoints" / "step-00000008")
    assert a.keys() == b.keys() and any(k.startswith("optim.exp_avg_sq.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_the_gradient_bytes_it_saves_are_the_plans(tmp_path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import in_backward_worker

    from shardwise.bench import worker
    from shardwise.plan.evaluate import memory_as_run

    measured = worker.spawn_ranks(in_backward_worker.rank_main, ["stock", "in_backward"], timeout_s=300)
    run = worker.bench_run("fsdp")

    def planned_grads(in_backward: bool) -> float:
        train = run.train.model_copy(update={"optimizer_in_backward": in_backward})
        return memory_as_run(run.model, run.hardware, train, run.strategy).gpu.grads

    plan_saves = planned_grads(False) - planned_grads(True)
    for rank in range(worker.WORLD):
        saves = measured["stock"][rank]["grad_peak"] - measured["in_backward"][rank]["grad_peak"]
        assert saves > 0 and abs(saves - plan_saves) <= 0.10 * plan_saves, (rank, saves, plan_saves, measured)


def _run(**changes):
    from shardwise.config.load import load_config
    from shardwise.run import run_spec

    sets = [f"{k}={v}" for k, v in ({"optimizer.in_backward": "true", "optimizer.max_grad_norm": "0",
                                     "run.grad_accum": "1"} | changes).items()]
    cfg = load_config(CONFIG, sets)
    return run_spec(cfg, 2, "cpu")


@pytest.mark.parametrize(("changes", "says"), [
    ({"optimizer.max_grad_norm": "1.0"}, r"nothing can clip by the global norm: set optimizer\.max_grad_norm: 0"),
    ({"strategy.name": "zero3"}, r"DeepSpeed's engine owns the optimizer step \(zero3\).*\(strategy\.name 'zero3'"),
    ({"strategy.name": "ddp"}, r"DDP keeps every gradient in its reducer's buckets"),
    ({"strategy.tp": "2"}, r"not run with tensor or pipeline parallelism \(tp 2, pp 1\)"),
    ({"precision": "fp16-mixed"}, r"cannot run under fp16: its loss scaling"),
])
def test_what_it_cannot_run_is_refused_naming_the_field(changes, says) -> None:
    from shardwise.train.preflight import check_in_backward

    with pytest.raises(ShardwiseError, match=says):
        check_in_backward(_run(**changes))


def test_accumulation_is_refused_by_plan_and_train_alike(tmp_path) -> None:
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    with pytest.raises(ShardwiseError, match=r"run\.grad_accum\) must be 1, not 2"):
        _run(**{"run.grad_accum": "2"})
    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "-s", "fsdp",
                                 "--optimizer-in-backward", "--grad-accum", "4"])
    assert r.exit_code == 2 and "--grad-accum; YAML run.grad_accum) must be 1, not 4" in r.output
    r = train(tmp_path / "out", "--set", "optimizer.in_backward=true", "--set", "run.grad_accum=2")
    assert r.returncode == 2 and f"{CONFIG}: the optimizer step in backward" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_planner_plans_it_where_the_trainer_runs_it() -> None:
    """A bare plan leaves the DeepSpeed strategies out with the reason, a named one is refused,
    and the recommendation is a strategy the trainer runs it with (llama-3.1-8b on 8 GPUs)."""
    from shardwise.catalog import build_hardware, get_model
    from shardwise.plan.planner import plan_layouts
    from shardwise.plan.recommend import recommend
    from shardwise.specs import TrainSpec

    model, hw = get_model("llama-3.1-8b"), build_hardware(gpu="h100-sxm", gpus=8)
    train = TrainSpec(micro_batch=1, optimizer_in_backward=True)
    plans, left_out = plan_layouts(model, hw, train)
    assert {e.strategy.engine for e in plans} == {"fsdp2"}
    assert "ddp" in left_out and all(n.startswith("zero") or n == "ddp" for n in left_out), sorted(left_out)
    assert all("DeepSpeed's engine owns the optimizer step" in left_out[n] for n in left_out if n != "ddp")
    assert "reducer's buckets" in left_out["ddp"]
    with pytest.raises(ShardwiseError, match=r"--optimizer-in-backward with zero3: DeepSpeed's engine owns"):
        plan_layouts(model, hw, train, ["zero3"])
    best = recommend(model, hw, train).best
    assert best.strategy.engine == "fsdp2" and best.train.grad_accum == 1 and best.train.optimizer_in_backward


def test_the_recommender_reaches_for_it_before_it_says_nothing_fits() -> None:
    """A 1.5B model on one 24 GB RTX 4090 with 16 GB of host memory: no configuration fits with
    the stock optimizer step (offload needs more host memory); the recommendation is one that
    steps in backward, says so, and is what --emit writes."""
    from shardwise.catalog import build_hardware
    from shardwise.plan.recommend import recommend, runnable, sweep
    from shardwise.run.bridge import to_config
    from shardwise.specs import ModelSpec, TrainSpec

    model = ModelSpec.from_params(1.5e9)
    hw = build_hardware(gpu="rtx-4090", gpus=1, host_memory_bytes=16e9)
    assert not [e for e in sweep(model, hw, TrainSpec()) if runnable(e) and e.fits]
    rec = recommend(model, hw, TrainSpec())
    assert rec.best.fits and rec.runnable and rec.best.train.optimizer_in_backward
    assert rec.best.train.grad_accum == 1
    assert "It fits only with the optimizer step in backward (--optimizer-in-backward" in rec.reason
    cfg, _ = to_config(model, hw, rec.best.train, rec.best.strategy)
    assert cfg.optimizer.in_backward and cfg.optimizer.max_grad_norm == 0 and cfg.run.grad_accum == 1


def test_its_step_time_adds_one_launch_per_parameter_tensor() -> None:
    """Time: the same update kernels, but one optimizer per tensor launches the fused AdamW once
    per tensor. Llama-3.1-8B has 32 × 9 + 3 = 291 parameter tensors (per layer q, k, v, o, gate,
    up, down and two norms; the embedding, the final norm and lm_head); one unwrapped DDP replica
    on one H100 has no communication to overlap, so against a step that runs no pass over the
    gradients either the step grows by exactly 291 launches. Against the default, which clips by
    the global norm (reading every fp32 gradient for the norm, then scaling it in place: 12 bytes
    a parameter at the GPU's streaming bandwidth), it also saves that pass, which nothing can run
    when each parameter steps as its gradient is final."""
    from shardwise.catalog import build_hardware, get_model
    from shardwise.plan.evaluate import evaluate
    from shardwise.specs import Strategy, TrainSpec

    model, hw = get_model("llama-3.1-8b"), build_hardware(gpu="h100-sxm", gpus=1)
    ddp = Strategy.from_name("ddp")
    launches = 291 * hw.timing.launch_s

    def step(**train) -> float:
        return evaluate(model, hw, TrainSpec(micro_batch=1, **train), ddp).time.step_s

    assert step(optimizer_in_backward=True) - step(grad_pass="none") == pytest.approx(launches, rel=1e-9)
    clip = 12 * model.params / (hw.gpu.hbm_bytes_per_s * hw.gpu.hbm_efficiency)
    assert step(optimizer_in_backward=True) - step() == pytest.approx(launches - clip, rel=1e-6)
