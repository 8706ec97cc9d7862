"""DeepSpeed ZeRO-1/2 partitions each optimizer group on its own, and a rank holds every tensor
that overlaps its slice of a group whole. The trainer's AdamW groups (train/engines/base.
decay_groups): the decayed tensors, then norms, biases and embeddings; two groups under weight
decay. This, not the reduce bucket, is what the README's bench command measured: examples/demo.yaml
(tiny-llama, weight_decay 0.01) had ZeRO-2's model states 13.9% under the census when the plan
partitioned one group in HF order; a reduce bucket ≥ Ψ changes nothing (tests/accuracy/test_measured_memory.py
`-bigbucket`, and the sweep below)."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.plan.memory import plan_memory
from shardwise.plan.stage import optimizer_groups, partition_holding
from shardwise.specs import Strategy, TrainSpec

TINY = catalog.get_model("tiny-llama")  # hidden 64, 2 layers, intermediate 176, vocab 2048, untied
# measured: `shardwise bench examples/demo.yaml --steps 3 --set strategy.name=zero2 --sweep
# optimizer.weight_decay=0.0,0.01 --sweep strategy.deepspeed.reduce_bucket_size=100000,500000000`
# (2 CPU ranks, gloo, fp32, DeepSpeed 0.19.8): the census' gradient bytes on the fullest rank,
# the same for both bucket sizes
MEASURED_GRAD_BYTES = {0.0: 1_049_856, 0.01: 1_449_984}


def test_the_trainers_groups_by_hand():
    h, i, v = 64, 176, 2048
    matrices = 4 * h * h + 3 * h * i  # q, k, v, o; gate, up, down: 50,176 per layer
    decayed = 2 * matrices + v * h  # the layers' matrices and lm_head
    rest = v * h + 5 * h  # embed_tokens and 5 RMSNorm weights (2 per layer, the final one)
    assert (decayed, rest) == (231_424, 131_392)
    two = optimizer_groups(TINY, 0.01)
    assert [sum(g) for g in two] == [decayed, rest]
    one = optimizer_groups(TINY, 0.0)
    assert len(one) == 1 and sorted(one[0]) == sorted(two[0] + two[1])


def test_partition_holding_is_the_measured_census():
    # one group [layers' matrices, lm_head | embed, norms] split at 181,408: rank 1 holds lm_head
    # (it crosses the middle), embed and the norms: 131,072 + 131,072 + 320 elements
    assert partition_holding(TINY, 2, weight_decay=0.0) == 262_464
    # two groups split at 115,712 and 65,696: rank 0 holds all of the first (lm_head crosses) and the
    # embedding of the second: 231,424 + 131,072
    assert partition_holding(TINY, 2, weight_decay=0.01) == 362_496
    for wd, measured in MEASURED_GRAD_BYTES.items():
        assert 4 * partition_holding(TINY, 2, weight_decay=wd) == measured  # fp32 gradients


@pytest.mark.parametrize("bucket", [100_000, 500_000_000])  # below and above Ψ = 362,816
def test_the_plan_of_the_demo_matches_for_either_bucket(bucket):
    from shardwise.config.strategy import DeepSpeedKnobs

    hw = catalog.build_hardware(gpu="a100-80g", gpus=2)
    s = Strategy.from_name("zero2", ds=DeepSpeedKnobs(reduce_bucket_size=bucket, allgather_bucket_size=bucket))
    for wd, measured in MEASURED_GRAD_BYTES.items():
        train = TrainSpec(precision="fp32", seq_len=256, micro_batch=4, grad_accum=2, weight_decay=wd)
        assert plan_memory(TINY, hw, train, s).gpu.grads == measured
