"""ZeRO-1/2 × TP is planned as the DeepSpeed AutoTP that `shardwise train` runs: the
embedding, lm_head and logits whole on every TP rank, no sequence parallelism. Preflight's memory
check reads that plan, so a run that fits only under Megatron's accounting (vocabulary-parallel,
sequence-parallel) is refused before any rank starts. The measured checks of the scheme are
tests/train/test_tp_saved.py (saved bytes, params per rank) and tests/accuracy/test_measured_tp_comm.py."""

from __future__ import annotations

import pytest

from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import memory_as_run
from shardwise.run import run_spec
from shardwise.specs import Strategy
from shardwise.specs.hardware import GIB
from shardwise.train.preflight import check_memory


def _run():
    cfg = TrainConfig.model_validate({
        "model": {"name": "llama-3.1-8b"}, "strategy": {"name": "zero2", "tp": 2},
        "hardware": {"gpu": "a100-40g", "check_memory": True}, "run": {"micro_batch": 2},
        "checkpointing": {"activation": "none"}})  # fmt: skip
    return run_spec(cfg, 8, "cuda", environ={})


def test_autotp_books_the_whole_vocabulary_and_no_sequence_parallelism():
    run = _run()
    assert run.strategy.tp_scheme.name == "autotp"
    auto = memory_as_run(run.model, run.hardware, run.train, run.strategy).gpu
    mega = memory_as_run(run.model, run.hardware, run.train, run.strategy.model_copy(update={"tp_impl": "megatron"})).gpu
    m = run.model
    # bf16 parameters of the rank's replica: half of each decoder layer, the embedding and lm_head whole
    assert auto.params == pytest.approx(2 * (m.layer_params / 2 + m.root_params))
    assert mega.params == pytest.approx(2 * m.params / 2)
    assert auto.logits == pytest.approx(2 * mega.logits)  # the chunked loss over the whole vocabulary
    assert auto.activations > mega.activations  # norms and residuals whole on each TP rank


def test_preflight_refuses_an_autotp_run_that_fits_only_as_megatron():
    run = _run()
    mega = memory_as_run(run.model, run.hardware, run.train, run.strategy.model_copy(update={"tp_impl": "megatron"}))
    assert mega.fits  # what the planner booked for this run before: it would have started
    with pytest.raises(ShardwiseError, match="predicted not to fit: strategy 'zero2'") as e:
        check_memory(run)
    need = memory_as_run(run.model, run.hardware, run.train, run.strategy).gpu.required / GIB
    assert f"needs {need:.1f} GiB per GPU" in str(e.value) and need > 40 > mega.gpu.required / GIB


def test_tp_impl_is_checked_against_the_engine():
    with pytest.raises(ShardwiseError, match="tp_impl 'autotp' with strategy 'zero3'"):
        Strategy.from_name("zero3", tp=2, tp_impl="autotp")
    with pytest.raises(ShardwiseError, match="tp_impl 'autotp' with strategy 'fsdp'"):
        Strategy.from_name("fsdp", tp=2, tp_impl="autotp")
    with pytest.raises(ShardwiseError, match="DeepSpeed takes no DTensor"):
        Strategy.from_name("zero1", tp=2, tp_impl="dtensor")
    assert Strategy.from_name("zero3", tp=2).tp_scheme.name == "megatron"
    assert Strategy.from_name("zero1", tp=2, pp=2).tp_scheme.name == "megatron"
    assert Strategy.from_name("fsdp", tp=2).tp_scheme.name == "dtensor"
    assert not Strategy.from_name("zero2", tp=2, tp_impl="megatron").trainable


def test_plan_tp_impl_megatron_plans_megatron_deepspeed():
    import json

    from typer.testing import CliRunner

    from shardwise.cli.app import app

    def plan(*args):
        r = CliRunner().invoke(app, ["plan", "--json", "-m", "llama-3.1-8b", "--tp", "2", "-s", "zero2", *args])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    auto, mega = plan(), plan("--tp-impl", "megatron")
    a, m = auto["recommended_setting"], mega["recommended_setting"]
    assert (a["runnable"], a["tool"]) == (True, "shardwise train")
    assert (m["runnable"], m["tool"], m["needs"]) == (False, "Megatron-DeepSpeed", ["Megatron's tensor parallelism (tp 2)"])
    # the vocabulary-parallel, sequence-parallel row books less memory than AutoTP's
    row = {d["name"]: d for d in auto["strategies"]}["zero2"], {d["name"]: d for d in mega["strategies"]}["zero2"]
    assert row[1]["memory"]["total"] < row[0]["memory"]["total"]
    r = CliRunner().invoke(app, ["plan", "--tp-impl", "dtensor"])
    assert r.exit_code == 2 and "--tp-impl 'dtensor': expected auto or megatron" in r.output
