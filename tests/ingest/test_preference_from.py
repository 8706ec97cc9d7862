"""Preference training read from real recipes and planned with its reference model and its paired
batch, each figure checked against a derivation from the model's published shape (never the
planner's own functions).

The recipes, verbatim:
- llama_factory_lora_dpo.yaml: hiyouga/LLaMA-Factory examples/train_lora/llama3_lora_dpo.yaml
  (commit 01fa59bb6b5f5c3d1e1699af1b44875824529e9e): stage dpo, pref_loss sigmoid, LoRA rank 8 on
  every linear, ref_model unset (the base with the adapters disabled), cutoff_len 2048, batch 1.
- trl_zephyr_dpo_full.yaml: huggingface/alignment-handbook recipes/zephyr-7b-beta/dpo/config_full.yaml
  (commit 19f03455e1b7c0450db769f841ced8e650610c06): TRL DPOConfig keys (beta, max_length 1024,
  max_prompt_length 512), full fine-tuning, batch 8, accumulation 2, gradient checkpointing.

Shapes (the models' config.json): Meta-Llama-3-8B and Mistral-7B-v0.1 (zephyr-7b's base) share
hidden 4096, 32 layers, 32 query heads of 128, 8 KV heads, MLP 14336, untied embeddings; vocabularies
128256 and 32000.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardwise.cli.app import app

DATA = Path(__file__).parents[1] / "data" / "from"
H, LAYERS, KV, MLP = 4096, 32, 1024, 14336
BF16 = 2  # bytes of a bf16 weight / logit (bf16-mixed computes in bf16)


def params(vocab: int) -> int:
    """Parameters of the Llama/Mistral shape: embedding and lm_head (untied), per layer q, o (H×H),
    k, v (H×KV), gate, up, down (H×MLP) and two RMSNorm weights, and the final norm."""
    layer = 2 * H * H + 2 * H * KV + 3 * H * MLP + 2 * H
    return 2 * vocab * H + LAYERS * layer + H


def forward_flops_per_token(vocab: int, seq: int) -> int:
    """One forward per token: 2 FLOPs per weight it multiplies through (all but the input
    embedding, a lookup), and causal attention: QKᵀ and PV over seq/2 keys on average,
    2 FLOPs per multiply-add over H each: 2·L·seq·H."""
    return 2 * (params(vocab) - vocab * H) + 2 * LAYERS * seq * H


def plan(*args: str) -> dict:
    r = CliRunner().invoke(app, ["plan", *args, "--gpu", "h100-sxm", "--json"])
    assert r.exit_code in (0, 3), r.output
    return json.loads(r.stdout)


def by_name(doc: dict) -> dict[str, dict]:
    return {s["name"]: s for s in doc["strategies"]}


def flops_per_token(doc: dict, s: dict) -> float:
    """The step's FLOPs per trained token, from what the plan reports: MFU × peak / tokens/s."""
    return s["time"]["mfu"] * doc["hardware"]["gpu_rates"]["bf16_flops"] / s["time"]["tokens_per_s_per_gpu"]


ZEPHYR = ["--from", str(DATA / "trl_zephyr_dpo_full.yaml"), "-s", "ddp", "-s", "zero3", "-s", "fsdp",
          "--ds-persistence-threshold", "100000"]


