"""The planner: pure functions from (model, hardware, training setup, strategy) to costs.

No torch, no I/O: `benchmarks/plan_sweep.py` sweeps thousands of configurations in well under
a second.
"""

from shardwise.plan.breakdown import HostBreakdown, MemoryBreakdown
from shardwise.plan.flops import flops_per_token, model_flops_per_token
from shardwise.plan.memory import MemoryPlan, plan_memory

__all__ = [
    "HostBreakdown",
    "MemoryBreakdown",
    "MemoryPlan",
    "flops_per_token",
    "model_flops_per_token",
    "plan_memory",
]
