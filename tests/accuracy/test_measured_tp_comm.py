"""Collective bytes of tensor + sequence parallelism (`strategy.tp: 2`, TP alone on 2 gloo ranks)
counted on the live engine against the planner.

The bench model (shardwise.bench.worker: tiny-llama-bench, 4 layers, hidden 128, fp32, micro-batch
2 × 64 tokens) runs 4 optimizer steps at accumulation 1 and 2; shardwise.bench.comm counts steps
3-4. From first principles, Megatron-LM's sequence parallelism moves one all-gather and one
reduce-scatter of the [b, s, h] activation per block (attention, MLP) per pass (forward and
backward): 4·L pairs per micro-batch, plus one pair per pass at the vocabulary-parallel root
(embedding, lm_head); the vocab-parallel loss all-reduces two fp32 per token and its sum. The
planner counts each pair as the all-reduce of the same ring volume; its total must be within 5%
of the measured volume (2·all_reduce + all_gather + reduce_scatter, test_measured_comm's unit).
Not seen by the counter: the implicit reductions DTensor makes inside an op's dispatch (the
SequenceParallel norms' weight gradients, Partial until the optimizer reads them: 9 × h fp32).

ZeRO-1/2 × tp 2 through DeepSpeed's AutoTP (`zero1-tp2`, `zero2-tp2`: one data rank) all-reduces
each row-parallel output in forward (o_proj, down_proj) and each column-parallel linear's input
gradient in backward (q, k, v, gate, up): 7 all-reduces of [b, s, h] per layer and micro-batch;
the whole embedding and lm_head move nothing, and neither does the loss. One fp32 scalar per
step on top (DeepSpeed's step-time check over the TP group). Its gradient reductions run over
the one-rank data-parallel group, which the counter leaves out (they move nothing).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardwise.bench import comm_worker as w  # noqa: E402 (after importorskip)

pytestmark = pytest.mark.distributed
CASES = [w.case_name("fsdp-tp2", ga) for ga in w.GAS]
AUTOTP = [w.case_name(v, ga) for v in ("zero1-tp2", "zero2-tp2") for ga in w.GAS]


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    return w.measure_comm(CASES + AUTOTP, timeout_s=420)


@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_collectives_per_step(case, measured):
    _, ga = w.parse_case(case)
    run = w.bench_run("fsdp-tp2", ga)
    layers, act = run.model.num_layers, w.BATCH * w.SEQ * run.model.hidden_size * 4
    pairs = (4 * layers + 2) * ga  # per block and pass, plus the root's per pass
    for r in measured[case]:
        assert "error" not in r, r
        b = r["bytes_per_step"]
        assert b["all_gather"] == pairs * act and b["reduce_scatter"] == pairs * act, b
        assert b["all_reduce"] == ga * (2 * 4 * w.BATCH * w.SEQ + 4), b  # the loss's max, sum-exp, sum


@pytest.mark.parametrize("case", AUTOTP)
def test_autotp_collectives_per_step(case, measured):
    _, ga = w.parse_case(case)
    run = w.bench_run("zero1-tp2", ga)
    layers, act = run.model.num_layers, w.BATCH * w.SEQ * run.model.hidden_size * 4
    for r in measured[case]:
        assert "error" not in r, r
        b = r["bytes_per_step"]
        assert set(b) == {"all_reduce"}, b
        assert b["all_reduce"] == (2 + 5) * layers * ga * act + 4, b


@pytest.mark.parametrize("case", CASES + AUTOTP)
def test_planned_tp_comm_matches_measured(case, measured):
    from shardwise.plan.comm import plan_comm

    variant, ga = w.parse_case(case)
    run = w.bench_run(variant, ga)
    comm = plan_comm(run.model, run.hardware, run.train, run.engine_strategy)
    for r in measured[case]:
        b = r["bytes_per_step"]
        got = 2 * b.get("all_reduce", 0) + b.get("all_gather", 0) + b.get("reduce_scatter", 0)
        assert abs(comm.total - got) <= 0.05 * got, (comm.total, got)