def test_trl_zephyr_dpo_recipe_plans_the_reference_and_the_paired_batch() -> None:
    doc = plan(*ZEPHYR)
    train = doc["train"]
    assert (train["objective"], train["reference"], train["micro_batch"], train["grad_accum"], train["seq_len"]) == (
        "dpo", "model", 8, 2, 1024)
    vocab, p = 32000, params(32000)
    assert doc["model"]["params"] == p
    tokens = 2 * 8 * 1024  # chosen + rejected of each of 8 examples, 1024 tokens each
    # ZeRO-3 keeps tensors under 1e5 elements whole: the 2 norms of each layer and the final one
    persist = (2 * LAYERS + 1) * H
    s = by_name(doc)
    # the reference: bf16, whole under DDP (TRL: accelerator.prepare_model(evaluation_mode=True)),
    # sharded over the 8 ranks under ZeRO-3 (prepare_deepspeed keeps stage 3) and FSDP2 (prepare_fsdp)
    assert s["ddp"]["memory"]["ref_params"] == BF16 * p
    assert s["zero3"]["memory"]["ref_params"] == BF16 * p / 8 + BF16 * persist
    assert s["fsdp"]["memory"]["ref_params"] == BF16 * p / 8
    # the policy's loss over the paired batch (HF's standard cross-entropy: the c-byte logits and
    # three fp32 [tokens, V] tensors in log-softmax's backward)
    for name in s:
        assert s[name]["memory"]["logits"] == tokens * (BF16 + 12) * vocab
    # the reference's forward: its bf16 logits beside the policy's, which are still held; sharded,
    # its gathered weights too (FSDP2: TRL shards the root alone, one unit: the whole model;
    # ZeRO-3: the layer in flight and the prefetched one)
    layer = params(vocab) - 2 * vocab * H - H
    logits_pair = 2 * BF16 * vocab * tokens
    assert s["ddp"]["memory"]["ref_forward"] == logits_pair
    assert s["zero3"]["memory"]["ref_forward"] == logits_pair + BF16 * 2 * layer / LAYERS
    assert s["fsdp"]["memory"]["ref_forward"] == logits_pair + BF16 * p
    # checkpointed activations: at least each layer's bf16 input for every sequence of the pair
    acts = s["zero3"]["memory"]["activations"]
    assert BF16 * H * LAYERS * tokens <= acts <= 1.15 * BF16 * H * LAYERS * tokens
    # the same recipe without the reference: precomputed log-probs hold none and run no reference
    pre = by_name(plan(*ZEPHYR, "--reference", "precomputed"))
    for name in s:
        assert pre[name]["memory"]["ref_params"] == pre[name]["memory"]["ref_forward"] == 0
        assert pre[name]["memory"]["activations"] == s[name]["memory"]["activations"]  # the same paired batch
        # the reference's forward: one forward's FLOPs per trained token
        assert flops_per_token(doc, s[name]) - flops_per_token(doc, pre[name]) == pytest.approx(
            forward_flops_per_token(vocab, 1024), rel=1e-9)
    # its gather: every parameter once per micro-batch (2 of them), bf16; ZeRO-3's persistent ones not
    assert s["zero3"]["comm"]["all_gather"] - pre["zero3"]["comm"]["all_gather"] == pytest.approx(
        2 * BF16 * (p - persist))
    assert s["fsdp"]["comm"]["all_gather"] - pre["fsdp"]["comm"]["all_gather"] == pytest.approx(2 * BF16 * p)
    assert s["ddp"]["comm"]["all_gather"] == pre["ddp"]["comm"]["all_gather"] == 0


def test_trl_precompute_ref_log_probs_holds_no_reference(tmp_path: Path) -> None:
    f = tmp_path / "dpo_precompute.yaml"
    f.write_text((DATA / "trl_zephyr_dpo_full.yaml").read_text() + "\nprecompute_ref_log_probs: true\n")
    doc = plan("--from", str(f), "-s", "ddp", "-s", "zero3")
    assert doc["train"]["reference"] == "precomputed"
    for s in doc["strategies"]:
        assert s["memory"]["ref_params"] == 0 and s["memory"]["ref_forward"] == 0
    assert any(r["key"] == "precompute_ref_log_probs" and "precomputed" in r["as"] for r in doc["from"]["read"])


def test_llama_factory_lora_dpo_recipe_runs_the_base_with_adapters_off() -> None:
    src = ["--from", str(DATA / "llama_factory_lora_dpo.yaml"), "-s", "ddp"]
    doc = plan(*src)
    train = doc["train"]
    assert (train["objective"], train["reference"], train["lora_rank"], train["seq_len"]) == (
        "dpo", "adapters_off", 8, 2048)
    vocab, p = 128256, params(128256)
    assert doc["model"]["params"] == p
    tokens = 2 * 1 * 2048  # chosen + rejected of one example
    ddp = doc["strategies"][0]["memory"]
    assert ddp["ref_params"] == 0  # ref_model unset under LoRA: the base itself, adapters disabled
    assert ddp["ref_forward"] == 2 * BF16 * vocab * tokens
    assert ddp["logits"] == tokens * (BF16 + 12) * vocab
    # a reference model named (LLaMA-Factory ref_model): a bf16 copy of the whole model on each GPU
    held = plan(*src, "--reference", "model")
    assert held["strategies"][0]["memory"]["ref_params"] == BF16 * p
    pre = plan(*src, "--reference", "precomputed")
    assert flops_per_token(doc, doc["strategies"][0]) - flops_per_token(pre, pre["strategies"][0]) == pytest.approx(
        forward_flops_per_token(vocab, 2048), rel=1e-9)
    # the keys read
    read = {r["key"]: r["as"] for r in doc["from"]["read"]}
    assert "--objective dpo" in read["stage/pref_loss"] and "adapters-off" in read["ref_model"]
    assert not any(i["key"] in ("stage", "pref_loss", "pref_beta") for i in doc["from"]["ignored"])


