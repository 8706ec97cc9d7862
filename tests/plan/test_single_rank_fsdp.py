"""FSDP2 with a one-rank shard group (FSDPKnobs.single_rank): it shards nothing, so it runs as DDP
where the plan says so, and the plan, the trainer's engine and the reports all say the same.
The running engine is read back on 2 ranks in tests/run/test_run_bridge.py (`fsdp-hybrid:sg1`) and
the loss curves are compared in tests/train/test_parity.py."""

from __future__ import annotations

import json

import pytest

from shardwise.catalog import build_hardware, get_model
from shardwise.config.schema import TrainConfig
from shardwise.config.strategy import FSDPKnobs
from shardwise.plan.evaluate import evaluate, single_rank_runs_as
from shardwise.plan.memory import plan_memory
from shardwise.run import run_spec
from shardwise.specs import Strategy, TrainSpec

H200 = build_hardware(gpu="h200", gpus=1)
Q05 = get_model("qwen2.5-0.5b")
L7 = get_model("llama-2-7b")
Q05_TRAIN = TrainSpec(seq_len=2048, micro_batch=4)  # the measured H200 case (q05-fsdp / q05-ddp)


def fsdp(name: str = "fsdp", single_rank: str = "auto", **kw) -> Strategy:
    return Strategy.from_name(name, fsdp=FSDPKnobs(single_rank=single_rank), **kw)


def test_one_gpu_fsdp_is_planned_as_the_ddp_it_runs_as():
    ddp = evaluate(Q05, H200, Q05_TRAIN, Strategy.from_name("ddp"))
    for name in ("fsdp", "fsdp-grad-op", "fsdp-hybrid"):
        e = evaluate(Q05, H200, Q05_TRAIN, fsdp(name))
        assert e.memory.runs_as is not None and e.memory.runs_as.name == "ddp"
        assert e.strategy.name == name  # the row keeps the user's strategy
        assert e.memory.gpu.total == ddp.memory.gpu.total
        assert e.time.step_s == ddp.time.step_s
    kept = evaluate(Q05, H200, Q05_TRAIN, fsdp(single_rank="fsdp"))
    assert kept.memory.runs_as is None and kept.memory.gpu.total != ddp.memory.gpu.total
    # the measured ordering (one H200: DDP 53.9k vs FSDP2 45.3k tokens/s) is what made it worth it
    assert ddp.time.tokens_per_s_per_gpu > 1.1 * kept.time.tokens_per_s_per_gpu


@pytest.mark.parametrize(("train", "why"), [
    # at 4k DDP's 117 GiB allocated fits the H200 (its reserved cache is no OOM): 8k puts it over the device
    (TrainSpec(seq_len=8192), "ddp-does-not-fit"),
    (TrainSpec(seq_len=4096, checkpointing="full"), "rule"),
])
def test_auto_keeps_fully_shard_where_ddp_does_not_fit_or_is_slower(train, why):
    as_ddp = evaluate(L7, H200, train, fsdp(single_rank="ddp"))
    kept = evaluate(L7, H200, train, fsdp(single_rank="fsdp"))
    auto = evaluate(L7, H200, train, fsdp())
    takes_ddp = as_ddp.fits and (not kept.fits or as_ddp.time.step_s <= kept.time.step_s)
    if why == "ddp-does-not-fit":  # llama-2-7b at 8k without checkpointing: DDP's fp32 module overflows
        assert kept.fits and not as_ddp.fits and not takes_ddp
    assert (auto.memory.runs_as is not None) is takes_ddp
    assert auto.memory.gpu.total == (as_ddp if takes_ddp else kept).memory.gpu.total
    assert as_ddp.memory.runs_as.name == "ddp"  # "ddp" forces it, fitting or not


def test_only_a_one_rank_shard_group_without_offload_runs_as_ddp():
    eight = build_hardware(gpu="h200", gpus=8)
    assert single_rank_runs_as(Q05, eight, Q05_TRAIN, fsdp()) is None  # 8-way shards
    # fsdp-hybrid with shard groups of one: pure replication over 8 GPUs, i.e. DDP
    assert single_rank_runs_as(Q05, eight, Q05_TRAIN, fsdp("fsdp-hybrid", shard_group=1)).name == "ddp"
    assert single_rank_runs_as(Q05, H200, Q05_TRAIN, fsdp("fsdp+offload")) is None  # DDP cannot offload
    assert single_rank_runs_as(Q05, H200, Q05_TRAIN, Strategy.from_name("zero3")) is None
    assert plan_memory(Q05, H200, Q05_TRAIN, fsdp(), accounting="paper").runs_as is None
    # the DDP knobs go along
    s = Strategy.from_name("fsdp", ddp={"bucket_cap_mb": 100.0})
    assert single_rank_runs_as(Q05, H200, Q05_TRAIN, s).ddp.bucket_cap_mb == 100.0


