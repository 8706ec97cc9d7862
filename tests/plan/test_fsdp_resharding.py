"""FSDP2's resharding and gradient-sync knobs (`fsdp.reshard_after_forward` all | not-last | none,
`fsdp.reduce_every_micro_batch`): the planner's bytes from hand arithmetic on llama-2-7b (bf16
params gathered, fp32 reduce-scatter), the spec's and the CLI's refusals, the trainer YAML and
the emitted accelerate key. The counts of live 2-rank runs are tests/accuracy/test_measured_comm.py's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app
from shardwise.config.strategy import FSDPKnobs, StrategyKnobs
from shardwise.errors import ShardwiseError
from shardwise.plan.comm import plan_comm
from shardwise.plan.evaluate import evaluate, resolved
from shardwise.plan.memory import plan_memory
from shardwise.specs import Strategy, TrainSpec

M7 = catalog.get_model("llama-2-7b")
PSI = M7.params
LAYER = M7.params_per_layer
N = M7.num_layers  # 32 decoder layers, one root unit
HW8 = catalog.build_hardware(gpus=8)


def fsdp(name: str = "fsdp", **knobs) -> Strategy:
    return Strategy.from_name(name, fsdp=FSDPKnobs(**knobs))


@pytest.mark.parametrize("k", [1, 2])
def test_reshard_all_gathers_every_layer_again_in_backward(k):
    train = TrainSpec(grad_accum=k)
    # the unsharded grads held (one reduce-scatter per step), as set: "auto" may reduce each micro-batch
    ours = plan_comm(M7, HW8, train, fsdp(reduce_every_micro_batch=False))
    stock = plan_comm(M7, HW8, train, fsdp(reshard_after_forward="all", reduce_every_micro_batch=False))
    # forward gathers all Ψ (2 bytes); backward the N-1 layers ("not-last") or every unit, the
    # root too ("all": stock fully_shard(reshard_after_forward=True) on the root as well)
    assert ours.all_gather == pytest.approx(2 * k * (PSI + (N - 1) * LAYER))
    assert stock.all_gather == pytest.approx(2 * k * (PSI + PSI))
    # one all-gather call per unit in forward, one per resharded unit in backward; RS per unit once
    assert ours.calls == k * ((N + 1) + (N - 1)) + (N + 1)
    assert stock.calls == k * ((N + 1) + (N + 1)) + (N + 1)
    assert stock.reduce_scatter == ours.reduce_scatter == pytest.approx(4 * PSI)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_reduce_every_micro_batch_reduce_scatters_k_times(k):
    train = TrainSpec(grad_accum=k)
    c = plan_comm(M7, HW8, train, fsdp(reshard_after_forward="all", reduce_every_micro_batch=True))
    assert c.reduce_scatter == pytest.approx(4 * PSI * k)
    assert c.calls == k * ((N + 1) + (N + 1)) + (N + 1) * k


def test_reduce_every_micro_batch_all_reduces_hsdp_replicas_per_micro_batch():
    hw = catalog.build_hardware(gpus=16, gpus_per_node=8)  # 2 replicas of an 8-GPU shard group
    train = TrainSpec(grad_accum=2)
    once = plan_comm(M7, hw, train, Strategy.from_name("fsdp-hybrid", fsdp=FSDPKnobs(reduce_every_micro_batch=False)))
    every = plan_comm(M7, hw, train, Strategy.from_name("fsdp-hybrid", fsdp=FSDPKnobs(reduce_every_micro_batch=True)))
    assert once.all_reduce == pytest.approx(4 * PSI / 8)  # the fp32 1/8 shard, once per step
    assert every.all_reduce == pytest.approx(2 * 4 * PSI / 8)


def test_none_is_grad_op():
    train = TrainSpec(grad_accum=2)
    none, grad_op = (resolved(M7, HW8, train, s) for s in (fsdp(reshard_after_forward="none"),
                                                            Strategy.from_name("fsdp-grad-op")))
    assert grad_op.resharding == "none"
    assert plan_comm(M7, HW8, train, none) == plan_comm(M7, HW8, train, grad_op)
    assert plan_comm(M7, HW8, train, none).all_gather == pytest.approx(2 * 2 * PSI)  # forward only
    assert plan_memory(M7, HW8, train, none).gpu == plan_memory(M7, HW8, train, grad_op).gpu
    assert none.zero_equivalent == grad_op.zero_equivalent == 2 and fsdp().zero_equivalent == 3
    # the time too, where exposure depends on the forward share of the gathers (a 0.5B model
    # over two nodes on 100 Gb/s Ethernet: 0.401 s a step if "none" counted as ZeRO-3, 0.358 s)
    small, two_nodes = catalog.get_model("qwen2.5-0.5b"), catalog.build_hardware(gpus=16, gpus_per_node=8,
                                                                                  interconnect="eth-100")
    t4 = TrainSpec(micro_batch=4)
    assert evaluate(small, two_nodes, t4, none).time == evaluate(small, two_nodes, t4, grad_op).time
    for accounting in ("paper", "deepspeed"):
        assert (plan_memory(M7, HW8, train, none, accounting=accounting).gpu
                == plan_memory(M7, HW8, train, grad_op, accounting=accounting).gpu)


def test_gathered_parameter_memory_by_resharding():
    train = TrainSpec()
    root = PSI - N * LAYER  # embeddings, final norm, lm_head
    gathered = {r: plan_memory(M7, HW8, train, fsdp(reshard_after_forward=r)).gpu.gathered_params
                for r in ("all", "not-last", "none")}
    # "all" frees the last layer after forward but gathers it again as backward starts, with the
    # next one prefetched: two layers and the root either way; "none" holds every layer
    assert gathered["all"] == gathered["not-last"] == pytest.approx(2 * (2 * LAYER + root))
    assert gathered["none"] == pytest.approx(2 * PSI)


def test_stock_accumulation_holds_sharded_not_unsharded_grads():
    train = TrainSpec(grad_accum=2)
    ours = plan_memory(M7, HW8, train, fsdp(reduce_every_micro_batch=False)).gpu
    stock = plan_memory(M7, HW8, train, fsdp(reshard_after_forward="all", reduce_every_micro_batch=True)).gpu
    assert ours.held_grads == pytest.approx(4 * PSI)  # unsharded fp32 grads while sync is off
    assert stock.held_grads == 0 and stock.grads_persist


def test_layers_resharded_per_setting():
    assert [fsdp(reshard_after_forward=r).reshards_layer(last=x) for r in ("all", "not-last", "none")
            for x in (False, True)] == [True, True, True, False, False, False]
    assert fsdp(reshard_after_forward="layers").reshards_layer(last=True)
    # the root: only stock fully_shard's explicit True on it ("all") reshards it
    assert [fsdp(reshard_after_forward=r).reshards_root for r in ("all", "layers", "not-last", "none")] == \
        [True, False, False, False]


def test_reshard_root_sets_the_root_beside_any_layer_policy():
    """`fsdp.reshard_root`: auto follows the layer policy (freed under "all" only); true or false
    says it for the root alone (torchtitan: not-last layers and the root freed)."""
    assert [fsdp(reshard_after_forward=r, reshard_root=v).reshards_root
            for r in ("all", "not-last") for v in ("auto", True, False)] == [True, True, False, False, True, False]
    titan = fsdp(reshard_root=True)
    assert titan.reshards_layer(last=False) and not titan.reshards_layer(last=True)
    assert not Strategy.from_name("zero3").reshards_root


@pytest.mark.parametrize("k", [1, 2])
def test_a_resharded_root_is_gathered_again_in_backward(k):
    train = TrainSpec(grad_accum=k)
    root = PSI - N * LAYER
    kept = plan_comm(M7, HW8, train, resolved(M7, HW8, train, fsdp()))
    freed = plan_comm(M7, HW8, train, resolved(M7, HW8, train, fsdp(reshard_root=True)))
    assert freed.all_gather - kept.all_gather == pytest.approx(2 * k * root)  # bf16, once per micro-batch


@pytest.mark.parametrize(("loss", "freed"), [("standard", True), ("chunked-output", True), ("chunked", False)])
def test_a_resharded_root_is_not_held_while_a_loss_after_the_forward_runs(loss, freed):
    """A root freed after forward is gathered again as backward starts: a loss computed on the
    logits the forward returned (the trainer's standard loss, torchtitan's, torchtune's chunked
    output) runs without it, so where the loss sets the peak the peak falls by the root's bf16
    bytes; the trainer's chunked loss runs inside the forward, lm_head's weight in use."""
    train = TrainSpec(micro_batch=4, seq_len=4096, cross_entropy=loss)
    root = PSI - N * LAYER
    kept = plan_memory(M7, HW8, train, fsdp()).gpu
    free = plan_memory(M7, HW8, train, fsdp(reshard_root=True)).gpu
    assert kept.gathered_params == free.gathered_params  # the root is gathered again for backward
    if freed:
        assert kept.logits > kept.recompute + kept.grad_buffers + 2 * root  # the loss sets this peak
        assert kept.allocated - free.allocated == pytest.approx(2 * root)
    else:
        assert kept.allocated == free.allocated


@pytest.mark.parametrize("k", [1, 2])
def test_reshard_layers_gathers_every_layer_but_not_the_root_again(k):
    """FSDP1 FULL_SHARD's layout (the root's flat parameter is never freed after forward)."""
    train = TrainSpec(grad_accum=k)
    c = plan_comm(M7, HW8, train, resolved(M7, HW8, train, fsdp(reshard_after_forward="layers")))
    assert c.all_gather == pytest.approx(2 * k * (PSI + N * LAYER))
    assert c.calls == k * ((N + 1) + N) + (N + 1)
    assert Strategy.from_name("fsdp").resharding == "not-last"  # the trainer's default
    assert Strategy.from_name("zero3").resharding is None


def test_grad_op_refuses_a_resharding_it_does_not_do_but_sweeps_skip_it():
    with pytest.raises(ShardwiseError, match=r"reshard_after_forward 'all' with strategy 'fsdp-grad-op'"):
        fsdp("fsdp-grad-op", reshard_after_forward="all")
    assert fsdp("fsdp-grad-op", reshard_after_forward="none").resharding == "none"
    knobs = StrategyKnobs(fsdp=FSDPKnobs(reshard_after_forward="all", reduce_every_micro_batch=True))
    swept = Strategy.with_knobs("fsdp-grad-op", knobs)  # what `plan` applies to every row
    assert swept.resharding == "none" and swept.fsdp.reduce_every_micro_batch is True
    assert Strategy.with_knobs("fsdp", knobs).resharding == "all"


def _plan(*flags: str):
    return CliRunner().invoke(app, ["plan", "--json", "--model", "llama-2-7b", "--gpus", "8", *flags])


def test_plan_flags_set_the_knobs():
    r = _plan("-s", "fsdp", "--grad-accum", "2", "--fsdp-reshard-after-forward", "all",
              "--fsdp-reduce-every-micro-batch", "true")
    assert r.exit_code == 0, r.output
    row = json.loads(r.output)["strategies"][0]
    assert row["comm"]["all_gather"] == pytest.approx(2 * 2 * (PSI + PSI))  # every unit, the root too, twice
    assert row["comm"]["reduce_scatter"] == pytest.approx(2 * 4 * PSI)


@pytest.mark.parametrize("flags, says", [
    (["-s", "zero3", "--fsdp-reshard-after-forward", "all"], "--fsdp-reshard-after-forward applies to"),
    (["-s", "ddp", "-s", "zero2", "--fsdp-reduce-every-micro-batch", "true"], "not to ddp, zero2"),
    (["--emit-strategy", "zero3", "--fsdp-reduce-every-micro-batch", "false"], "--fsdp-reduce-every-micro-batch"),
    (["-s", "fsdp", "--fsdp-reduce-every-micro-batch", "yes"], "expected auto, true, false"),
    (["-s", "fsdp-grad-op", "--fsdp-reshard-after-forward", "all"], "fsdp-grad-op keeps every layer gathered"),
    (["-s", "fsdp", "--fsdp-reshard-after-forward", "last"], "expected all, layers, not-last, none"),
    (["-s", "zero3", "--fsdp-reshard-root", "true"], "--fsdp-reshard-root applies to"),
    (["-s", "fsdp", "--fsdp-reshard-root", "sometimes"], "expected auto, true, false"),
])
def test_plan_flags_without_a_strategy_they_change_are_refused(flags, says):
    r = _plan(*flags)
    assert r.exit_code == 2 and says in r.output, r.output


def test_plan_flag_applies_to_the_fsdp_rows_of_a_mixed_selection():
    r = _plan("-s", "zero3", "-s", "fsdp", "--fsdp-reshard-after-forward", "all")
    assert r.exit_code == 0, r.output


def test_trainer_yaml_and_set_take_the_knob(tmp_path):
    from shardwise.config.load import load_config
    from shardwise.run import run_spec

    yaml = tmp_path / "c.yaml"
    yaml.write_text("model: {name: tiny-llama-bench}\ndata: {kind: synthetic}\n"
                    "strategy: {name: fsdp, fsdp: {reshard_after_forward: all}}\n")
    run = run_spec(load_config(yaml, ["strategy.fsdp.reduce_every_micro_batch=true"]), 2, "cpu", environ={})
    assert run.strategy.resharding == "all" and run.strategy.fsdp.reduce_every_micro_batch is True
    assert run_spec(load_config(yaml, ["strategy.fsdp.reshard_after_forward=none"]), 2, "cpu",
                    environ={}).strategy.resharding == "none"
    with pytest.raises(ShardwiseError, match=r"strategy\.fsdp\.reshard_after_forward"):
        load_config(yaml, ["strategy.fsdp.reshard_after_forward=last"])
    titan = run_spec(load_config(yaml, ["strategy.fsdp.reshard_after_forward=not-last", "strategy.fsdp.reshard_root=true"]),
                     2, "cpu", environ={}).strategy
    assert titan.reshards_root and not titan.reshards_layer(last=True)
    with pytest.raises(ShardwiseError, match=r"strategy\.fsdp\.reshard_root"):
        load_config(yaml, ["strategy.fsdp.reshard_root=sometimes"])
    with pytest.raises(ShardwiseError, match=r"c\.yaml: strategy: .*fsdp-grad-op"):
        run_spec(load_config(yaml, ["strategy.name=fsdp-grad-op"]), 2, "cpu", environ={})


@pytest.mark.parametrize("resharding, key", [("all", True), ("not-last", True), ("none", False)])
def test_accelerate_key_and_trainer_config_follow_it(resharding, key):
    from shardwise.emit import accelerate_config, emitted_run

    s = fsdp(reshard_after_forward=resharding)
    acc = accelerate_config(M7, HW8, TrainSpec(), s)
    assert acc["fsdp_config"]["fsdp_reshard_after_forward"] is key  # accelerate takes one bool for every unit
    run, _ = emitted_run(M7, HW8, TrainSpec(), s)
    assert run.strategy.resharding == resharding  # shardwise.yaml round-trips the knob
