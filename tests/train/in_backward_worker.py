"""Ranks for tests/train/test_in_backward.py: the bench model (shardwise.bench.worker) under FSDP2
on 2 gloo ranks, one step with the stock optimizer step and one with `optimizer.in_backward`,
recording the gradient bytes this rank holds at every moment a gradient becomes final: the
largest is the step's gradient peak. Stock: a probe hook on each sharded parameter (FSDP2 runs
it after the group's reduce-scatter), and once more at the end of backward. In backward: the
same count taken as each parameter's step starts, its own gradient still alive."""

from __future__ import annotations

from worker_common import measure_ranks


def grad_bytes(module) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in module.parameters():
        g = p.grad
        if g is not None:
            local = g.to_local() if isinstance(g, DTensor) else g
            total += local.numel() * local.element_size()
    return total


def measure(rank: int, in_backward: bool) -> int:
    import torch

    from shardwise.bench import worker
    from shardwise.run import run_spec
    from shardwise.train.engines import _torch_common, build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.model.build import build_model

    cfg = worker.bench_config("fsdp")
    cfg = cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"in_backward": in_backward})})
    run = run_spec(cfg, worker.WORLD, "cpu", environ={})
    seen: list[int] = []
    step_one = _torch_common.InBackwardAdamW._step_one
    if in_backward:  # before the engine registers its hooks (bound to this method)

        def probed(self, p):
            seen.append(grad_bytes(engine.module))
            step_one(self, p)

        _torch_common.InBackwardAdamW._step_one = probed
    engine = build_engine(build_model(run), run, DistEnv(rank=rank, world_size=worker.WORLD, local_rank=rank,
                                                        device="cpu"))
    if not in_backward:
        for p in engine.module.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: seen.append(grad_bytes(engine.module)))
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, run.model.vocab_size, (worker.BATCH, worker.SEQ), generator=g)
    worker.micro_step(engine, {"input_ids": ids, "labels": ids.clone()}, last=True)
    seen.append(grad_bytes(engine.module))  # the end of backward, before the step
    engine.step()
    engine.zero_grad()
    engine.close()
    if in_backward:
        _torch_common.InBackwardAdamW._step_one = step_one
    return max(seen)


def rank_main(rank: int, names: list[str], out_dir: str) -> None:
    measure_ranks(rank, names, out_dir, lambda r, name: {"grad_peak": measure(r, in_backward=name == "in_backward")})
