"""The recommender: sweep strategies × micro-batch × checkpointing × TP/PP, drop what does not
fit, rank by tokens/s per GPU, prefer the simpler strategy on near-ties, explain in numbers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import Evaluation, evaluate
from shardwise.specs import STRATEGIES, STRATEGY_NAMES, HardwareSpec, ModelSpec, Strategy, TrainSpec
from shardwise.specs.hardware import GIB
from shardwise.specs.strategy import StrategyKnobs

NEAR_TIE = 0.03  # within 3% tokens/s, the simpler strategy wins


@dataclass(frozen=True, slots=True)
class Recommendation:
    best: Evaluation
    runner_up: Evaluation | None
    candidates: int
    fitting: int
    reason: str


def _complexity(e: Evaluation) -> tuple:
    lay = e.memory.layout
    return (lay.tp * lay.pp, e.strategy.facts.simplicity, e.train.checkpointing != "none")


def sweep(model: ModelSpec, hw: HardwareSpec, base: TrainSpec, *, strategies=None,
          micro_batches=(1, 2, 4, 8), checkpointing=("none", "selective", "full"),
          tps=None, pps=None, margin: float = 0.05, knobs: StrategyKnobs | None = None) -> list[Evaluation]:
    """Every combination; the global batch (micro-batch × accumulation × dp) of `base` is kept
    where it divides, so that candidates train the same thing."""
    tps = tps or tuple(t for t in (1, 2, 4, 8) if t <= hw.gpus_per_node)
    pps = pps or tuple(p for p in (1, 2, 4) if p <= model.num_layers and hw.world_size % p == 0)
    out = []
    global_samples = base.micro_batch * base.grad_accum * hw.world_size  # of the pure-DP base
    for name, mb, ck, tp, pp in itertools.product(strategies or STRATEGY_NAMES, micro_batches,
                                                  checkpointing, tps, pps):
        try:
            s = Strategy.with_knobs(name, knobs, tp=tp, pp=pp)
            dp = hw.world_size // (tp * pp)
            ga = global_samples // (mb * dp) if dp and global_samples % (mb * dp) == 0 else 0
            if ga < 1:
                continue
            train = base.model_copy(update={"micro_batch": mb, "grad_accum": ga, "checkpointing": ck})
            out.append(evaluate(model, hw, train, s, margin=margin))
        except ShardwiseError:
            continue  # layout impossible for this model/hardware: not a candidate
    return out


def recommend(model: ModelSpec, hw: HardwareSpec, base: TrainSpec, **kw) -> Recommendation:
    evals = sweep(model, hw, base, **kw)
    fitting = [e for e in evals if e.fits]
    if not fitting:
        smallest = min(evals, key=lambda e: e.memory.gpu.total) if evals else None
        need = ""
        if smallest:
            m = smallest.memory
            need = (f"; the smallest, {_describe(smallest)}, needs {m.gpu.total / GIB:.1f} GiB per GPU "
                    f"(usable {m.usable_bytes / GIB:.1f}) and {m.host.total / GIB:.0f} GiB of host memory per node "
                    f"(have {m.host_capacity_bytes / GIB:.0f})")
        raise ShardwiseError(
            f"no configuration of {model.name} fits {hw.world_size}× {hw.gpu.name} "
            f"({hw.gpu.memory_bytes / 1e9:.0f} GB){need}: add GPUs, use LoRA, or a larger GPU"
        )
    fitting.sort(key=lambda e: -e.time.tokens_per_s_per_gpu)
    top = fitting[0].time.tokens_per_s_per_gpu
    near = [e for e in fitting if e.time.tokens_per_s_per_gpu >= top * (1 - NEAR_TIE)]
    best = min(near, key=_complexity)
    others = [e for e in fitting if e.strategy.name != best.strategy.name]
    runner = max(others, key=lambda e: e.time.tokens_per_s_per_gpu) if others else None
    return Recommendation(best, runner, len(evals), len(fitting), explain_choice(model, hw, best, runner, evals))


def _describe(e: Evaluation) -> str:
    lay = e.memory.layout
    extra = (f" tp{lay.tp}" if lay.tp > 1 else "") + (f" pp{lay.pp}" if lay.pp > 1 else "")
    return (f"{e.strategy.name}{extra} (micro-batch {e.train.micro_batch} × accum {e.train.grad_accum}, "
            f"checkpointing {e.train.checkpointing})")


def explain_choice(model: ModelSpec, hw: HardwareSpec, best: Evaluation, runner: Evaluation | None,
                   evals: list[Evaluation]) -> str:
    m, t = best.memory, best.time
    lines = [
        f"{_describe(best)}: {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {t.mfu:.0%}, "
        f"{m.gpu.total / GIB:.1f} of {m.capacity_bytes / GIB:.1f} GiB per GPU.",
    ]
    if t.exposed_fraction > 0.3:
        lines.append(f"Binding constraint: communication — {t.exposed_comm_s:.2f} s of the {t.step_s:.2f} s step "
                     f"is exposed ({best.comm.total / 1e9:.1f} GB moved per GPU per step).")
    elif t.offload_s > 0.3 * t.step_s:
        lines.append(f"Binding constraint: offload — {t.offload_s:.2f} s of the {t.step_s:.2f} s step is "
                     f"PCIe transfers and the CPU optimizer.")
    else:
        lines.append(f"Binding constraint: compute ({t.compute_s:.2f} s of a {t.step_s:.2f} s step); memory leaves "
                     f"{(m.usable_bytes - m.gpu.total) / GIB:.1f} GiB of head room.")
    non_fit = {e.strategy.name for e in evals} - {e.strategy.name for e in evals if e.fits}
    if non_fit:
        lines.append(f"Do not fit in any swept setting: {', '.join(sorted(non_fit, key=lambda n: STRATEGIES[n].simplicity))}.")
    if runner:
        r = runner.time
        lines.append(f"Runner-up: {_describe(runner)} at {r.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
                     f"({r.tokens_per_s_per_gpu / t.tokens_per_s_per_gpu - 1:+.1%}).")
        lines.append(_what_flips(model, hw, best, runner))
    return " ".join(lines)


def _scaled_links(hw: HardwareSpec, factor: float) -> HardwareSpec:
    return hw.model_copy(update={
        link: getattr(hw, link).model_copy(update={"bus_bytes_per_s": getattr(hw, link).bus_bytes_per_s * factor})
        for link in ("intra", "inter")
    })


def _what_flips(model: ModelSpec, hw: HardwareSpec, best: Evaluation, runner: Evaluation) -> str:
    """Scale the interconnect bandwidth (up first, then down) until the runner-up overtakes."""
    for factor in (2, 4, 8, 16, 0.5, 0.25, 0.1):
        scaled = _scaled_links(hw, factor)
        b = evaluate(model, scaled, best.train, best.strategy).time.tokens_per_s_per_gpu
        r = evaluate(model, scaled, runner.train, runner.strategy).time.tokens_per_s_per_gpu
        if r > b:
            return (f"With {factor:g}× the bandwidth, {runner.strategy.name} would win "
                    f"({r:,.0f} vs {b:,.0f} tokens/s per GPU).")
    return "No bandwidth between 0.1× and 16× flips the ranking."
