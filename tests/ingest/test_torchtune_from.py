"""`shardwise plan --from` a torchtune recipe config: each file plans what the same run given as
flags plans, the flags written here from torchtune's recipes (pytorch/torchtune, cited in
shardwise/ingest/torchtune.py), and the README's measured rows are planned from their own configs
as benchmarks/published/torchtune-readme-2024-11.yaml (curated from the README, not from this
reader) plans them.

The files in tests/data/from/ are verbatim torchtune configs: tt_llama3_1_8B_lora_single_device.yaml
and tt_llama3_1_8B_full_single_device.yaml are recipes/configs/llama3_1/ at commit 1814feb (the
README's table's commit); tt_llama3_1_8B_full.yaml, tt_llama3_1_405B_qlora.yaml,
tt_llama3_1_8B_lora_dpo.yaml and tt_llama3_2_8B_to_1B_KD_lora_single_device.yaml are
recipes/configs/llama3_1/ and llama3_2/ at commit 9d20413.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.ingest.test_plan_from import DATA, ROOT, plan, same
from typer.testing import CliRunner

from shardwise.cli.app import app

LORA_8B = DATA / "tt_llama3_1_8B_lora_single_device.yaml"
FULL_8B_1GPU = DATA / "tt_llama3_1_8B_full_single_device.yaml"
FULL_8B = DATA / "tt_llama3_1_8B_full.yaml"
QLORA_405B = DATA / "tt_llama3_1_405B_qlora.yaml"
LORA_DPO = DATA / "tt_llama3_1_8B_lora_dpo.yaml"
KD = DATA / "tt_llama3_2_8B_to_1B_KD_lora_single_device.yaml"

# torchtune's LoRA names -> PEFT's: q_proj, v_proj, output_proj (o_proj), and apply_lora_to_mlp's
# w1, w3, w2 (gate_proj, up_proj, down_proj)
LLAMA_LORA = "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# every recipe trains in its dtype (bf16: no fp32 master) and scales each gradient by 1/tokens
TORCHTUNE = ["--precision", "bf16-pure", "--grad-pass", "scale", "--no-activation-offload"]
# the distributed recipes' fully_shard (torchtune/training/_distributed.py shard_model): every
# decoder layer resharded, the root kept (reshard_after_forward=False on it), no mixed-precision
# policy (gradients reduced in bf16), a reduce-scatter every micro-batch
FSDP = ["-s", "fsdp", "--fsdp-reshard-after-forward", "layers", "--fsdp-reduce-dtype", "param",
        "--fsdp-reduce-every-micro-batch", "true"]


def refused(*args: str) -> str:
    r = CliRunner().invoke(app, ["plan", *args])
    assert r.exit_code == 2, r.output
    return " ".join(r.output.split())


def test_lora_single_device_config():
    src = same(["--from", str(LORA_8B), "--gpu", "rtx-4090", "--seq-len", "2048"],
               ["-m", "llama-3.1-8b", "-s", "ddp", "--gpus", "1", "--gpu", "rtx-4090", "--seq-len", "2048",
                "--micro-batch", "2", "--grad-accum", "8", *TORCHTUNE, "--lora-rank", "8", "--lora-targets",
                LLAMA_LORA, "--optimizer", "adamw", "--optimizer-impl", "fused", "--weight-decay", "0.01",
                "--cross-entropy", "chunked-output", "--checkpointing", "full"])
    assert src["format"] == "torchtune"
    assert any("max_seq_len is null" in w for w in src["warnings"])
    assert {"checkpointer", "lr_scheduler", "metric_logger"} <= {i["key"] for i in src["read"]}
    assert src["ignored"] == []


def test_full_single_device_optimizer_in_backward():
    src = same(["--from", str(FULL_8B_1GPU), "--gpu", "rtx-4090", "--seq-len", "2048"],
               ["-m", "llama-3.1-8b", "-s", "ddp", "--gpus", "1", "--gpu", "rtx-4090", "--seq-len", "2048",
                "--micro-batch", "2", "--grad-accum", "1", *TORCHTUNE, "--optimizer", "paged_adamw8bit",
                "--weight-decay", "0.01", "--optimizer-in-backward", "--grad-pass", "none", "--cross-entropy",
                "chunked-output",
                "--checkpointing", "full"])
    assert any(i["key"] == "optimizer_in_bwd" for i in src["read"])


def test_distributed_full_config_shards_embeddings_apart():
    src = same(["--from", str(FULL_8B), "--gpu", "a100-80g", "--gpus", "8", "--seq-len", "4096"],
               ["-m", "llama-3.1-8b", *FSDP, "--fsdp-reshard-after-forward", "all", "--fsdp-wrap-embeddings",
                "--gpu", "a100-80g", "--gpus", "8",
                "--seq-len", "4096", "--micro-batch", "2", "--grad-accum", "1", *TORCHTUNE, "--optimizer", "adamw",
                "--optimizer-impl", "fused", "--weight-decay", "0.01", "--cross-entropy", "chunked-output",
                "--checkpointing", "full"])
    # custom_sharded_layers: the embedding and the head are units of their own, resharded as the
    # layers are; the root keeps only the final norm
    assert {"wrap_embeddings": True, "reshard_after_forward": "all"}.items() <= src["knobs"]["fsdp"].items()


def test_qlora_405b_config():
    src = same(["--from", str(QLORA_405B), "--gpu", "a100-80g", "--gpus", "8", "--seq-len", "2048"],
               ["-m", "llama-3.1-405b", *FSDP, "--gpu", "a100-80g", "--gpus", "8", "--seq-len", "2048",
                "--micro-batch", "1", "--grad-accum", "8", *TORCHTUNE, "--lora-rank", "16", "--lora-targets",
                LLAMA_LORA, "--qlora", "--optimizer", "adamw", "--optimizer-impl", "fused", "--weight-decay", "0.01",
                "--cross-entropy", "chunked-output", "--checkpointing", "full"])
    assert any(i["key"] == "fsdp" and "no recipe reads it" in i["as"] for i in src["read"])


def test_lora_dpo_reference_is_the_base_without_adapters():
    src = same(["--from", str(LORA_DPO), "--gpu", "a100-80g", "--gpus", "8"],
               ["-m", "llama-3.1-8b", *FSDP, "--gpu", "a100-80g", "--gpus", "8", "--seq-len", "1024",
                "--micro-batch", "4", "--grad-accum", "8", *TORCHTUNE, "--lora-rank", "8", "--lora-targets",
                LLAMA_LORA, "--optimizer", "adamw", "--optimizer-impl", "fused", "--weight-decay", "0.05",
                "--objective", "dpo", "--reference", "adapters_off", "--checkpointing", "full"])
    assert src["values"]["objective"] == "dpo"


def test_knowledge_distillation_is_refused_naming_the_key():
    out = refused("--from", str(KD))
    assert "tt_llama3_2_8B_to_1B_KD_lora_single_device.yaml:30: teacher_model" in out
    assert "knowledge distillation" in out


def _written(text: str) -> Path:
    f = Path(tempfile.mkdtemp()) / "tt.yaml"
    f.write_text(text)
    return f


def test_bad_values_are_refused_naming_line_and_key():
    base = "model:\n  _component_: torchtune.models.llama3_1.llama3_1_8b\nbatch_size: 2\n"
    assert "tt.yaml:4: dtype = 'fp16': expected bf16 or fp32" in refused("--from", str(_written(base + "dtype: fp16\n")))
    out = refused("--from", str(_written(base.replace("llama3_1_8b", "llama4_scout_17b_16e"))))
    assert "tt.yaml:2: model._component_" in out and "pass --model" in out
    out = refused("--from", str(_written(base + "optimizer:\n  _component_: torchao.optim.CPUOffloadOptimizer\n")))
    assert "optimizer._component_" in out and "not plannable" in out
    out = refused("--from", str(_written(base + "gradient_accumulation_steps: 4\noptimizer_in_bwd: True\n"
                                                "optimizer:\n  _component_: torch.optim.AdamW\n")))
    assert "optimizer_in_bwd" in out and "gradient_accumulation_steps 1" in out
    out = refused("--from", str(_written(base + "dataset:\n  packed: True\n")))
    assert "tokenizer.max_seq_len" in out and "packs rows to max_seq_len" in out


def test_packed_fp8_and_offloading_keys(tmp_path: Path):
    cfg = tmp_path / "8B_full.yaml"
    cfg.write_text(FULL_8B.read_text() + "\nenable_fp8_training: True\nfp8_recipe_name: rowwise\n"
                   .replace("\n", "\n", 1))
    text = cfg.read_text().replace("packed: False", "packed: True").replace("max_seq_len: null", "max_seq_len: 4096")
    text = text.replace("enable_activation_offloading: False", "enable_activation_offloading: True")
    text = text.replace("compile: False", "compile: True").replace("fsdp_cpu_offload: False", "")
    cfg.write_text(text)
    doc = plan("--from", str(cfg), "--gpu", "h100-sxm", "--gpus", "8")
    v = doc["from"]["values"]
    assert (v["seq_len"], v["packed_attention"], v["fp8"]) == (4096, "flex", "rowwise")
    assert v["activation_offload"] is True and v["fused_kernels"] is True


def test_the_readme_rows_plan_from_their_own_configs():
    # the README's table ran these configs with batch 2, no accumulation, sequences packed to 2048
    # and compile on; benchmarks/published plans the rows from the README's words, packing aside
    # (planned there as one document a row): the same plan from the config with those overrides
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import accuracy

    from shardwise.plan.evaluate import evaluate

    rows = {r["name"]: r for r in accuracy.load_runs() if r["_source"]["id"] == "torchtune-readme-2024-11"}
    for name, cfg in (("llama3.1-8b lora r8 4090x1 b2 seq2048 packed compile", LORA_8B),
                      ("llama3.1-8b full 4090x1 b2 seq2048 optimizer-in-bwd paged-adamw8bit", FULL_8B_1GPU)):
        model, hw, train, strategy = accuracy.build(rows[name])
        want = evaluate(model, hw, train, strategy)
        got = plan("--from", str(cfg), "--gpu", "rtx-4090", "--seq-len", "2048", "--grad-accum", "1",
                   "--fused-kernels")["strategies"][0]
        assert got["memory"]["total"] == want.memory.gpu.total, name
        assert got["time"]["tokens_per_s_per_gpu"] == want.time.tokens_per_s_per_gpu, name


def test_user_command_as_a_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--from", str(QLORA_405B), "--gpu",
                        "a100-80g", "--gpus", "8", "--seq-len", "2048", "--json"],
                       capture_output=True, text=True, timeout=300, check=False, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    doc = json.loads(r.stdout)
    assert doc["from"]["format_name"] == "torchtune recipe config YAML"
    assert doc["strategies"][0]["name"] == "fsdp"
