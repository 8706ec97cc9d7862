"""LoRA dropout (`--lora-dropout`, YAML lora.dropout, PEFT's lora_dropout): what it adds to the
activations, measured on CPU with PEFT on a tiny Llama (saved-for-backward bytes per layer and
token, storage-deduped) against the planner's term, and the CUDA figure derived by hand.

On CPU torch's dropout keeps a noise tensor in the input's dtype for backward where CUDA's fused
native_dropout keeps a bool mask: the term's `mask_bytes` is the one difference, passed here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise import catalog
from shardwise.errors import ShardwiseError
from shardwise.plan.lora import dropout_saved_per_token
from shardwise.specs import ModelSpec, TrainSpec

H, INTER = 128, 344  # tiny-llama (shardwise.bench.saved.SHAPES): MHA, so q, k, v and o are all h wide


def _measured(mode: str, p: float, targets) -> float:
    """Saved bytes per layer and token: 4 layers less 2, halved, over 2 × 128 tokens. `mode`:
    "pure" (base and adapters bf16, as DeepSpeed and FSDP2 compute), "fp32", or "mixed" (bf16
    base, fp32 adapters, the forward under torch.autocast: PEFT's default adapter dtype)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from shardwise.bench.saved import build_model, make_batch, saved_activation_bytes

    totals = []
    for layers in (2, 4):
        model = build_model("tiny-llama", layers, "fp32" if mode == "fp32" else "bf16", "sdpa", "none")
        model = inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, lora_dropout=p, target_modules=targets,
                                                   bias="none"), model)
        for name, w in model.named_parameters():
            w.requires_grad_("lora_" in name)
            if "lora_" in name and mode == "mixed":
                w.data = w.data.to(torch.float32)
        totals.append(saved_activation_bytes(model.train(), make_batch(2048),
                                             precision="bf16-autocast" if mode == "mixed" else "fp32"))
    return (totals[1] - totals[0]) / 2 / (2 * 128)


def _spec() -> ModelSpec:
    return ModelSpec.from_hf_dict({"model_type": "llama", "hidden_size": H, "num_attention_heads": 4,
                                   "num_key_value_heads": 4, "intermediate_size": INTER, "vocab_size": 2048,
                                   "num_hidden_layers": 4, "tie_word_embeddings": False})


@pytest.mark.parametrize("targets", [["q_proj"], ["q_proj", "k_proj", "v_proj"], ["o_proj"], ["down_proj"],
                                     ["gate_proj", "up_proj"], "all-linear"])
@pytest.mark.parametrize("mode", ["pure", "fp32", "mixed"])
def test_dropout_adds_what_peft_saves(mode, targets):
    c = 4 if mode == "fp32" else 2
    measured = _measured(mode, 0.1, targets) - _measured(mode, 0.0, targets)
    train = TrainSpec(precision="fp32" if mode == "fp32" else "bf16-pure", lora_rank=8, lora_dropout=0.1,
                      lora_targets=("all-linear",) if targets == "all-linear" else tuple(targets))
    noise = 4 if mode == "mixed" else c  # CPU: the noise in the dropout input's dtype (fp32 adapters under mixed)
    planned = dropout_saved_per_token(_spec(), train, autocast=mode == "mixed", mask_bytes=noise)
    assert planned == pytest.approx(measured)


def test_the_cuda_figure_by_hand():
    """Llama-2-7B, every linear adapted, bf16: q, k, v, o and gate, up read h, down reads I; each
    keeps its dropped bf16 copy and a one-byte mask (3 bytes an element), and the norm outputs
    and the product, which only the adapters kept, are no longer saved (2 bytes each)."""
    m = catalog.get_model("llama-2-7b")
    h, i = 4096, 11008
    train = TrainSpec(precision="bf16-pure", lora_rank=16, lora_dropout=0.05, lora_targets=("all-linear",))
    assert dropout_saved_per_token(m, train) == 3 * (6 * h + i) - 2 * (2 * h + i)
    # the activation plan carries it per layer, and nothing without dropout or LoRA
    from shardwise.plan.activations import layer_saved_per_token

    off = train.model_copy(update={"lora_dropout": 0.0})
    assert layer_saved_per_token(m, train) - layer_saved_per_token(m, off) == 3 * (6 * h + i) - 2 * (2 * h + i)
    assert dropout_saved_per_token(m, off) == 0
    with pytest.raises(ShardwiseError, match=r"--lora-dropout 0\.1 needs --lora-rank"):
        TrainSpec(lora_dropout=0.1)


def test_dropout_on_fused_experts_is_refused_as_peft_refuses_it():
    m = catalog.get_model("qwen3-30b-a3b")
    train = TrainSpec(lora_rank=8, lora_dropout=0.05, lora_targets=("gate_proj", "up_proj", "q_proj"))
    with pytest.raises(ShardwiseError, match="ParamWrapper refuses lora_dropout"):
        dropout_saved_per_token(m, train, moe=True)


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_plan_takes_lora_dropout_and_refuses_it_without_lora(tmp_path):
    base = ["--model", "llama-2-7b", "--gpu", "a100-80g", "--gpus", "1", "-s", "ddp", "--precision", "bf16-pure",
            "--micro-batch", "2", "--seq-len", "1024", "--checkpointing", "none", "--lora-rank", "16",
            "--lora-targets", "all-linear", "--json"]
    with_dropout, without = _plan(*base, "--lora-dropout", "0.05"), _plan(*base)
    assert with_dropout.returncode == 0 and without.returncode == 0, with_dropout.stderr[-2000:]
    act = [json.loads(r.stdout)["strategies"][0]["memory"]["activations"] for r in (with_dropout, without)]
    h, i = 4096, 11008
    assert act[0] - act[1] == pytest.approx(32 * 2 * 1024 * (3 * (6 * h + i) - 2 * (2 * h + i)))
    bad = _plan("--model", "llama-2-7b", "--lora-dropout", "0.1")
    assert bad.returncode != 0 and "--lora-dropout 0.1 needs --lora-rank" in bad.stdout + bad.stderr
    # a shardwise YAML's lora.dropout is planned alike
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {name: llama-2-7b}\nlora: {rank: 16, dropout: 0.05, target_modules: all-linear}\n")
    r = _plan(str(cfg), "--gpu", "a100-80g", "--gpus", "1", "-s", "ddp", "--json")
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    assert json.loads(r.stdout)["train"]["lora_dropout"] == 0.05
