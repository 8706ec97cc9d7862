"""Ranks for tests/train/test_low_bit_optimizer.py: the bench model (shardwise.bench.worker) under
FSDP2 on 2 gloo ranks, the engine built with each optimizer.name in turn, and a census of the
optimizer-state bytes this rank holds: each moment's local tensors (the DTensor shard's codes
and scales where quantized, its fp32 values where not), the step counts left out. The low-bit
states exist from the engine's build (shardwise.train.engines.low_bit.init_states); AdamW's are
created as its first step would create them (the engine's own `_init_optimizer_state`). Also
recorded: the optimizer's class and its groups' hyperparameters (weight decay 0.1: two groups)."""

from __future__ import annotations

from worker_common import measure_ranks


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def census(optimizer) -> dict[str, int]:
    """{"bytes": the moments' bytes on this rank, "quantized": elements whose moments are codes,
    "full": elements whose moments are fp32}."""
    out = {"bytes": 0, "quantized": 0, "full": 0}
    for st in optimizer.state.values():
        for m in ("exp_avg", "exp_avg_sq"):
            t = local(st[m])
            parts = [t.codes, t.scale] if hasattr(t, "codes") else [t]
            out["bytes"] += sum(x.numel() * x.element_size() for x in parts)
        out["quantized" if hasattr(t, "codes") else "full"] += t.numel()
    return out


def measure(rank: int, name: str) -> dict[str, int]:
    from shardwise.bench import worker
    from shardwise.run import run_spec
    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.model.build import build_model

    cfg = worker.bench_config("fsdp")  # weight decay on: two groups, decayed and not
    cfg = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"name": name, "weight_decay": 0.1})})
    run = run_spec(cfg, worker.WORLD, "cpu", environ={})
    engine = build_engine(build_model(run), run, DistEnv(rank=rank, world_size=worker.WORLD, local_rank=rank,
                                                        device="cpu"))
    engine._init_optimizer_state()
    result = census(engine.optimizer)
    result["params"] = sum(local(p).numel() for p in engine.module.parameters())
    result["groups"] = [{"params": len(g["params"]), "lr": float(g["lr"]), "betas": list(g["betas"]), "eps": g["eps"],
                         "weight_decay": g["weight_decay"]} for g in engine.optimizer.param_groups]
    result["class"] = type(engine.optimizer).__name__
    engine.close()
    return result


def rank_main(rank: int, names: list[str], out_dir: str) -> None:
    measure_ranks(rank, names, out_dir, measure, quiet=True)
