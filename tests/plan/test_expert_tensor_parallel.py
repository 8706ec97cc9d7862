"""Expert parallelism beside tensor parallelism (plan/experts.py, Strategy.etp): the routed experts
split over etp of the tp ranks (Megatron-Core's --expert-tensor-parallel-size) or whole on their
rank (etp 1: torchtitan's layout, EP borrowing TP ranks). Every expected number is derived here
from the model's shape (catalog mixtral-8x7b: h 4096, 32 layers, I 14336, 8 experts top-2, no
shared experts; qwen3-30b-a3b: 128 experts) and the engines' token flow, not read from the plan."""

from __future__ import annotations

import json

import pytest
from tests.plan.test_expert_parallel import _plan

from shardwise.catalog import build_hardware, get_model
from shardwise.errors import ShardwiseError
from shardwise.plan import experts
from shardwise.plan.activations import moe_saved
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.train import TrainSpec

H, L, FFN, E, K = 4096, 32, 14336, 8, 2
EXPERT = 3 * FFN * H  # gate, up, down of one expert
TOKENS = 4096
TRAIN = TrainSpec(micro_batch=1, seq_len=TOKENS, grad_accum=2, checkpointing="full")


@pytest.fixture(scope="module")
def mixtral():
    return get_model("mixtral-8x7b")


@pytest.fixture(scope="module")
def hw16():
    return build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8)


def megatron(**kw) -> Strategy:
    return Strategy.from_name("zero1", tp=2, tp_impl="megatron", **kw)


def test_engine_defaults():
    # Megatron-Core: --expert-tensor-parallel-size defaults to the TP size; torchtitan's DTensor
    # layout keeps each expert whole on its EP rank; without EP the experts split as dense layers
    assert megatron(ep=8).expert_tp == 2
    assert Strategy.from_name("fsdp", tp=2, ep=8).expert_tp == 1
    assert Strategy.from_name("fsdp", tp=2).expert_tp == 2
    assert megatron(ep=8, etp=1).expert_tp == 1


def test_held_experts_whole_or_split(mixtral, hw16):
    # DDP under TP 2 on 16 GPUs (dp 8), ep 8: a rank holds 1 expert a layer, whole (etp 1) or
    # half of it (etp 2); without EP, half of all 8. The router (E·h a layer) is counted at the
    # same share as the experts. Parameters fp32 under DDP's autocast: 4 B.
    def params(**kw):
        return evaluate(mixtral, hw16, TRAIN, Strategy.from_name("ddp", tp=2, **kw)).memory.gpu.params / 4

    whole, split, none = params(ep=8, etp=1), params(ep=8, etp=2), params()
    assert whole - split == pytest.approx(L * (EXPERT + H) / 2)
    assert none - split == pytest.approx(L * (E - 1) * (EXPERT + H) / 2)


@pytest.mark.parametrize("etp", [1, 2])
def test_sharded_states_cover_the_model_once(mixtral, hw16, etp):
    # FSDP over dp_shard 8 × tp 2: the dense parameters over the 8 shard ranks of each TP rank,
    # a rank's experts (E/ep over etp) over the dp·tp/(ep·etp) expert-data-parallel ranks: every
    # GPU steps 1/16 of the model whatever the split, as without EP
    ep = evaluate(mixtral, hw16, TRAIN, Strategy.from_name("fsdp", tp=2, ep=8, etp=etp))
    no_ep = evaluate(mixtral, hw16, TRAIN, Strategy.from_name("fsdp", tp=2))
    assert ep.memory.gpu.optimizer_states == pytest.approx(no_ep.memory.gpu.optimizer_states)
    assert ep.memory.gpu.params == pytest.approx(no_ep.memory.gpu.params)


