"""`shardwise bench`, rank side: the trainer's own rank body with the bench's hooks installed.

`python -m shardwise.bench.run_bench CONFIG --set ...` is one rank of a point that
`shardwise.bench.points` spawned; under an outer launcher (torchrun, deepspeed, srun) the CLI
process is the rank and calls `run_rank` in-process (`gather=True`: the per-rank results are
all-gathered over the trainer's process group just before it is destroyed, so no shared
filesystem is needed).

The rank runs `shardwise.train.cli._worker` (watchdog, process group, metrics, the one loop)
with hooks installed from outside: `shardwise.train.loop.build_engine` returns the real engine
wrapped in `_Instrumented`, the engine module's `forward_loss_sum` marks the end of the forward
(forward = model + loss, backward = the rest of `forward_backward`), `Metrics.log_step` copies
the loop's StepRecords, and `WaitRecorder` times the training thread's waits on collectives.
What is measured, and on which steps: shardwise.bench.probe.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from shardwise import strict_json
from shardwise.bench.probe import OUT_ENV, Probe

_Probe = Probe


class _Instrumented:
    """The real engine, with forward_backward / step / zero_grad measured; all else delegated."""

    def __init__(self, engine: Any, probe: _Probe) -> None:
        self.__dict__["_engine"], self.__dict__["_probe"] = engine, probe
        probe.attach(engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def forward_backward_step(self, micro: list[dict[str, Any]], loss_scale: float) -> Any:
        from shardwise.train.engines.base import accumulate

        return accumulate(self, micro, loss_scale)  # each micro-batch through the measured forward_backward

    def forward_backward(self, batch: dict[str, Any], loss_scale: float) -> Any:
        p = self._probe
        p.begin_forward_backward(batch)
        with p.counting():
            out = self._engine.forward_backward(batch, loss_scale)
        p.end_forward_backward(batch, self._engine)
        return out

    def step(self) -> float:
        p = self._probe
        t0 = p.begin_step()
        with p.counting():
            norm = self._engine.step()
        p.end_step(t0)
        return norm

    def zero_grad(self) -> None:
        p = self._probe
        t0 = p._mark()
        with p.counting():
            self._engine.zero_grad()
        p.end_zero_grad(t0)


_ENGINE_MODULES = {"deepspeed": "shardwise.train.engines.deepspeed", "fsdp2": "shardwise.train.engines.fsdp",
                   "ddp": "shardwise.train.engines.ddp"}


@contextmanager
def _installed(probe: _Probe):
    """The three hooks, undone on exit."""
    import importlib
    from dataclasses import asdict

    from shardwise.train import loop
    from shardwise.train.observe import metrics

    engine_mod = importlib.import_module(_ENGINE_MODULES[probe.run.engine_strategy.engine])
    orig_build, orig_loss, orig_log = loop.build_engine, engine_mod.forward_loss_sum, metrics.Metrics.log_step
    orig_summary = metrics.print_summary

    def build_engine(model, run, env, **kw):
        return _Instrumented(orig_build(model, run, env, **kw), probe)

    def forward_loss_sum(*args, **kwargs):  # the model call and the loss (either implementation)
        out = orig_loss(*args, **kwargs)
        probe.loss_done()
        return out

    def log_step(self, rec):
        orig_log(self, rec)
        probe.records.append(asdict(rec))

    loop.build_engine, engine_mod.forward_loss_sum, metrics.Metrics.log_step = build_engine, forward_loss_sum, log_step
    metrics.print_summary = lambda *args, **kwargs: None  # the parent prints one table for the bench
    try:
        yield
    finally:
        loop.build_engine, engine_mod.forward_loss_sum, metrics.Metrics.log_step = orig_build, orig_loss, orig_log
        metrics.print_summary = orig_summary



@contextmanager
def _recording(probe: Probe) -> Iterator[None]:
    """The wait recorder installed for the rank's lifetime; the layer hooks removed after."""
    probe.waits.install()
    try:
        yield
    finally:
        probe.waits.uninstall()
        probe.timeline.detach()


@contextmanager
def _gathered(probe: Probe, holder: list[list[dict[str, Any]]], keep_group: bool) -> Iterator[None]:
    """Every rank's result all-gathered over the default group just before `_worker` destroys it;
    with `keep_group` the group is kept for the next point of a sweep (re-creating it in the same
    processes fails under torchrun's store; `init_distributed` joins an existing one)."""
    import torch.distributed as dist

    orig = dist.destroy_process_group

    def destroy(group=None):
        if group is not None:
            return orig(group)
        if not holder and dist.is_initialized():
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, probe.result(None))
            holder.append(out)
        return None if keep_group else orig()

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = orig


def run_rank(run: Any, planned_bytes: float | None, rank: int, gather: bool = False,
             keep_group: bool = False) -> tuple[int, Probe, list[dict[str, Any]] | None]:
    """Train `run` as this rank with the bench's hooks; (exit code, probe, every rank's result
    when `gather`; `keep_group`: leave the process group up for another point)."""
    from shardwise.train import cli as train_cli

    probe = Probe(run, rank)
    holder: list[list[dict[str, Any]]] = []
    gathering = _gathered(probe, holder, keep_group) if gather else nullcontext()
    with _installed(probe), _recording(probe), gathering:
        rc = train_cli._worker(run, planned_bytes, None)
    return rc, probe, (holder[0] if holder else None)


def rank_main(argv: list[str] | None = None) -> int:
    """One rank of a bench point (started by `spawn`): the trainer's rank body, measured."""
    import argparse

    from shardwise import quiet
    from shardwise.config.load import load_config
    from shardwise.train.launch.rank import detect_env
    from shardwise.train.preflight import preflight

    quiet.apply()  # `shardwise bench --verbose` reaches the ranks through the environment
    ap = argparse.ArgumentParser(prog="shardwise.bench.run_bench")
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args(argv)
    found = detect_env() or {"rank": 0, "world_size": 1}
    rank, world = int(found["rank"]), int(found["world_size"])
    cfg = load_config(a.config, a.set)
    run, check = preflight(cfg, world, cfg.resolved_device(), force=True)  # the parent checked the plan
    rc, probe, _ = run_rank(run, check.planned_bytes, rank)
    out = Path(os.environ.get(OUT_ENV, cfg.checkpointing.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(strict_json.dumps(probe.result(rc)))
    tmp.replace(out / f"rank{rank}.json")
    return rc


if __name__ == "__main__":
    from shardwise.train.launch.rank import run_rank_script

    run_rank_script(rank_main)  # no interpreter shutdown: see its docstring (a gloo abort at exit)
