"""Sequence parallelism splits the hidden-wide work of a layer (norms, residual adds) over the TP
ranks, for the bytes it moves as for the bytes it saves (plan/kernels.py `elementwise_bytes`,
plan/activations.py `seq_shards`); `--no-sequence-parallel` replicates it on every TP rank."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app
from shardwise.plan.activations import layer_saved_per_token, seq_shards
from shardwise.plan.evaluate import evaluate
from shardwise.plan.kernels import elementwise_bytes
from shardwise.specs import Strategy, TrainSpec

L70 = catalog.get_model("llama-2-70b")  # h 8192, 64 heads, 8 kv heads, intermediate 28672
SP = TrainSpec(seq_len=4096)
NO_SP = SP.model_copy(update={"sequence_parallel": False})


def test_tp8_sp_moves_an_eighth_of_the_bytes_like_it_saves_an_eighth():
    assert seq_shards(SP, 8) == 8 and seq_shards(NO_SP, 8) == 1
    # with SP every per-token tensor of the layer is split 8 ways: by heads/intermediate (TP) or
    # by tokens (SP), so one GPU moves 1/8 of what one unsplit GPU moves, as it saves 1/8
    assert elementwise_bytes(L70, SP, False, 8) == pytest.approx(elementwise_bytes(L70, SP, False, 1) / 8)
    assert layer_saved_per_token(L70, SP, 8) == pytest.approx(layer_saved_per_token(L70, SP, 1) / 8)


def test_without_sp_the_hidden_wide_bytes_stay_whole():
    # hand count, bf16 (c = 2) without autocast (residual stream r = 2), h = 8192, per token:
    # two HF LlamaRMSNorms: read x (r), write its fp32 upcast (4), pow (read 4, write 4), mean
    # (read 4), x·rsqrt (read 4, write 4), cast back (read 4, write c), weight (read c, write c):
    # 2h(r + 28 + 3c) = 589,824;
    # two residual adds (read two, write one): 2 · 3rh = 98,304
    hidden = 2 * 8192 * (2 + 28 + 3 * 2) + 2 * 3 * 2 * 8192
    assert hidden == 688_128
    replicated = elementwise_bytes(L70, NO_SP, False, 8) - elementwise_bytes(L70, SP, False, 8)
    assert replicated == pytest.approx(hidden * (1 - 1 / 8))


def test_the_70b_tp8_step_prices_it_and_the_flag_turns_it_off():
    hw = catalog.build_hardware(gpu="h100-sxm", gpus=64)
    s = Strategy.from_name("fsdp", tp=8)
    train = TrainSpec(seq_len=8192, micro_batch=1, checkpointing="full", attention="flash")
    on = evaluate(L70, hw, train, s).time
    off = evaluate(L70, hw, train.model_copy(update={"sequence_parallel": False}), s).time
    assert on.gemm_s == off.gemm_s  # the GEMMs are TP-split either way
    assert on.memory_bound_s < off.memory_bound_s
    assert on.memory_bound_s < on.gemm_s  # norms/residuals no longer priced 8 times over

    def plan(*flags):
        res = CliRunner().invoke(app, ["plan", "--json", "-m", "llama-2-70b", "--gpu", "h100-sxm", "--gpus", "64",
                                       "-s", "fsdp", "--tp", "8", "--seq-len", "8192", "--checkpointing", "full",
                                       "--attention", "flash", *flags])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)  # stderr says 8192 is beyond Llama-2's 4096 positions

    default, no_sp = plan(), plan("--no-sequence-parallel")
    assert default["train"]["sequence_parallel"] is True and no_sp["train"]["sequence_parallel"] is False
    assert no_sp["strategies"][0]["time"]["memory_bound_s"] > default["strategies"][0]["time"]["memory_bound_s"]
    assert no_sp["strategies"][0]["memory"]["activations"] > default["strategies"][0]["memory"]["activations"]
