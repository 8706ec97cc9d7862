"""The planner's pipeline (plan.pipeline): the trainer's split, each rank's part of the model, the
micro-batches each schedule keeps in flight and the bubble, checked against what they are by
construction and the closed forms of Narayanan et al. 2021 (arXiv:2104.04473, §2.2). The
trainer's measured figures: tests/accuracy/test_measured_pipeline.py."""

from __future__ import annotations

import pytest

from shardwise.catalog import build_hardware, get_model
from shardwise.plan.evaluate import memory_as_run
from shardwise.plan.pipeline import bubble_share, in_flight_peak, pipeline_ranks, rank_actions
from shardwise.plan.stage import rank_params
from shardwise.specs import ModelSpec, Strategy, TrainSpec
from shardwise.specs.pipeline import rank_stages, stage_layers


def test_ranks_hold_the_trainers_stages():
    """82 layers over 4 ranks: 21/21/20/20 (specs.pipeline.stage_layers, as the trainer cuts them;
    ⌈L/pp⌉ chunks would be 21/21/21/19); with 2 virtual stages each rank holds stages r and r + 4."""
    assert [len(r.layers) for r in pipeline_ranks(82, 4)] == [21, 21, 20, 20]
    ranks = pipeline_ranks(82, 4, 2)
    ranges = stage_layers(82, 8)
    for r in ranks:
        assert r.stages == tuple(rank_stages(r.index, 4, 2))
        assert r.layers == tuple(i for s in r.stages for i in ranges[s])
    assert [r.embedding for r in ranks] == [True, False, False, False]
    assert [r.head for r in ranks] == [False, False, False, True]
    assert sorted(i for r in ranks for i in r.layers) == list(range(82))
    (whole,) = pipeline_ranks(82, 1)
    assert whole.embedding and whole.head and whole.layers == tuple(range(82))


def test_rank_params_place_the_embedding_and_the_head():
    """Llama-3.1-8B, pp 4: rank 0 holds 8 layers and the embedding, rank 3 8 layers, the final
    norm and lm_head; the middle ranks only their layers."""
    m = get_model("llama-3.1-8b")
    per_layer = m.layer_sizes[0]
    embed = m.vocab_size * m.hidden_size
    got = [rank_params(m, 1, r) for r in pipeline_ranks(m.num_layers, 4)]
    assert got == [8 * per_layer + embed, 8 * per_layer, 8 * per_layer, 8 * per_layer + m.hidden_size + embed]
    assert sum(got) == m.params


def test_one_f_one_b_holds_min_m_p_minus_r():
    for p in (2, 3, 4, 8):
        for m in (1, 2, p, 2 * p + 1):
            peaks = [in_flight_peak(rank_actions("1f1b", p, 1, m, r), {r: 1.0}) for r in range(p)]
            assert peaks == [min(m, p - r) for r in range(p)], (p, m)
            gpipe = [in_flight_peak(rank_actions("gpipe", p, 1, m, r), {r: 1.0}) for r in range(p)]
            assert gpipe == [m] * p


def test_interleaved_order_is_torchs():
    """pp 2, 2 stages per rank, 4 micro-batches, as ScheduleInterleaved1F1B's
    `_calculate_single_rank_operations` lays them out (read off torch 2.13: warmup 4 forwards on
    rank 0, 2 on rank 1, then forward/backward pairs, then the backwards): rank 0 holds at most 5
    stage-forwards, rank 1 3."""
    order = {0: "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
             1: "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"}
    for r, text in order.items():
        got = " ".join(f"{a.kind}{a.stage}.{a.micro_batch}" for a in rank_actions("interleaved-1f1b", 2, 2, 4, r))
        assert got == text
    assert [in_flight_peak(rank_actions("interleaved-1f1b", 2, 2, 4, r), dict.fromkeys(range(4), 1.0))
            for r in range(2)] == [5, 3]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_equal_stages_bubble_is_narayanans(p, m):
    """Equal stages, any backward/forward ratio: GPipe and 1F1B idle (p − 1)/(m + p − 1) of the
    step, interleaved 1F1B (p − 1)/(v·m + p − 1) where its rounds divide m (§2.2.1-2.2.2)."""
    for ratio in (1.0, 2.0, 3.0):
        for schedule in ("gpipe", "1f1b"):
            assert bubble_share(schedule, p, 1, m, (1.0,) * p, ratio) == pytest.approx((p - 1) / (m + p - 1))
        if m >= p and m % p == 0:
            for v in (2, 3):
                got = bubble_share("interleaved-1f1b", p, v, m, (1.0,) * (p * v), ratio)
                assert got == pytest.approx((p - 1) / (v * m + p - 1))


def test_interleaved_refuses_micro_batches_its_rounds_do_not_divide():
    from shardwise.errors import ShardwiseError

    with pytest.raises(ShardwiseError, match="multiple of 2"):
        rank_actions("interleaved-1f1b", 4, 2, 9, 0)


def _tiny(layers: int) -> ModelSpec:
    return ModelSpec.from_hf_dict({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": layers,
                                   "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 688,
                                   "vocab_size": 256, "max_position_embeddings": 512,
                                   "tie_word_embeddings": False}, name=f"tiny-{layers}")


def test_plan_is_the_fullest_rank_and_names_each():
    """The plan's GPU is the pipeline rank that needs the most; every rank's breakdown is there.
    1F1B on pp 4 with 8 micro-batches: rank 0 keeps 4 micro-batches of its layers, rank 3 one of
    its layers and the final norm, and only rank 3 holds the loss."""
    m = _tiny(8)
    train = TrainSpec(seq_len=128, micro_batch=2, grad_accum=8, precision="fp32")
    plan = memory_as_run(m, build_hardware(gpu="a100-80g", gpus=4), train, Strategy.from_name("fsdp", pp=4))
    assert len(plan.pipeline) == 4
    assert plan.gpu == max(plan.pipeline, key=lambda g: g.required)
    acts = [g.activations for g in plan.pipeline]
    assert acts[0] == pytest.approx(4 * acts[1] / 3) and acts[1] == pytest.approx(3 * acts[2] / 2)
    assert acts[3] > acts[2] / 2  # one micro-batch, plus the final norm
    assert [g.logits > 0 for g in plan.pipeline] == [False, False, False, True]


def test_gpipe_keeps_every_micro_batch_and_its_loss():
    """GPipe holds all m micro-batches' activations on every rank, and the last stage's loss
    holds what waits for each one's backward (chunked: lm_head's weight gradient, c·V·H)."""
    m = _tiny(8)
    train = TrainSpec(seq_len=128, micro_batch=2, grad_accum=4, precision="fp32", cross_entropy="chunked")
    hw = build_hardware(gpu="a100-80g", gpus=2)
    one = memory_as_run(m, hw, train, Strategy.from_name("fsdp", pp=2))
    gpipe = memory_as_run(m, hw, train, Strategy.from_name("fsdp", pp=2, pp_schedule="gpipe"))
    assert gpipe.pipeline[0].activations == pytest.approx(2 * one.pipeline[0].activations)  # 4 vs 2 in flight
    assert gpipe.pipeline[1].activations == pytest.approx(4 * one.pipeline[1].activations)  # 4 vs 1
    assert gpipe.pipeline[1].logits - one.pipeline[1].logits == pytest.approx(3 * 4 * m.vocab_size * m.hidden_size)
