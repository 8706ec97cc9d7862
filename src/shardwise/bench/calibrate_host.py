"""The host's costs `shardwise calibrate` measures for the time model (specs/timing_model.py):
the gap per eager op when ops are too short to hide their launch, and FSDP2's hook cost."""

from __future__ import annotations

import statistics
import time
from typing import Any


def timed(fn, repeat: int, sync) -> float:
    """Median seconds of `fn` over `repeat` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def launch_gap(torch: Any, dev: Any, sync: Any, quick: bool) -> float:
    """Seconds per eager op when the ops are too short to hide the host: back-to-back in-place
    adds on a one-element tensor, so the device waits on each launch (the planner's `launch_s`)."""
    x = torch.zeros(1, device=dev)
    n = 500 if quick else 2000

    def burst():
        for _ in range(n):
            x.add_(1.0)

    return timed(burst, 3 if quick else 5, sync) / n


def fsdp2_hook_s(torch: Any, dev: Any, sync: Any, quick: bool) -> float | None:
    """Host seconds per FSDP2 hook (the planner's `fsdp2_hook_s`: per unit, per pass, per hook,
    2 hooks a pass): forward + backward of a stack of narrow layers each under `fully_shard`
    on a one-rank group, minus the same stack bare, over units × 2 passes × 2 hooks. Narrow
    layers keep the copies and GEMMs negligible: what is left is the hooks. None when this
    process already belongs to a process group (a launched calibration: its rank 0 cannot make a
    group of its own without every rank)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        return None
    layers, width = (8, 32) if quick else (16, 32)
    dist.init_process_group("gloo" if dev.type == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": dev} if dev.type == "cuda" else {}))
    try:
        def stack():
            torch.manual_seed(0)
            return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)

        bare, sharded = stack(), stack()
        for layer in sharded:
            fully_shard(layer)
        fully_shard(sharded)
        x = torch.randn(4, width, device=dev)

        def step(m):
            def run():
                m(x).sum().backward()
            return run

        repeat = 5 if quick else 20
        t_bare = timed(step(bare), repeat, sync)
        t_fsdp = timed(step(sharded), repeat, sync)
    finally:
        dist.destroy_process_group()
    return max(t_fsdp - t_bare, 0.0) / ((layers + 1) * 2 * 2)