@pytest.mark.parametrize(("loss", "objective", "reference"), [("orpo", "orpo", "none"), ("simpo", "simpo", "none"),
                                                               ("ipo", "dpo", "adapters_off")])
def test_llama_factory_pref_loss_picks_the_objective(tmp_path: Path, loss: str, objective: str, reference: str) -> None:
    f = tmp_path / "lf.yaml"
    f.write_text((DATA / "llama_factory_lora_dpo.yaml").read_text().replace("pref_loss: sigmoid", f"pref_loss: {loss}"))
    doc = plan("--from", str(f), "-s", "ddp")
    assert (doc["train"]["objective"], doc["train"]["reference"]) == (objective, reference)
    mem = doc["strategies"][0]["memory"]
    if reference == "none":  # reference-free: the pair, no reference forward
        assert mem["ref_params"] == mem["ref_forward"] == 0
        assert mem["logits"] == 2 * 2048 * (BF16 + 12) * 128256


def test_llama_factory_full_dpo_holds_a_reference_copy(tmp_path: Path) -> None:
    f = tmp_path / "lf_full.yaml"
    f.write_text((DATA / "llama_factory_lora_dpo.yaml").read_text().replace("finetuning_type: lora",
                                                                            "finetuning_type: full"))
    doc = plan("--from", str(f), "-s", "ddp")
    assert (doc["train"]["objective"], doc["train"]["reference"]) == ("dpo", "model")
    assert doc["strategies"][0]["memory"]["ref_params"] == BF16 * params(128256)


@pytest.mark.parametrize("recipe", ["llama_factory_lora_dpo.yaml", "trl_zephyr_dpo_full.yaml"])
def test_the_flags_a_recipe_reads_as_plan_what_the_recipe_plans(recipe: str) -> None:
    doc = plan("--from", str(DATA / recipe))  # DDP: neither file names DeepSpeed or FSDP
    flags = plan(*doc["from"]["as_flags"])
    assert flags["train"] == doc["train"]
    assert [s["memory"] for s in flags["strategies"]] == [s["memory"] for s in doc["strategies"]]


def test_trl_orpo_config_is_orpo_without_a_reference(tmp_path: Path) -> None:
    """TRL's ORPOConfig (huggingface/trl f2cd577 trl/experimental/orpo/orpo_config.py) has no loss_type
    and no reference keys, and keys DPOConfig lacks (padding_value, is_encoder_decoder,
    generate_during_eval, max_completion_length): ORPO, the pair through the policy only. `beta`
    alone is either config's: DPO, said first, and --objective orpo beside the file wins."""
    f = tmp_path / "orpo.yaml"
    base = ("model_name_or_path: meta-llama/Meta-Llama-3-8B\nper_device_train_batch_size: 1\nbf16: true\n"
            "output_dir: out\nbeta: 0.1\nmax_length: 1024\n")
    f.write_text(base + "max_completion_length: 512\npadding_value: null\ngenerate_during_eval: false\n")
    doc = plan("--from", str(f), "-s", "ddp")
    assert (doc["train"]["objective"], doc["train"]["reference"]) == ("orpo", "none")
    assert doc["strategies"][0]["memory"]["ref_params"] == 0
    assert not any("ORPOConfig takes the same keys" in w for w in doc["from"]["warnings"])
    f.write_text(base)
    doc = plan("--from", str(f), "-s", "ddp")
    assert (doc["train"]["objective"], doc["train"]["reference"]) == ("dpo", "model")
    assert any("pass --objective orpo" in w for w in doc["from"]["warnings"])
    doc = plan("--from", str(f), "-s", "ddp", "--objective", "orpo")
    assert (doc["train"]["objective"], doc["train"]["reference"]) == ("orpo", "none")
    # a DPOConfig key (its loss) makes it DPO, ORPOConfig's keys beside it notwithstanding
    f.write_text(base + "max_completion_length: 512\nloss_type: sigmoid\n")
    doc = plan("--from", str(f), "-s", "ddp")
    assert doc["train"]["objective"] == "dpo"
    assert not any("ORPOConfig takes the same keys" in w for w in doc["from"]["warnings"])
