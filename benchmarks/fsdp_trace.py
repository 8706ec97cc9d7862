"""Planned vs traced FSDP2 peak memory at full model size, on this CPU-only machine.

For each configuration: `plan_memory` (strategy fsdp / fsdp-grad-op, bf16-mixed AdamW) against
FSDPMemTracker's peak of one traced step on a fake process group (shardwise.bench.fsdp_trace).
The planner's figure is compared without its runtime overhead (CUDA context, NCCL buffers,
allocator fragmentation), which fake tensors do not have. Writes
benchmarks/results/fsdp_trace.json.

    python benchmarks/fsdp_trace.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shardwise.bench.fsdp_trace import trace_fsdp
from shardwise.plan.evaluate import memory_as_run

OUT = Path(__file__).parent / "results" / "fsdp_trace.json"
CASES = [  # model, world, seq, micro-batch, checkpointing, strategy
    ("llama-2-7b", 8, 2048, 1, "none", "fsdp"),
    ("llama-2-7b", 8, 2048, 1, "none", "fsdp-grad-op"),
    ("llama-2-7b", 8, 4096, 2, "full", "fsdp"),
    ("llama-3.1-8b", 8, 4096, 1, "none", "fsdp"),
    ("qwen2.5-7b", 8, 2048, 2, "full", "fsdp"),
    ("llama-2-13b", 16, 2048, 1, "none", "fsdp"),
]


def compare(model_name, world, seq, mb, ckpt, strategy) -> dict:
    traced = trace_fsdp(model_name, world, seq, mb, ckpt, strategy)
    run = traced["run"]  # the planner sees exactly the run the trace built (the run bridge)
    g = memory_as_run(run.model, run.hardware, run.train, run.strategy).gpu
    planned = g.total - g.runtime_overhead
    return {
        "model": model_name, "world": world, "seq_len": seq, "micro_batch": mb, "checkpointing": ckpt,
        "strategy": strategy, "traced_peak": traced["total"], "planned_peak_without_overhead": planned,
        "rel_error": planned / traced["total"] - 1, "traced_parts": traced["parts"],
        "planned_parts": g.as_dict(), "trace_seconds": round(traced["seconds"], 1),
    }


def main() -> int:
    rows = []
    for case in CASES:
        r = compare(*case)
        rows.append(r)
        print(f"{r['model']:13s} w{r['world']:<3d} s{r['seq_len']:<5d} b{r['micro_batch']} {r['checkpointing']:5s} "
              f"{r['strategy']:13s} traced {r['traced_peak'] / 2**30:6.2f} GiB  planned "
              f"{r['planned_peak_without_overhead'] / 2**30:6.2f} GiB  {r['rel_error']:+.1%}", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"what": __doc__.strip().splitlines()[0], "cases": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
