"""The 40% rule, made measurable: when the communication a step exposes (measured by `shardwise
bench`) is more than COMM_BOUND_SHARE of the step, say so and name the strategy the planner
expects to fix it.

The planner is asked, not a table: the same model, hardware and training settings (micro-batch,
accumulation, precision, checkpointing, the run's engine knobs) are evaluated under every
strategy `shardwise train` runs at this world size; among those that fit, the one with the least
predicted exposed communication per step (ties: more tokens/s) is named, with its numbers.
"""

from __future__ import annotations

from typing import Any

from shardwise.numfmt import rate

COMM_BOUND_SHARE = 0.40


def candidates(model: Any, hw: Any, train: Any, strategy: Any) -> list[Any]:
    """The run under every trainer-runnable strategy, with the run's own engine knobs."""
    from shardwise.config.strategy import STRATEGY_NAMES, StrategyKnobs
    from shardwise.errors import ShardwiseError
    from shardwise.plan.evaluate import evaluate
    from shardwise.specs import Strategy

    knobs = StrategyKnobs(shard_group=strategy.shard_group, ds=strategy.ds, fsdp=strategy.fsdp, ddp=strategy.ddp)
    out = []
    for name in STRATEGY_NAMES:
        try:
            s = Strategy.with_knobs(name, knobs)
            if not s.trainable:
                continue
            out.append(evaluate(model, hw, train, s))
        except ShardwiseError:  # not possible at this world size / layout
            continue
    return out


def _numbers(e: Any) -> dict[str, Any]:
    t = e.time
    return {"strategy": e.strategy.name, "exposed_comm_s": t.exposed_comm_s, "step_s": t.step_s,
            "exposed_comm_share": t.exposed_fraction, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
            "memory_total_bytes": e.memory.gpu.total, "fits": e.fits}


def comm_bound(exposed_comm_s: float | None, step_s: float | None, model: Any, hw: Any, train: Any,
               strategy: Any, threshold: float = COMM_BOUND_SHARE, hardware: str | None = None) -> dict[str, Any]:
    """The rule's verdict on one measured step; with `bound`, the planner's fix. `hardware`
    names what the plan prices (default: the GPU count and name)."""
    share = exposed_comm_s / step_s if exposed_comm_s is not None and step_s else None
    out: dict[str, Any] = {"threshold": threshold, "measured_share": share,
                           "bound": share is not None and share > threshold}
    if share is None or not out["bound"]:
        return out
    evals = candidates(model, hw, train, strategy)
    current = next((e for e in evals if e.strategy.name == strategy.name), None)
    fitting = [e for e in evals if e.fits]
    best = min(fitting, key=lambda e: (e.time.exposed_comm_s, -e.time.tokens_per_s_per_gpu)) if fitting else None
    out["current_predicted"] = _numbers(current) if current is not None else None
    out["fix"] = _numbers(best) if best is not None else None
    out["message"] = message(share, threshold, strategy.name, out["fix"], out["current_predicted"],
                             hardware or f"{hw.world_size}x {hw.gpu.name}")
    return out


def _dur(s: float) -> str:
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def message(share: float, threshold: float, current: str, fix: dict[str, Any] | None,
            now: dict[str, Any] | None, hardware: str) -> str:
    head = (f"Communication is {share:.0%} of the measured step (exposed, the rule's limit is {threshold:.0%}): "
            f"this run is communication-bound.")
    if fix is None:
        return head + " No strategy that shardwise train runs fits this model on " + hardware + "."
    pred = (f"{_dur(fix['exposed_comm_s'])} of exposed communication, {fix['exposed_comm_share']:.1%} of a "
            f"{_dur(fix['step_s'])} step, {rate(fix['tokens_per_s_per_gpu'])} tokens/s per GPU, "
            f"{fix['memory_total_bytes'] / 2**30:.2f} GiB per GPU")
    vs = ""
    if now is not None:
        vs = (f"; for {current} it predicts {_dur(now['exposed_comm_s'])} "
              f"({now['exposed_comm_share']:.1%} of {_dur(now['step_s'])})")
    left = "more tokens per step (micro-batch, accumulation) or a faster link is what is left"
    gap = ""
    if now is not None and now["exposed_comm_share"] <= threshold:
        gap = (f" The plan itself expects {now['exposed_comm_share']:.1%} for {current}, not {share:.0%}: the links "
               "are slower than planned (`shardwise calibrate`, then plan with --profile / hardware.profile).")
    if fix["strategy"] == current:
        return (head + f" The planner ({hardware}) expects no other strategy that shardwise train runs to expose "
                f"less than {current} ({pred}): {left}.{gap}")
    if fix["exposed_comm_share"] > threshold:
        return (head + f" The planner ({hardware}) expects {fix['strategy']} to expose the least ({pred}{vs}), "
                f"still over {threshold:.0%}: {left}.{gap}")
    return head + f" The planner ({hardware}) expects {fix['strategy']} to fix it: {pred}{vs}.{gap}"