def _cfg(**fsdp_knobs) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"name": "qwen2.5-0.5b"}, "data": {"kind": "synthetic", "synthetic": {"seq_len": 2048}},
        "strategy": {"name": "fsdp", "fsdp": fsdp_knobs}, "precision": "bf16-mixed",
        "run": {"micro_batch": 4, "device": "cuda", "nproc": 1}, "hardware": {"gpu": "h200"},
    })


def test_the_trainer_builds_the_engine_the_plan_chose():
    run = run_spec(_cfg(), 1, "cuda", environ={})
    assert run.strategy.name == "fsdp" and run.engine_strategy.engine == "ddp"
    assert run_spec(_cfg(single_rank="fsdp"), 1, "cuda", environ={}).engine_strategy.engine == "fsdp2"
    assert run_spec(_cfg(), 2, "cuda", environ={}).engine_strategy.engine == "fsdp2"
    # the settings check reports DDP's settings for it (what the live engine is compared with)
    from shardwise.bench.settings import planned_settings

    planned = planned_settings(run)
    assert planned["engine"] == "ddp" and planned["ddp_wrapper"] is False  # one replica: the bare module


def test_yaml_and_plan_flag_take_the_knob(tmp_path):
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    def row(*flags):
        r = CliRunner().invoke(app, ["plan", "--json", "--model", "qwen2.5-0.5b", "--gpu", "h200", "--gpus", "1",
                                     "--seq-len", "2048", "--micro-batch", "4", "-s", "fsdp", *flags])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["strategies"][0]

    assert (row()["runs_as"], row()["engine"]) == ("ddp", "ddp")
    assert (row("--fsdp-single-rank", "fsdp")["runs_as"], row("--fsdp-single-rank", "fsdp")["engine"]) == (None, "fsdp2")
    table = CliRunner().invoke(app, ["plan", "--model", "qwen2.5-0.5b", "--gpu", "h200", "--gpus", "1", "-s", "fsdp"])
    assert "fsdp (as ddp)" in table.output
    bad = CliRunner().invoke(app, ["plan", "--gpus", "1", "--fsdp-single-rank", "never"])
    assert bad.exit_code == 2 and "single_rank" in bad.output
    yaml = tmp_path / "c.yaml"
    yaml.write_text("model: {name: qwen2.5-0.5b}\nstrategy: {name: fsdp, fsdp: {single_rank: sometimes}}\n")
    from shardwise.config.load import load_config
    from shardwise.errors import ShardwiseError

    with pytest.raises(ShardwiseError, match=r"strategy\.fsdp\.single_rank"):
        load_config(yaml)


def test_emit_says_what_shardwise_train_runs(tmp_path):
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    for knob, says in (("auto", True), ("fsdp", False)):
        out = tmp_path / knob
        r = CliRunner().invoke(app, ["plan", "--model", "qwen2.5-0.5b", "--gpu", "h200", "--gpus", "1", "-s", "fsdp",
                                     "--fsdp-single-rank", knob, "--emit", str(out)])
        assert r.exit_code == 0, r.output
        text = (out / "README.md").read_text()
        assert ("`shardwise train` runs this as ddp" in text) is says
        assert ("FSDP2 wraps each `Qwen2DecoderLayer`" in text) is not says


def test_one_replica_ddp_keeps_no_buckets_unless_told():
    """With one replica the DDP engine runs the bare module: the gradients come and go; wrapped,
    gradient_as_bucket_view keeps them (the buckets) allocated through the next forward."""
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    def mem(*flags):
        r = CliRunner().invoke(app, ["plan", "--json", "--model", "qwen2.5-0.5b", "--gpu", "h200", "--gpus", "1",
                                     "--seq-len", "2048", "--micro-batch", "4", "-s", "ddp", *flags])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["strategies"][0]["memory"]

    bare = plan_memory(Q05, H200, Q05_TRAIN, Strategy.from_name("ddp")).gpu
    wrapped = plan_memory(Q05, H200, Q05_TRAIN, Strategy.from_name("ddp", ddp={"wrap_one_rank": True})).gpu
    assert not bare.grads_persist and wrapped.grads_persist
    # the buckets (the grads) live through forward: 4 bytes per parameter more there
    assert wrapped.phases["forward"] - bare.phases["forward"] == pytest.approx(4 * Q05.params)
    # the flag reaches the plan: the allocator's peak carries those bytes
    assert mem("--ddp-wrap-one-rank")["allocated"] - mem()["allocated"] == pytest.approx(4 * Q05.params)
    # with two replicas DDP is wrapped whatever the knob
    eight = build_hardware(gpu="h200", gpus=8)
    two = plan_memory(Q05, eight, Q05_TRAIN, Strategy.from_name("ddp"))
    assert two.gpu.grads_persist