def test_all_to_all_routes_a_tp_ranks_tokens(mixtral, hw16):
    # sequence parallel: each TP rank routes its 4096/2 tokens; a dispatch sends their top-2
    # copies of h in bf16, 7/8 of them to other ranks; 6 all-to-alls a layer and micro-batch
    # under full checkpointing, 32 layers, 2 micro-batches
    one = TOKENS / 2 * K * H * 2 * 7 / 8
    for s in (megatron(ep=8), Strategy.from_name("fsdp", tp=2, ep=8)):
        e = evaluate(mixtral, hw16, TRAIN, s)
        assert e.comm.all_to_all == pytest.approx(one * 6 * L * 2)


def _tp_volume(e) -> float:
    """The TP collectives' bytes (all-reduce-equivalent): blocking = 2·TP + p2p + all-to-all."""
    return (e.comm.blocking - e.comm.p2p - e.comm.all_to_all) / 2


def test_megatron_gathers_the_routed_copies_over_expert_tp(mixtral, hw16):
    # Megatron's alltoall dispatcher at etp = tp all-gathers the received copies over the
    # expert-TP group and reduce-scatters the output: k pairs of b·s·h a layer and pass where the
    # dense MLP runs one; at etp 1 none (Mixtral has no shared experts). 3 passes (full
    # recompute), 32 layers, 2 micro-batches, b·s·h bf16
    act = 2 * TOKENS * H
    split = evaluate(mixtral, hw16, TRAIN, megatron(ep=8))
    whole = evaluate(mixtral, hw16, TRAIN, megatron(ep=8, etp=1))
    dense_mlp = evaluate(mixtral, hw16, TRAIN, megatron())
    assert _tp_volume(split) - _tp_volume(whole) == pytest.approx(K * 3 * L * 2 * act)
    assert _tp_volume(dense_mlp) - _tp_volume(whole) == pytest.approx(1 * 3 * L * 2 * act)
    # torchtitan's DTensor MoE keeps one pair at the layer's boundary, as without EP
    titan = evaluate(mixtral, hw16, TRAIN, Strategy.from_name("fsdp", tp=2, ep=8))
    titan_no_ep = evaluate(mixtral, hw16, TRAIN, Strategy.from_name("fsdp", tp=2))
    assert _tp_volume(titan) == pytest.approx(_tp_volume(titan_no_ep))


def test_shared_experts_keep_their_pair(hw16):
    # Qwen1.5-MoE has a shared expert: Megatron's shared expert gathers and scatters its own input
    # (one pair a pass) beside the routed copies' k
    m = get_model("qwen1.5-moe-a2.7b")
    act = 2 * TOKENS * m.hidden_size
    whole = evaluate(m, hw16, TRAIN, megatron(ep=4, etp=1))
    dense_mlp = evaluate(m, hw16, TRAIN, megatron())
    split = evaluate(m, hw16, TRAIN, megatron(ep=4))
    assert _tp_volume(whole) == pytest.approx(_tp_volume(dense_mlp))
    assert _tp_volume(split) - _tp_volume(whole) == pytest.approx(
        m.experts_per_token * 3 * m.num_layers * 2 * act)


def test_expert_gemms_same_work_any_split(mixtral):
    # E/ep experts of width I/etp, each seeing k·ep·etp/(tp·E) of a TP rank's layer tokens:
    # the rank's routed work is tokens·k·3·h·I/tp whatever etp
    for etp in (1, 2):
        shapes = experts.expert_gemms(mixtral, 2, 8, etp)
        assert len(shapes) == 3 * E // 8
        assert {nn for _, nn, _ in shapes[:2]} == {FFN / etp}
        assert sum(kk * nn * share for kk, nn, share in shapes) == pytest.approx(3 * H * FFN * K / 2)


