"""Expert parallelism (plan/experts.py): what one rank of an EP group holds, sends and computes,
every expected number derived here from the model's shape (catalog mixtral-8x7b: h 4096, 32
layers, 32 query / 8 KV heads of 128, I 14336, 8 experts top-2, vocab 32000, untied)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.catalog import build_hardware, get_model
from shardwise.errors import ShardwiseError
from shardwise.plan import experts
from shardwise.plan.evaluate import evaluate
from shardwise.plan.kernels import layer_gemms
from shardwise.specs import Strategy
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.train import TrainSpec

H, L, FFN, E, K, V = 4096, 32, 14336, 8, 2, 32000
KV = 8 * 128
ATTN = H * H + H * KV + H * KV + H * H  # q, k, v, o
NORMS = 2 * H  # input and post-attention RMSNorm
EXPERT = 3 * FFN * H  # gate, up, down of one expert
ROOT = V * H + V * H + H  # embedding, lm_head (untied), final norm
FULL_LAYER = ATTN + NORMS + E * H + E * EXPERT  # router E·h
PSI_FULL = L * FULL_LAYER + ROOT  # 46,702,792,704: Mixtral's 46.7B


def ep_layer(ep: int) -> int:
    """One layer as an EP rank holds it: E/ep experts (and the router at its local share, E/ep·h)."""
    return ATTN + NORMS + E // ep * H + E // ep * EXPERT


def psi_held(ep: int) -> int:
    return L * ep_layer(ep) + ROOT


TRAIN = TrainSpec(micro_batch=1, seq_len=4096, grad_accum=2, checkpointing="full")


@pytest.fixture(scope="module")
def mixtral():
    return get_model("mixtral-8x7b")


@pytest.fixture(scope="module")
def hw8():
    return build_hardware(gpu="h100-sxm", gpus=8)


def test_shape_as_derived(mixtral):
    assert mixtral.params == PSI_FULL == 46_702_792_704


def test_experts_held_per_rank_ddp_ep8(mixtral, hw8):
    # DDP replicates every state: with ep 8 a rank holds 1 of the 8 experts of each layer
    # (32·218,116,096 + 262,148,096 = 7,241,863,168 parameters), fp32 under autocast (4 B each)
    assert psi_held(8) == 7_241_863_168
    e = evaluate(mixtral, hw8, TRAIN, Strategy.from_name("ddp", ep=8))
    assert e.memory.layout.ep == 8 and e.memory.layout.dp_replicate == 8
    assert e.memory.gpu.params == pytest.approx(4 * psi_held(8))
    assert e.memory.gpu.grads == pytest.approx(4 * psi_held(8))
    # each rank all-reduces the fp32 grads of the dense parameters over the 8 data-parallel ranks;
    # its expert's grads over the dp/ep = 1 expert-data-parallel rank (Megatron's expert DP group):
    # nothing to move
    assert e.comm.all_reduce == pytest.approx(4 * (psi_held(8) - L * EXPERT))
    # ep 4 on 8: expert-data-parallel groups of 2 ranks, each reducing the 2 experts it holds
    e4 = evaluate(mixtral, hw8, TRAIN, Strategy.from_name("ddp", ep=4))
    assert e4.comm.all_reduce == pytest.approx(4 * psi_held(4))


def test_fsdp_ep8_shards_and_gathers(mixtral, hw8):
    # dense params sharded over dp_shard 8, a rank's expert over dp_shard/ep = 1: per rank
    # dense/8 + experts/8 = ψ_full/8, fp32: the same shard as without EP
    s = Strategy.from_name("fsdp", ep=8)
    e = evaluate(mixtral, hw8, TRAIN, s)
    assert e.memory.gpu.params == pytest.approx(4 * PSI_FULL / 8)
    assert e.memory.gpu.optimizer_states == pytest.approx(8 * PSI_FULL / 8)  # AdamW: 2 fp32 states
    # gathered (bf16): the layer in flight and the prefetched one, of 1 expert each, and the root
    assert s.resharding != "none"
    assert e.memory.gpu.gathered_params == pytest.approx(2 * (2 * ep_layer(8) + ROOT))
    no_ep = evaluate(mixtral, hw8, TRAIN, Strategy.from_name("fsdp"))
    assert no_ep.memory.gpu.gathered_params == pytest.approx(2 * (2 * FULL_LAYER + ROOT))


def test_all_to_all_bytes_by_hand(mixtral, hw8):
    # one dispatch (or combine): 4096 tokens × top-2 × h 4096 × 2 B, 7/8 of it to the other ranks
    one = 4096 * K * H * 2 * 7 / 8
    assert one == 58_720_256
    assert experts.a2a_bytes(mixtral, TRAIN, 8) == one
    # per layer and micro-batch: dispatch + combine forward, their gradients, and the forward's two
    # again under full checkpointing = 6; 32 MoE layers; 2 micro-batches
    e = evaluate(mixtral, hw8, TRAIN, Strategy.from_name("fsdp", ep=8))
    assert e.comm.all_to_all == pytest.approx(one * 6 * 32 * 2)
    assert e.comm.blocking_calls == 6 * 32 * 2
    selective = TRAIN.model_copy(update={"checkpointing": "none"})
    assert experts.a2a_step(mixtral, selective, Strategy.from_name("fsdp", ep=8),
                            experts_rank(mixtral))[0] == pytest.approx(one * 4 * 32 * 2)


def experts_rank(model):
    from shardwise.plan.pipeline import pipeline_ranks

    return pipeline_ranks(model.num_layers, 1)[0]


def test_load_imbalance_scales_a2a_and_expert_gemms(mixtral, hw8):
    base = evaluate(mixtral, hw8, TRAIN, Strategy.from_name("fsdp", ep=8))
    busy = evaluate(mixtral, hw8, TRAIN, Strategy.from_name("fsdp", ep=8, ep_load_imbalance=1.25))
    assert busy.comm.all_to_all == pytest.approx(1.25 * base.comm.all_to_all)
    assert busy.time.gemm_s > base.time.gemm_s
    assert busy.memory.gpu.params == base.memory.gpu.params


def test_a2a_link_and_time(mixtral):
    # ep 8 inside a node of 8: NVLink only; ep 16 over 2 nodes: of what a rank sends, 7/15 to its
    # node's peers over NVLink, 8/15 through its NIC share (IB: one NIC per GPU), both at once
    hw = build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8)
    assert experts.a2a_link(8, 1, hw) == "intra" and experts.a2a_link(16, 1, hw) == "inter"
    vol = 1e9
    assert experts.a2a_time(vol, 8, hw) == pytest.approx(vol / hw.intra.bus_bytes_per_s)
    nic = hw.inter_node_bytes_per_s / hw.gpus_per_node
    assert experts.a2a_time(vol, 16, hw) == pytest.approx(max(vol * 7 / 15 / hw.intra.bus_bytes_per_s,
                                                              vol * 8 / 15 / nic))


def test_expert_gemms_split_the_work(mixtral):
    # E/ep experts with k·ep/E of a rank's tokens each: the same rows × weights in all
    for ep in (1, 2, 4, 8):
        shapes = experts.expert_gemms(mixtral, 1, ep)
        assert len(shapes) == 3 * E // ep
        assert sum(kk * nn * share for kk, nn, share in shapes) == pytest.approx(3 * H * FFN * K)
    # ep 1: what layer_gemms priced before EP existed, written out
    before = [(H, H, 1.0), (H, KV, 1.0), (H, KV, 1.0), (H, H, 1.0), (H, E, 1.0)]
    before += [(H, FFN, K / E), (H, FFN, K / E), (FFN, H, K / E)] * E
    assert layer_gemms(mixtral, 1) == before


@pytest.mark.parametrize("name", ["fsdp", "fsdp-hybrid", "zero1", "zero2", "zero3", "ddp", "zero3+opt-offload"])
@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen3-30b-a3b", "llama-3.1-8b"])
def test_ep1_changes_nothing(name, model):
    m = get_model(model)
    hw = build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8)
    a = evaluate(m, hw, TRAIN, Strategy.from_name(name))
    b = evaluate(m, hw, TRAIN, Strategy.from_name(name, ep=1, ep_load_imbalance=1.0))
    assert a.memory.gpu.as_dict() == b.memory.gpu.as_dict()
    assert a.comm.as_dict() == b.comm.as_dict() and a.comm.all_to_all == 0
    assert a.time.as_dict() == b.time.as_dict()
    assert experts.rank_model(m, Strategy.from_name(name)) is m


def test_refusals(mixtral, hw8):
    dense = get_model("llama-3.1-8b")
    with pytest.raises(ShardwiseError, match=r"ep 2: llama-3.1-8b is a dense model"):
        evaluate(dense, hw8, TRAIN, Strategy.from_name("fsdp", ep=2))
    hw16 = build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8)
    with pytest.raises(ShardwiseError, match=r"ep 16 must divide the 8 routed experts \(num_experts\) of mixtral-8x7b"):
        evaluate(mixtral, hw16, TRAIN, Strategy.from_name("fsdp", ep=16))
    hw6 = build_hardware(gpu="h100-sxm", gpus=6, gpus_per_node=6)
    with pytest.raises(ShardwiseError, match=r"ep 4 must divide the data-parallel degree 6"):
        evaluate(mixtral, hw6, TRAIN, Strategy.from_name("fsdp", ep=4))
    with pytest.raises(ShardwiseError, match=r"ep 8 must divide the data-parallel shard group dp_shard 4"):
        ParallelLayout(world_size=8, dp_shard=4, dp_replicate=2, ep=8)
    with pytest.raises(ShardwiseError, match=r"ep 2 with tp 2 and tp_impl 'autotp'"):
        Strategy.from_name("zero2", ep=2, tp=2)
    with pytest.raises(ShardwiseError, match=r"ep_load_imbalance 1.5 needs expert parallelism"):
        Strategy.from_name("fsdp", ep_load_imbalance=1.5)
    with pytest.raises(ShardwiseError):
        Strategy.from_name("fsdp", ep=2, ep_load_imbalance=0.5)


def test_train_refuses_ep_before_any_rank():
    from shardwise.config.load import validate
    from shardwise.run.bridge import strategy

    cfg = validate({"model": {"name": "mixtral-8x7b"}, "strategy": {"name": "fsdp", "ep": 8}}, source="ep.yaml")
    assert cfg.strategy.ep == 8
    with pytest.raises(ShardwiseError, match=r"ep.yaml: strategy.ep 8: expert parallelism is planned only"):
        strategy(cfg, "cuda")
    assert not Strategy.from_name("fsdp", ep=8).trainable


def _plan(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300, check=False, env=env)


def test_cli_ep_row_and_json():
    args = ["--model", "qwen3-30b-a3b", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "4096", "-s", "fsdp"]
    r = _plan(*args, "--ep", "8")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "fsdp ep8" in r.stdout
    j = _plan(*args, "--ep", "8", "--ep-load-imbalance", "1.2", "--json")
    assert j.returncode == 0, j.stderr
    doc = json.loads(j.stdout)
    row = doc["strategies"][0]
    assert row["ep"] == 8 and row["ep_load_imbalance"] == 1.2
    assert row["comm"]["all_to_all"] > 0
    bad = _plan(*args, "--ep", "3")
    assert bad.returncode != 0 and "ep 3 must divide the data-parallel degree 8" in bad.stdout + bad.stderr


def test_plan_from_shardwise_yaml_reads_ep(tmp_path):
    # the trainer's TP plan covers no MoE family, so a training YAML plans MoE at tp 1 (etp 1)
    cfg = tmp_path / "moe.yaml"
    cfg.write_text("model:\n  name: qwen3-30b-a3b\nstrategy:\n  name: fsdp\n  ep: 4\n  ep_load_imbalance: 1.1\n"
                   "  etp: 1\n  ep_overlap: true\n")
    r = _plan(str(cfg), "--gpus", "8", "--gpu", "h100-sxm", "-s", "fsdp", "--json")
    assert r.returncode == 0, r.stderr + r.stdout
    row = json.loads(r.stdout)["strategies"][0]
    assert (row["ep"], row["ep_load_imbalance"], row["etp"], row["ep_overlap"]) == (4, 1.1, 1, True)
    read = json.loads(r.stdout)["from"]["read"]
    assert any(x["key"] == "strategy.ep" and x["as"].startswith("--ep 4 --ep-load-imbalance 1.1 --etp 1 --ep-overlap")
               for x in read)


def test_fp8_casts_the_ranks_own_experts(mixtral):
    # tensorwise fp8 casts each weight in forward (5 bytes an element) and again in backward (5):
    # a rank casts the weights of the experts it holds, 1 of 8 under ep 8; the tokens it casts
    # are the same k copies either way. One layer, one micro-batch, no replay.
    from shardwise.plan.fp8 import cast_bytes

    t = TRAIN.model_copy(update={"fp8": "tensorwise", "checkpointing": "none", "grad_accum": 1})
    assert cast_bytes(mixtral, t, 1, 1, ep=1) - cast_bytes(mixtral, t, 1, 1, ep=8) == pytest.approx(
        (5 + 5) * (E - 1) * EXPERT)


def test_deepseek_grouped_router_under_ep64():
    # DeepSeek-V3 routes over 8 groups of its 256 experts before dispatch: a rank holding 256/64 = 4
    # of them is a valid layout (NVIDIA Megatron-Bridge's DeepSeek-V3 preset runs EP 64)
    m = get_model("deepseek-v3")
    hw = build_hardware(gpu="h100-sxm", gpus=64, gpus_per_node=8)
    e = evaluate(m, hw, TRAIN, Strategy.from_name("fsdp", ep=64))
    assert e.memory.layout.ep == 64 and experts.rank_model(m, Strategy.from_name("fsdp", ep=64)).num_experts == 4


def test_ep_overlap_hides_paired_micro_batches(mixtral, hw8):
    # Megatron's combined 1F1B runs micro-batch i's backward beside i+1's forward: of m micro-batches'
    # all-to-alls, those of the m - 1 pairs hide behind the partner's compute (up to the window)
    assert experts.a2a_hidden(2.0, 10.0, 4) == pytest.approx(2.0 * 3 / 4)
    assert experts.a2a_hidden(2.0, 1.0, 4) == pytest.approx(1.0 * 3 / 4)
    assert experts.a2a_hidden(2.0, 10.0, 1) == 0.0
    t = TRAIN.model_copy(update={"checkpointing": "none", "grad_accum": 4})
    off = evaluate(mixtral, hw8, t, Strategy.from_name("fsdp", ep=8))
    on = evaluate(mixtral, hw8, t, Strategy.from_name("fsdp", ep=8, ep_overlap=True))
    a2a_s = experts.a2a_time(off.comm.all_to_all, 8, hw8)
    window = hw8.timing.overlap_efficiency * on.time.compute_s
    assert a2a_s < window  # all of a paired micro-batch's all-to-alls fit behind its partner
    assert off.time.step_s - on.time.step_s == pytest.approx(a2a_s * 3 / 4, rel=1e-6)
    assert on.memory.gpu.as_dict() == off.memory.gpu.as_dict()


def test_ep_overlap_refusals(mixtral, hw8):
    with pytest.raises(ShardwiseError, match=r"ep_overlap needs expert parallelism"):
        Strategy.from_name("fsdp", ep_overlap=True)
    with pytest.raises(ShardwiseError, match=r"ep_overlap with pp 2: .* virtual stages only"):
        Strategy.from_name("zero1", ep=2, pp=2, ep_overlap=True)
    with pytest.raises(ShardwiseError, match=r"ep_overlap and full checkpointing"):
        evaluate(mixtral, hw8, TRAIN, Strategy.from_name("fsdp", ep=8, ep_overlap=True))
    # checkpointing auto never picks the full recomputation Megatron refuses beside it
    auto = TRAIN.model_copy(update={"checkpointing": "auto"})
    assert evaluate(mixtral, hw8, auto, Strategy.from_name("fsdp", ep=8, ep_overlap=True)).train.checkpointing == "none"
