"""QLoRA: refused clearly where it cannot run; trained on CPU through bitsandbytes' CPU kernels
(2 gloo ranks); and on a CUDA machine a 20-step run on the qwen2.5-0.5b shape whose loss falls and whose peak allocated
memory is the plan's (the GPU test is skipped without CUDA: CI has none)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.train.model.lora import check_qlora, qlora_strategies


def _cfg(strategy: str = "ddp", **extra) -> TrainConfig:
    return TrainConfig.model_validate({"strategy": {"name": strategy}, "source": "q.yaml",
                                       "lora": {"rank": 8, "quantization": "nf4"}} | extra)


def test_qlora_refused_where_bitsandbytes_has_no_kernels(monkeypatch):
    import shardwise.train.model.lora as lora

    check_qlora(_cfg(), "cpu")  # bitsandbytes 0.50+ (the test extras) quantises on CPU
    monkeypatch.setattr(lora, "nf4_supported", lambda device: False)
    with pytest.raises(ShardwiseError, match=r"q\.yaml: lora\.quantization 'nf4': the installed bitsandbytes "
                       r"\S+ cannot quantise to NF4 on cpu"):
        check_qlora(_cfg(), "cpu")


QLORA_RUNS = ["tiny-llama:ddp:1:repeat:qlora", "tiny-llama:zero2:2:repeat:qlora"]


@pytest.fixture(scope="module")
def qlora_runs(ranks_runner):
    return ranks_runner(QLORA_RUNS, nproc=2)


def test_qlora_trains_on_cpu_on_two_engines(qlora_runs):
    """NF4 base through bitsandbytes' CPU kernels, adapters trained under DDP and ZeRO-2 (GA 1
    and 2): the loss falls, the two agree to bf16 accuracy, and the base stays 4-bit."""
    from parity_worker import parity_config

    from shardwise.run import run_spec
    from shardwise.train.model.build import build_model

    ddp, zero2 = (torch.load(qlora_runs / f"{r.replace(':', '-')}-w2.pt") for r in QLORA_RUNS)
    assert ddp["losses"][-1] < ddp["losses"][0] - 0.2, ddp["losses"]
    assert max(abs(a - b) / b for a, b in zip(ddp["losses"], zero2["losses"], strict=True)) < 2e-3
    model = build_model(run_spec(parity_config("ddp", 1, 1, flags=("qlora",)), 1, "cpu"))
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("base_layer")}
    assert kinds == {"Linear4bit"}
    w = ddp["weights"]
    assert all(v.dtype == torch.uint8 for k, v in w.items() if k.endswith("base_layer.weight"))
    assert all(v.dtype == torch.float32 for k, v in w.items() if ".lora_" in k)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp", "fsdp-grad-op", "zero3+full-offload", "fsdp+offload"])
def test_qlora_refused_where_parameters_are_sharded(strategy):
    with pytest.raises(ShardwiseError, match=f"strategy '{strategy.replace('+', '[+]')}' shards"):
        check_qlora(_cfg(strategy), "cuda")


def test_qlora_strategies_are_the_replicated_ones_the_planner_ranks():
    """The trainer's list and the recommender's rule agree (one is derived, the other checked)."""
    from shardwise.catalog import get_model
    from shardwise.plan.planner import build_specs, plan_strategies
    from shardwise.plan.recommend import runnable

    assert {"ddp", "zero2"} <= set(qlora_strategies()) and not {"zero3", "fsdp"} & set(qlora_strategies())
    m, hw, train = build_specs(model="qwen2.5-0.5b", gpus=2, lora_rank=8, base_quant="nf4")
    assert m == get_model("qwen2.5-0.5b")
    evals = {e.strategy.name: e for e in plan_strategies(m, hw, train)}
    assert {n for n, e in evals.items() if runnable(e)} == set(qlora_strategies())


def test_qlora_base_is_smaller_in_the_plan():
    """NF4 stores the decoder linears in ~0.52 bytes instead of 2: the planned params shrink by
    about that ratio on those weights (the rest stays bf16)."""
    from shardwise.plan.lora import linear_weight_params
    from shardwise.plan.planner import build_specs, plan_strategies

    out = {}
    for quant in ("none", "nf4"):
        m, hw, train = build_specs(model="llama-2-7b", gpus=1, lora_rank=16, base_quant=quant)
        out[quant] = plan_strategies(m, hw, train, ["ddp"])[0].memory.gpu.params
    saved = out["none"] - out["nf4"]
    linears = linear_weight_params(m)
    assert saved == pytest.approx(linears * (2 - 0.5 - 1 / 64 - 4 / (64 * 256)), rel=1e-9)
    # Llama-2-7B: the decoder linears are Ψ less embeddings, lm_head and the norms
    assert linears == m.params - 2 * 32000 * 4096 - (2 * 32 + 1) * 4096


def _cuda_and_bnb() -> bool:
    try:
        import bitsandbytes  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_and_bnb(), reason="QLoRA needs a CUDA GPU and bitsandbytes")
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_qlora_trains_on_gpu_within_plan(tmp_path, strategy):
    """qwen2.5-0.5b shape (random init: no hub), NF4 base, rank 16 on every linear, seq 512 ×
    micro-batch 4, 20 steps on one repeated batch: the loss falls and the peak allocated memory
    is within 15% of the planned allocated figure."""
    from shardwise.plan.evaluate import memory_as_run
    from shardwise.run import run_spec

    out = tmp_path / "run"
    raw = {
        "name": "qlora-gpu", "model": {"name": "qwen2.5-0.5b"}, "precision": "bf16-mixed",
        "data": {"kind": "synthetic", "synthetic": {"samples": 4, "seq_len": 512}},
        "strategy": {"name": strategy}, "optimizer": {"lr": 2e-4},
        "run": {"steps": 20, "micro_batch": 4, "nproc": 1, "device": "cuda"},
        "lora": {"rank": 16, "target_modules": "all-linear", "quantization": "nf4"},
        "checkpointing": {"output_dir": str(out), "save_every_minutes": None, "save_on_interrupt": False},
        "logging": {"progress": False, "tensorboard": False}, "hardware": {"gpu": "h200"},
    }
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli.app", "train", str(path)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses
    summary = json.loads((out / "summary.json").read_text())
    run = run_spec(TrainConfig.model_validate(raw), 1, "cuda", environ={})
    planned = memory_as_run(run.model, run.hardware, run.train, run.strategy).gpu.allocated
    measured = summary["measured_memory_bytes"]
    assert abs(measured - planned) <= 0.15 * measured, (measured, planned)
