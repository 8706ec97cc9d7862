"""Activation offloading (`checkpointing.offload`): the tensors saved for backward copied to host
memory in forward and back in backward (shardwise.train.model.activation_offload).

- `shardwise train` (FSDP2, 2 ranks and 1; 8 steps; alone and with `checkpointing.activation:
  full`) trains exactly as without it: the same losses and grad norms (within 1e-6; measured
  equal), and summary.json says what it moved.
- A run resumed from its step-4 checkpoint ends with the same losses and the same checkpoint,
  every tensor bit-exact.
- What it moves, counted on 2 gloo ranks (tests/train/activation_offload_worker.py): the bytes it
  holds on the host at its peak in one micro-batch are the plan's change of `gpu.activations`
  (within 10%; and within 10% of it less the output layer's input, which the plan counts as
  moved and which stays, with full checkpointing too); backward frees all of it.
- Not refused where it was tried and runs: DeepSpeed ZeRO-3 with every parameter partitioned
  (its fetch and release hooks) trains the same losses, and compiled decoder layers (run.compile)
  give the same gradients with the hooks as without, from the same compiled graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.train.checkpoint.sharded import read_tensors

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"


def train(out: Path, *extra: str, steps: int = 8) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--set", f"run.steps={steps}",
            "--set", "checkpointing.save_final=false", "--set", f"checkpointing.output_dir={out}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})


def steps(out: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


def _same_training(tmp_path: Path, *extra: str, n: int = 8) -> dict:
    runs, summaries = {}, {}
    for mode in ("false", "true"):
        r = train(tmp_path / mode, *extra, "--set", f"checkpointing.offload={mode}", steps=n)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = steps(tmp_path / mode)
        summaries[mode] = json.loads((tmp_path / mode / "summary.json").read_text())
    plain, offloaded = runs["false"], runs["true"]
    assert sorted(plain) == sorted(offloaded) == list(range(1, n + 1))
    for s in plain:
        for ours, theirs in zip(offloaded[s], plain[s], strict=True):
            assert abs(ours - theirs) <= 1e-6 * abs(theirs), (s, offloaded[s], plain[s])
    assert "activation_offload" not in summaries["false"]
    return summaries["true"]["activation_offload"]


@pytest.mark.parametrize("activation", ["none", "full"])
@pytest.mark.parametrize("nproc", [2, 1])
def test_it_trains_as_without_it(tmp_path, nproc, activation) -> None:
    moved = _same_training(tmp_path, "--nproc", str(nproc), "--set", f"checkpointing.activation={activation}")
    assert moved["micro_batches"] == 8 * 2 and moved["bytes_per_micro_batch"] > 0  # 8 steps of 2 micro-batches
    assert moved["peak_host_bytes"] >= moved["bytes_per_micro_batch"]


def test_a_resumed_run_is_bit_exact(tmp_path) -> None:
    keep = ["--set", "checkpointing.offload=true", "--set", "checkpointing.save_every_steps=4",
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


def test_zero3_with_every_parameter_partitioned_trains_the_same(tmp_path) -> None:
    """ZeRO-3 gathers each layer's parameters in its pre-forward hook and releases them after,
    and again in backward: the hooks keep its parameters (never moved) and move the rest."""
    moved = _same_training(tmp_path, "--set", "strategy.name=zero3",
                           "--set", "strategy.deepspeed.param_persistence_threshold=0", n=4)
    assert moved["bytes_per_micro_batch"] > 0


@pytest.fixture(scope="module")
def measured():
    sys.path.insert(0, str(Path(__file__).parent))
    import activation_offload_worker

    from shardwise.bench import worker

    return worker.spawn_ranks(activation_offload_worker.rank_main, ["none", "full"], timeout_s=300)


@pytest.mark.parametrize("activation", ["none", "full"])
def test_the_bytes_it_moves_are_the_plans(measured, activation) -> None:
    """The bytes held on the host at the peak of one micro-batch against the plan's change of
    `gpu.activations` (plan.memory.offloaded_activations: every saved byte but one decoder
    layer's and lm_head's input, which lm_head saves for backward and which stays, as torchtune
    keeps its output layer), within 10%."""
    from shardwise.bench import worker
    from shardwise.plan.evaluate import memory_as_run

    run = worker.bench_run("fsdp")
    t, m = run.train, run.model

    def planned(offload: bool) -> float:
        train = t.model_copy(update={"activation_offload": offload, "checkpointing": activation})
        return memory_as_run(m, run.hardware, train, run.strategy).gpu.activations

    plan_saves = planned(False) - planned(True)
    for rank, r in enumerate(measured[activation]):
        assert r["moved"] == r["peak"] and r["after_backward"] == 0, (rank, r)
        assert abs(r["peak"] - plan_saves) <= 0.10 * plan_saves, (rank, r["peak"], plan_saves)


def test_compiled_layers_run_under_the_hooks() -> None:
    """run.compile with offloading: the same two compiled graphs (training and no-grad evaluation)
    as without it, nothing recompiled per micro-batch (the hooks are Python callables: dynamo
    neither inlines nor guards on them), and bit-equal losses and gradients; inductor's graphs
    save less, and what they save moves."""
    import torch._dynamo

    from shardwise.bench import worker
    from shardwise.run import run_spec
    from shardwise.train.engines.base import evaluate_loss_sum, forward_loss_sum
    from shardwise.train.model import activation_offload
    from shardwise.train.model.build import build_model

    torch.set_num_threads(1)
    results = {}
    for offload in (False, True):
        cfg = worker.bench_config("fsdp")
        cfg = cfg.model_copy(update={"checkpointing": cfg.checkpointing.model_copy(update={"offload": offload}),
                                     "run": cfg.run.model_copy(update={"compile": True, "compile_backend": "aot_eager"})})
        run = run_spec(cfg, 1, "cpu", environ={})
        assert run.train.fused_kernels and run.train.activation_offload == offload
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = build_model(run)
        losses = []
        for i in range(3):
            ids = torch.randint(0, run.model.vocab_size, (worker.BATCH, worker.SEQ),
                                generator=torch.Generator().manual_seed(i))
            batch = {"input_ids": ids, "labels": ids.clone()}
            loss = forward_loss_sum(model, model, batch, torch.device("cpu"), run.train)
            loss.backward()
            losses.append(loss.item())
            evaluate_loss_sum(model, model, batch, torch.device("cpu"), run.train)
        stats = activation_offload.stats(model)
        results[offload] = (losses, {n: p.grad for n, p in model.named_parameters()},
                            dict(torch._dynamo.utils.counters["stats"]), stats)
    (plain, plain_grads, plain_graphs, none), (ours, grads, graphs, stats) = results[False], results[True]
    assert none is None and stats.micro_batches == 3 and stats.last_bytes > 0 and stats.host_bytes == 0
    assert graphs == plain_graphs and graphs["unique_graphs"] == 2, (graphs, plain_graphs)
    assert ours == plain and all(torch.equal(grads[k], plain_grads[k]) for k in grads)


def test_plan_and_train_read_one_key() -> None:
    """--activation-offload is `checkpointing.offload`: plan's flag sets the TrainSpec field, the
    bridge reads it from the YAML, and a plan that offloads is written back as that key."""
    from typer.testing import CliRunner

    from shardwise.catalog import build_hardware, get_model
    from shardwise.cli.app import app
    from shardwise.config.load import load_config
    from shardwise.run import run_spec
    from shardwise.run.bridge import to_config
    from shardwise.specs import Strategy, TrainSpec

    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "-s", "fsdp",
                                 "--activation-offload", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["train"]["activation_offload"] is True
    assert run_spec(load_config(CONFIG, ["checkpointing.offload=true"]), 2, "cpu").train.activation_offload
    assert not run_spec(load_config(CONFIG), 2, "cpu").train.activation_offload
    model, hw = get_model("llama-3.1-8b"), build_hardware(gpu="h100-sxm", gpus=8)
    cfg, _ = to_config(model, hw, TrainSpec(activation_offload=True), Strategy.from_name("fsdp"))
    assert cfg.checkpointing.offload
    cfg, _ = to_config(model, hw, TrainSpec(), Strategy.from_name("fsdp"))
    assert not cfg.checkpointing.offload


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream path needs a CUDA device")
@pytest.mark.parametrize("activation", ["none", "full"])
def test_the_cuda_path_is_bit_exact(activation) -> None:
    """On a GPU: pinned host copies on the side stream, back on it in backward: bit-equal
    gradients, and every host copy freed after backward."""
    from shardwise.bench import worker
    from shardwise.run import run_spec
    from shardwise.train.engines.base import forward_loss_sum
    from shardwise.train.model import activation_offload
    from shardwise.train.model.build import build_model

    device = torch.device("cuda", 0)
    results = {}
    for offload in (False, True):
        cfg = worker.bench_config("fsdp")
        cfg = cfg.model_copy(update={"checkpointing": cfg.checkpointing.model_copy(
            update={"offload": offload, "activation": activation})})
        run = run_spec(cfg, 1, "cpu", environ={})
        model = build_model(run).to(device)
        ids = torch.randint(0, run.model.vocab_size, (worker.BATCH, worker.SEQ),
                            generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # the second micro-batch reuses the first one's pinned blocks
            model.zero_grad()
            loss = forward_loss_sum(model, model, {"input_ids": ids, "labels": ids.clone()}, device, run.train)
            loss.backward()
        torch.cuda.synchronize()
        results[offload] = ({n: p.grad.cpu() for n, p in model.named_parameters()},
                            activation_offload.stats(model))
    (plain, _), (grads, stats) = results[False], results[True]
    assert all(torch.equal(grads[k], plain[k]) for k in grads)
    assert stats.micro_batches == 2 and stats.last_bytes > 0 and stats.host_bytes == 0
