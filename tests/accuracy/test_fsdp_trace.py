"""The planner's FSDP2 peak at full model size against torch's own FSDPMemTracker, tracing one
bf16-mixed AdamW step on a fake process group with fake tensors (no GPU, ~10 s and <0.5 GB
per case). The planner is compared without its runtime overhead (CUDA context, NCCL,
fragmentation), which fake tensors cannot have. More cases: benchmarks/fsdp_trace.py."""

from __future__ import annotations

import pytest

from shardwise.plan.evaluate import memory_as_run

pytest.importorskip("torch")
from shardwise.bench.fsdp_trace import trace_fsdp

TOL = 0.10


@pytest.mark.parametrize(
    "model, world, seq, mb, ckpt, strategy",
    [
        ("llama-2-7b", 8, 2048, 1, "none", "fsdp"),  # activation-bound, small vocab
        ("qwen2.5-7b", 8, 2048, 2, "full", "fsdp"),  # checkpointed, 152k vocab: logits-bound
    ],
)
def test_planned_peak_matches_traced_fsdp2_step(model, world, seq, mb, ckpt, strategy):
    traced = trace_fsdp(model, world, seq, mb, ckpt, strategy)
    run = traced["run"]  # the planner sees exactly the run the trace built (the run bridge)
    g = memory_as_run(run.model, run.hardware, run.train, run.strategy).gpu
    planned = g.total - g.runtime_overhead
    err = planned / traced["total"] - 1
    assert abs(err) <= TOL, (
        f"planned {planned / 2**30:.2f} GiB vs traced {traced['total'] / 2**30:.2f} GiB ({err:+.1%}); "
        f"traced parts {traced['parts']}"
    )
    # the sharded states are the same bytes in both: Ψ/N fp32 params, 8 bytes of Adam per param
    assert traced["parts"]["Sharded Param"] == pytest.approx(g.params, rel=0.01)
    assert traced["parts"]["OptState"] == pytest.approx(g.optimizer_states, rel=0.01)
