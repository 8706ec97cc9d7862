"""Preference objectives in the planner (TrainSpec.objective / .reference): what each holds and
runs, what is refused naming its flag, and how the plan says it. The recipes' numbers against hand
derivations: tests/ingest/test_preference_from.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import evaluate
from shardwise.plan.planner import build_specs
from shardwise.specs import Strategy
from shardwise.specs.train import TrainSpec


def run(*args: str):
    return CliRunner().invoke(app, ["plan", *args])


@pytest.mark.parametrize(("kw", "flag"), [
    ({"objective": "orpo", "reference": "model"}, "--reference model"),
    ({"objective": "simpo", "reference": "precomputed"}, "--reference precomputed"),
    ({"objective": "dpo", "reference": "adapters_off"}, "--reference adapters-off needs --lora-rank"),
    ({"objective": "kto", "reference": "none"}, "--reference none"),
])
def test_a_reference_the_objective_cannot_have_is_refused_naming_the_flag(kw: dict, flag: str) -> None:
    with pytest.raises(ShardwiseError, match=flag):
        TrainSpec(**kw)


def test_the_reference_defaults_as_trl_creates_it() -> None:
    assert TrainSpec(objective="dpo").reference == "model"
    assert TrainSpec(objective="dpo", lora_rank=8).reference == "adapters_off"  # PEFT, ref_model None
    assert TrainSpec(objective="orpo").reference == "none"
    assert TrainSpec().reference == "none"


def test_paired_objectives_double_the_forward_batch_and_kto_does_not() -> None:
    assert TrainSpec(objective="dpo", micro_batch=3).as_sequences().micro_batch == 6
    assert TrainSpec(objective="simpo", micro_batch=3).as_sequences().micro_batch == 6
    assert TrainSpec(objective="kto", micro_batch=3).as_sequences().micro_batch == 3
    # idempotent: the copy has no objective left to apply
    assert TrainSpec(objective="dpo", micro_batch=3).as_sequences().as_sequences().micro_batch == 6


def _eval(name: str, **kw):
    m, hw, t = build_specs(model="llama-2-7b", gpu="h100-sxm", gpus=8, seq_len=1024, micro_batch=2, **kw)
    return evaluate(m, hw, t, Strategy.from_name(name))


def test_orpo_runs_the_pair_without_a_reference_and_dpo_adds_its_forward() -> None:
    sft, orpo, dpo = (_eval("zero2", objective=o) for o in ("sft", "orpo", "dpo"))
    assert orpo.memory.gpu.ref_params == 0 and orpo.memory.gpu.ref_forward == 0
    assert orpo.memory.gpu.logits == 2 * sft.memory.gpu.logits
    # the reference's forward costs time and, held whole under ZeRO-2, its bf16 weights
    assert dpo.time.compute_s > orpo.time.compute_s > sft.time.compute_s
    assert dpo.memory.gpu.ref_params == 2 * sft.model.params
    assert dpo.memory.gpu.total > orpo.memory.gpu.total


def test_kto_runs_the_reference_on_each_sequence_and_its_kl_sequence() -> None:
    sft, kto = _eval("ddp", objective="sft"), _eval("ddp", objective="kto")
    assert kto.memory.gpu.logits == sft.memory.gpu.logits  # unpaired: one sequence per example trained
    assert kto.memory.gpu.ref_params == 2 * sft.model.params
    assert kto.time.compute_s > sft.time.compute_s


def test_plan_prints_the_objective_and_that_train_runs_sft_only() -> None:
    r = run("--objective", "dpo", "--seq-len", "1024", "-s", "zero3", "--gpu", "h100-sxm", "--format", "markdown")
    assert r.exit_code == 0, r.output
    assert "DPO (a frozen reference model held" in r.output and "shardwise train runs SFT only" in r.output
    assert "| ref | ref fwd |" in r.output  # the reference's weights and its forward's transient, each a column


def test_plan_json_reports_the_reference_terms() -> None:
    r = run("--objective", "dpo", "--reference", "precomputed", "-s", "ddp", "--json")
    assert r.exit_code in (0, 3), r.output
    doc = json.loads(r.stdout)
    assert doc["train"]["objective"] == "dpo" and doc["train"]["reference"] == "precomputed"
    assert doc["strategies"][0]["memory"]["ref_params"] == 0


@pytest.mark.parametrize(("args", "says"), [
    (["--objective", "rlhf"], "--objective 'rlhf'"),
    (["--objective", "dpo", "--reference", "frozen"], "--reference 'frozen'"),
    (["--objective", "orpo", "--reference", "model"], "--reference model with --objective orpo"),
])
def test_bad_objective_flags_are_refused_naming_them(args: list[str], says: str) -> None:
    r = run(*args, "-s", "ddp")
    assert r.exit_code == 2 and says in r.output


def test_emit_is_refused_for_a_planner_only_objective(tmp_path) -> None:
    r = run("--objective", "dpo", "-s", "zero3", "--gpu", "h100-sxm", "--emit", str(tmp_path / "out"))
    assert r.exit_code == 2 and "SFT only" in r.output


def _gathered(*args: str) -> float:
    r = run("-m", "llama-2-7b", "--gpu", "h100-sxm", "--seq-len", "1024", "--micro-batch", "2", "--grad-accum", "3",
            "-s", "zero3", "--ds-persistence-threshold", "100000", "--json", *args)
    assert r.exit_code in (0, 3), r.output
    return json.loads(r.stdout)["strategies"][0]["comm"]["all_gather"]


# llama-2-7b's shape (config.json): hidden 4096, 32 layers of 4 H×H attention and 3 H×11008 MLP
# matrices and 2 norms, vocabulary 32000, untied embeddings
H, L = 4096, 32
P = 2 * 32000 * H + L * (4 * H * H + 3 * H * 11008 + 2 * H) + H
PERSIST = (2 * L + 1) * H  # ZeRO-3 keeps tensors under 1e5 elements whole: the norms


@pytest.mark.parametrize(("args", "forwards"), [
    (["--objective", "dpo"], 1),  # the reference copy, once per micro-batch
    (["--objective", "dpo", "--reference", "precomputed"], 0),
    (["--objective", "dpo", "--lora-rank", "8"], 1),  # adapters off: the policy itself runs the reference
    (["--objective", "kto"], 3),  # the reference on the KL sequences and the examples, the policy on the KL ones
    (["--objective", "kto", "--reference", "precomputed"], 1),
    (["--objective", "orpo"], 0),
])
def test_no_grad_forwards_through_a_zero3_model_gather_it_each_time(args: list[str], forwards: int) -> None:
    base = _gathered(*(["--lora-rank", "8"] if "--lora-rank" in args else []))
    assert _gathered(*args) - base == pytest.approx(2 * (P - PERSIST) * 3 * forwards)  # bf16, 3 micro-batches


def test_a_preference_recommendation_is_plan_only_and_names_trl() -> None:
    """shardwise train runs SFT: a DPO plan's recommendation is not runnable by it and names the
    tool that runs it."""
    r = run("--model", "llama-3.1-8b", "--objective", "dpo", "-s", "zero3", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["recommended_setting"]["runnable"] is False
    assert "needs DPO training (shardwise train runs SFT): run it with TRL" in " ".join(doc["reason"].split())
