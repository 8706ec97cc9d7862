"""`shardwise train examples/demo.yaml` end to end on 2 CPU ranks (shortened with --set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEMO_STEPS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3", "ddp"])
def test_demo_config_trains_and_writes_outputs(demo_run, strategy):
    """On each engine (tests/train/conftest.py `demo_run`: the whole job in a memory cgroup capped
    at the plan's own host figure for the node + 15%, shared with the progress-line tests), and
    rank 0's measured peak RSS within 15% of its planned peak."""
    run = demo_run(strategy)
    out = Path(run["out"])
    assert run["rc"] == 0, run["log"][-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, DEMO_STEPS + 1))
    assert all(row["tokens_per_s"] > 0 and row["grad_norm"] > 0 for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["planned_gpu_bytes"] > 0 and summary["planned_host_bytes"] == run["peak"]
    assert abs(summary["measured_memory_bytes"] / run["peak"] - 1) <= 0.15, (summary["measured_memory_bytes"], run)
    assert "planned per rank (host RSS)" in run["log"]
    # what ran it, as the checkpoint manifest and `shardwise --version` say
    from importlib.metadata import version

    assert summary["versions"]["shardwise"] == version("shardwise")
    assert summary["versions"]["torch"] == version("torch")
    manifests = sorted((out / "checkpoints").glob("step-*/manifest.json"))
    assert manifests and json.loads(manifests[-1].read_text())["versions"] == summary["versions"]
    assert any((out / "tensorboard").iterdir())
    from safetensors.torch import load_file

    weights = load_file(str(out / "model" / "model.safetensors"))
    assert "model.layers.1.mlp.down_proj.weight" in weights
    assert "summary" in run["log"]
    # the directory is a Hugging Face model: from_pretrained loads exactly these weights
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    state = model.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    assert AutoTokenizer.from_pretrained(out / "model").eos_token is not None
    # and gives the last checkpoint's logits: the same architecture filled with its saved tensors
    from shardwise.train.checkpoint.sharded import read_tensors, tensor_shapes

    last = Path(summary["checkpoint"])
    saved = {k.removeprefix("model."): v for k, v in read_tensors(last, [k for k in tensor_shapes(last)
                                                                          if k.startswith("model.")]).items()}
    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(saved, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.float().eval()(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_single_process_deepspeed_without_launcher(tmp_path):
    """`--nproc 1` trains in-process; DeepSpeed still finds RANK/LOCAL_RANK/WORLD_SIZE."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise.train.cli", str(REPO / "examples/fsdp-synthetic-cpu.yaml"),
           "--nproc", "1", "--set", "strategy.name=zero1", "--set", "run.steps=2",
           "--set", f"checkpointing.output_dir={out}", "--set", "logging.progress=false"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
