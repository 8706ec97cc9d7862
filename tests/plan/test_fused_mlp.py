"""A gated MLP's activation and product as one kernel (`--fused-mlp`: Liger's SwiGLU, whose
LigerSiLUMulFunction saves gate and up and recomputes act(gate) in backward,
linkedin/Liger-Kernel@3baaa6b src/liger_kernel/ops/swiglu.py). Expected figures derived by hand
from Llama 3.1 8B's config (intermediate 14336, 32 layers) and what each kernel reads and writes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.plan.evaluate import evaluate
from shardwise.plan.planner import build_specs
from shardwise.specs import Strategy

INTER, LAYERS, BF16 = 14336, 32, 2
DATA = Path(__file__).parents[1] / "data" / "from"


def _eval(fused: bool, model: str = "llama-3.1-8b"):
    m, hw, t = build_specs(model=model, gpu="h100-sxm", gpus=8, seq_len=2048, micro_batch=2, precision="bf16-mixed",
                           checkpointing="none", fused_mlp=fused)
    return evaluate(m, hw, t, Strategy.from_name("fsdp", fsdp={"reduce_every_micro_batch": True}))


def test_the_fused_kernel_does_not_keep_act_gate():
    """Eager SwiGLU keeps gate, act(gate), up and the product; the fused kernel gate and up, and
    down_proj the product: one intermediate-wide bf16 tensor fewer a token and layer."""
    eager, fused = _eval(False), _eval(True)
    tokens = 2 * 2048
    assert eager.memory.gpu.activations - fused.memory.gpu.activations == LAYERS * tokens * INTER * BF16


def test_a_gpt_mlp_has_no_gate_to_fuse():
    """MPT's fc1 → GeLU → fc2 has no gated product: Liger's SwiGLU does not apply."""
    assert _eval(False, "mpt-7b").memory.gpu.activations == _eval(True, "mpt-7b").memory.gpu.activations


def test_liger_keys_are_read_as_liger_runs():
    """axolotl's LigerPlugin keys: liger_rms_norm → --fused-norm, liger_glu_activation → --fused-mlp,
    liger_fused_linear_cross_entropy → --cross-entropy fused (examples/llama-3/3b-fp8-fsdp2.yaml)."""
    r = CliRunner().invoke(app, ["plan", "--from", str(DATA / "axolotl_3b_fp8_fsdp2.yaml"), "--gpu", "h100-sxm",
                                 "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["train"]["fused_norm"], doc["train"]["fused_mlp"], doc["train"]["cross_entropy"]) == (True, True, "fused")
    assert "--fused-mlp" in doc["from"]["as_flags"]


def test_use_liger_kernel_turns_on_liger_defaults(tmp_path: Path):
    """HF TrainingArguments(use_liger_kernel=True) applies Liger with its defaults (rope, rms_norm,
    swiglu, fused linear cross-entropy: apply_liger_kernel_to_llama's signature)."""
    f = tmp_path / "args.json"
    f.write_text(json.dumps({"model_name_or_path": "meta-llama/Llama-3.1-8B", "per_device_train_batch_size": 1,
                             "bf16": True, "use_liger_kernel": True}))
    r = CliRunner().invoke(app, ["plan", "--from", str(f), "--gpus", "8", "--gpu", "h100-sxm", "-s", "fsdp",
                                 "--json"])
    assert r.exit_code == 0, r.output
    t = json.loads(r.stdout)["train"]
    assert (t["fused_norm"], t["fused_mlp"], t["cross_entropy"]) == (True, True, "fused")
