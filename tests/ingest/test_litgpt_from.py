"""`shardwise plan --from` a LitGPT finetune config YAML (shardwise.ingest.litgpt): verbatim files
read as `litgpt finetune lora|full` runs them (hand-written flags from LitGPT's source), the
config_hub table's rows planned from their own configs exactly as
benchmarks/published/litgpt-config-hub-finetune.yaml (curated from LitGPT's README and scripts, not
from this reader) plans them, and what LitGPT itself refuses.

tests/data/from/litgpt_*.yaml are Lightning-AI/litgpt config_hub/finetune/ files, verbatim:
llama-2-7b/{lora,qlora,full}.yaml at 5895df1004c3d05ef69f7aeffcfee757dbc42d58 and phi-3/lora.yaml at
f247be87eb110cab27b2342ca609040dd318f8a5 (the commits that wrote their rows of the README table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.ingest.test_plan_from import DATA, ROOT, plan, same
from typer.testing import CliRunner

from shardwise.cli.app import app

LORA = DATA / "litgpt_llama-2-7b_lora.yaml"
QLORA = DATA / "litgpt_llama-2-7b_qlora.yaml"
FULL = DATA / "litgpt_llama-2-7b_full.yaml"
PHI3 = DATA / "litgpt_phi-3_lora.yaml"


def test_lora_config():
    """devices 1: the bare module, no checkpointing; bf16-true; lora_r 32 on query and value with
    dropout 0.05; global 8 // 1 device // micro 2 = 4 micro-batches; seq 512; AdamW (torch's
    foreach) with the older TrainArgs' weight_decay 0.0; no clipping; the 128-token chunked loss."""
    src = same(["--from", str(LORA), "--gpu", "a10g"],
               ["-m", "llama-2-7b", "--gpu", "a10g", "--gpus", "1", "-s", "ddp", "--precision", "bf16-pure",
                "--micro-batch", "2", "--grad-accum", "4", "--seq-len", "512", "--checkpointing", "none",
                "--lora-rank", "32", "--lora-targets", "q_proj,v_proj", "--lora-dropout", "0.05",
                "--optimizer", "adamw", "--optimizer-impl", "foreach", "--weight-decay", "0", "--grad-pass", "none",
                "--cross-entropy", "chunked-output"])
    assert src["format_name"] == "LitGPT finetune config YAML"


def test_qlora_config_is_four_bit_with_a_fused_step():
    src = same(["--from", str(QLORA), "--gpu", "a10g"],
               ["-m", "llama-2-7b", "--gpu", "a10g", "--gpus", "1", "-s", "ddp", "--precision", "bf16-pure",
                "--micro-batch", "2", "--grad-accum", "4", "--seq-len", "512", "--checkpointing", "none",
                "--lora-rank", "32", "--lora-targets", "q_proj,v_proj", "--lora-dropout", "0.05", "--qlora",
                "--optimizer", "adamw", "--optimizer-impl", "fused", "--weight-decay", "0", "--grad-pass", "none",
                "--cross-entropy", "chunked-output"])
    assert any(k == "quantize" and "--qlora" in v for k, v in ((r["key"], r["as"]) for r in src["read"]))


def test_full_config_on_four_devices_is_fsdp_with_no_sync():
    """devices 4: FSDPStrategy, FULL_SHARD per Block, every Block checkpointed, the unsharded
    gradients held under no_sync and reduced in bf16; global 64 // 4 // micro 4 = 4."""
    same(["--from", str(FULL), "--gpu", "a10g"],
         ["-m", "llama-2-7b", "--gpu", "a10g", "--gpus", "4", "-s", "fsdp", "--precision", "bf16-pure",
          "--micro-batch", "4", "--grad-accum", "4", "--seq-len", "512", "--checkpointing", "full",
          "--fsdp-reshard-after-forward", "layers", "--fsdp-reduce-every-micro-batch", "false",
          "--fsdp-reduce-dtype", "param", "--lora-rank", "0", "--optimizer", "adamw", "--optimizer-impl", "foreach",
          "--weight-decay", "0.1", "--grad-pass", "none", "--cross-entropy", "chunked-output"])


def test_phi3_targets_are_its_fused_modules():
    src = plan("--from", str(PHI3), "--gpu", "a10g")
    assert src["train"]["lora_targets"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    warned = " ".join(src["from"]["warnings"])
    assert "lora_head is not planned" in warned  # lora_head: true, said first


def test_the_config_hub_rows_plan_from_their_own_configs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import accuracy

    from shardwise.plan.evaluate import evaluate

    rows = {r["name"]: r for r in accuracy.load_runs() if r["_source"]["id"] == "litgpt-config-hub-finetune"}
    for name, cfg in (("llama-2-7b/lora 1xA10G (README:33) lora r32", LORA),
                      ("llama-2-7b/qlora 1xA10G (README:35) lora r32", QLORA),
                      ("phi-3/lora 1xA10G (README:68) lora r8", PHI3),
                      ("llama-2-7b/full 4xA10G (README:32)", FULL)):
        model, hw, train, strategy = accuracy.build(rows[name])
        want = evaluate(model, hw, train, strategy)
        got = plan("--from", str(cfg), "--gpu", "a10g")["strategies"][0]
        assert got["memory"]["total"] == want.memory.gpu.total, name
        assert got["time"]["tokens_per_s_per_gpu"] == want.time.tokens_per_s_per_gpu, name


@pytest.mark.parametrize(("edit", "says"), [
    ({"devices": 2}, "NotImplementedError for quantize with more than one device"),
    ({"precision": "bf16-mixed"}, "Quantization and mixed precision is not supported"),
    ({"precision": "16-true"}, "16-true"),
    ({"quantize": "bnb.nf8"}, "quantize"),
])
def test_what_litgpt_refuses_is_refused_naming_the_key(tmp_path: Path, edit, says):
    import yaml

    d = yaml.safe_load(QLORA.read_text()) | edit
    f = tmp_path / "qlora.yaml"
    f.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["plan", "--from", str(f), "--gpu", "a10g"])
    assert r.exit_code != 0 and says in r.output and "qlora.yaml" in r.output, r.output


def test_an_adapter_config_and_a_batch_below_the_devices_are_refused(tmp_path: Path):
    import yaml

    d = yaml.safe_load(FULL.read_text())
    adapter = tmp_path / "adapter.yaml"
    adapter.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["plan", "--from", str(adapter)])
    assert r.exit_code != 0 and "LLaMA-Adapter" in r.output
    d["train"]["global_batch_size"] = 8  # 8 // 4 devices // micro 4 = 0
    small = tmp_path / "full.yaml"
    small.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["plan", "--from", str(small)])
    assert r.exit_code != 0 and "train.global_batch_size" in r.output and "gradient_accumulation_iters" in r.output


def test_user_command_as_a_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--from", str(LORA), "--gpu", "a10g", "--json"],
                       capture_output=True, text=True, timeout=300, check=False, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    doc = json.loads(r.stdout)
    assert doc["from"]["format"] == "litgpt" and doc["strategies"][0]["name"] == "ddp"
    assert doc["train"]["lora_dropout"] == 0.05