def test_whole_experts_hold_a_tp_ranks_copies(mixtral):
    # without checkpointing, a TP rank keeps per routed copy the received input and combined
    # output (c·h each), the routing weight (fp32 for Mixtral) and three int64 indices: at etp 2
    # the copies of all the TP group's tokens, at etp 1 of its own tokens/2; the gate_up output,
    # activation and product (4c·I/tp) the same either way
    train = TRAIN.model_copy(update={"checkpointing": "none"})
    per_copy = 2 * 2 * H + 4 + 24
    assert moe_saved(mixtral, train, 2, etp=2) - moe_saved(mixtral, train, 2, etp=1) == pytest.approx(
        K * per_copy / 2)
    assert moe_saved(mixtral, train, 2, etp=2) == moe_saved(mixtral, train, 2)


def test_layout_borrows_tp_ranks_only_for_whole_experts(hw16):
    qwen = get_model("qwen3-30b-a3b")
    # ep 16 on 16 GPUs at tp 2 (dp 8): whole experts let EP span the TP ranks (ep·etp | dp·tp)
    e = evaluate(qwen, hw16, TRAIN, Strategy.from_name("fsdp", tp=2, ep=16))
    assert (e.memory.layout.ep, e.memory.layout.expert_tp, e.memory.layout.expert_dp) == (16, 1, 1)
    with pytest.raises(ShardwiseError, match=r"ep 16 must divide the data-parallel degree 8 \(dp_replicate"):
        evaluate(qwen, hw16, TRAIN, Strategy.from_name("fsdp", tp=2, ep=16, etp=2))
    with pytest.raises(ShardwiseError, match=r"ep 16 must divide dp_shard 4 × tp 2"):  # HSDP: 2 replicas of 4
        ParallelLayout(world_size=16, dp_shard=4, dp_replicate=2, tp=2, ep=16, etp=1)
    # EP ranks sit next to each other after the expert-TP ranks: 8 a node at etp 1, 4 at etp 2
    assert experts.a2a_link(8, 1, hw16) == "intra" and experts.a2a_link(8, 2, hw16) == "inter"


def test_refusals():
    with pytest.raises(ShardwiseError, match=r"etp 3: the expert tensor-parallel degree is planned as 1"):
        Strategy.from_name("fsdp", tp=4, ep=2, etp=3)
    with pytest.raises(ShardwiseError, match=r"etp 1 with ep 1"):
        Strategy.from_name("fsdp", tp=2, etp=1)
    with pytest.raises(ShardwiseError, match=r"ep 2 with tp 2 and tp_impl 'autotp'"):
        Strategy.from_name("zero1", tp=2, ep=2)


def test_train_refuses_etp_before_any_rank():
    from shardwise.config.load import validate
    from shardwise.run.bridge import strategy

    cfg = validate({"model": {"name": "mixtral-8x7b"}, "strategy": {"name": "fsdp", "tp": 2, "ep": 4, "etp": 1}},
                   source="etp.yaml")
    with pytest.raises(ShardwiseError, match=r"etp.yaml: strategy.ep 4: expert parallelism is planned only"):
        strategy(cfg, "cuda")


def test_cli_plans_ep_beside_tp():
    args = ["--model", "qwen3-30b-a3b", "--gpu", "h100-sxm", "--gpus", "16", "--seq-len", "4096", "--tp", "2"]
    r = _plan(*args, "-s", "fsdp", "--ep", "16")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "fsdp tp2 ep16 etp1" in r.stdout
    j = _plan(*args, "-s", "zero1", "--tp-impl", "megatron", "--ep", "8", "--json")
    assert j.returncode == 0, j.stderr + j.stdout
    row = json.loads(j.stdout)["strategies"][0]
    assert (row["tp"], row["ep"], row["etp"]) == (2, 8, 2) and row["comm"]["all_to_all"] > 0
    bad = _plan(*args, "-s", "fsdp", "--ep", "16", "--etp", "2")
    assert bad.returncode != 0 and "ep 16 must divide the data-parallel degree 8" in bad.stdout + bad.stderr
    lone = _plan(*args, "-s", "fsdp", "--etp", "1")
    assert lone.returncode != 0 and "--etp 1 needs expert parallelism" in lone.stdout + lone.stderr
