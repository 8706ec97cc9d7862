"""`shardwise plan --tp 2 ... --emit` writes a shardwise YAML with `strategy.tp: 2` that `shardwise
train` runs on 2 CPU ranks as planned, and the refusals of what TP does not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from shardwise.errors import ShardwiseError

pytestmark = pytest.mark.distributed


# (the sweep's own pick: FSDP2 × TP, run as TP alone on one data rank), and ZeRO-2 × TP: DeepSpeed's AutoTP
@pytest.mark.parametrize(("strategies", "note"), [
    ([], "tensor parallelism alone"),
    (["-s", "zero2"], "DeepSpeed's AutoTP over 2 ranks, ZeRO over 1 data-parallel rank(s), planned as such"),
])  # fmt: skip
def test_plan_tp_emit_then_train_on_two_ranks(tmp_path, strategies, note):
    from typer.testing import CliRunner

    from shardwise.cli.app import app
    from shardwise.data import sample_data_path

    emit = tmp_path / "emit"
    r = CliRunner().invoke(app, ["plan", "--json", "-m", "tiny-llama", "--gpu", "h100-sxm", "--gpus", "2", "--tp", "2",
                                 "--seq-len", "128", *strategies, "--emit", str(emit)])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output[r.output.index("{"):])
    setting = doc["recommended_setting"]
    assert setting["tp"] == 2 and setting["runnable"] is True and setting["tool"] == "shardwise train"
    cfg = yaml.safe_load((emit / "shardwise.yaml").read_text())
    assert cfg["strategy"]["tp"] == 2 and cfg["strategy"]["name"].startswith("zero2" if strategies else "fsdp")
    assert not (emit / "accelerate.yaml").exists()  # accelerate would not apply the TP plan
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise.train.cli", str(emit / "shardwise.yaml"), "--nproc", "2",
           "--set", "run.device=cpu", "--set", "run.steps=3", "--set", "model.path=",
           "--set", f"data.sft.train_files=[{sample_data_path()}]", "--set", f"checkpointing.output_dir={out}",
           "--set", "logging.progress=false"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert note in " ".join((res.stdout + res.stderr).split())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["grad_norm"] > 0 for row in rows)


def _run(tmp_path, strategy: str, world: int, **extra):
    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec

    raw = {"model": {"name": extra.pop("model", "tiny-llama")}, "strategy": {"name": strategy, "tp": 2},
           "run": {"device": "cpu"}} | extra
    return run_spec(TrainConfig.model_validate(raw), world, "cpu")


@pytest.mark.parametrize(("strategy", "world", "extra", "needle"), [
    ("fsdp", 2, {"lora": {"rank": 4}}, "LoRA with tensor parallelism is not supported"),
    ("fsdp", 2, {"lora": {"rank": 4, "quantization": "nf4"}}, "QLoRA (an nf4 base) with tensor parallelism"),
    ("zero3", 4, {}, "AutoTP with ZeRO-1 or ZeRO-2"),
    ("zero2+opt-offload", 4, {}, "CPU offload with tensor parallelism is not supported; use strategy zero1 or zero2"),
    ("zero1", 2, {"precision": "fp16-mixed"}, "fp16 loss scaler under AutoTP"),
    ("zero2", 4, {"lora": {"rank": 4}}, "LoRA with tensor parallelism is not supported"),
    ("ddp", 4, {}, "DDP does not take DTensor parameters"),
    ("fsdp+offload", 2, {}, "CPU offload with tensor parallelism"),
    ("fsdp", 2, {"model": "tiny-mixtral"}, "covers families llama, qwen2, mistral, not 'mixtral'"),
    ("fsdp", 3, {}, "tp 2 × pp 1 = 2 does not divide the 3 GPUs"),
])  # fmt: skip
def test_what_tp_does_not_run_is_refused_before_any_rank(tmp_path, strategy, world, extra, needle):
    with pytest.raises(ShardwiseError, match=r"strategy\.tp 2") as e:
        _run(tmp_path, strategy, world, **extra)
    assert needle in str(e.value)
