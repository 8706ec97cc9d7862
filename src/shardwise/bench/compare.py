"""One bench point set beside its plan: model-state bytes (census vs plan_memory), collective
bytes (CommCounter vs plan_comm), memory by phase, the step-time split (forward / backward /
optimizer / exposed communication, measured vs the planner's TimeBreakdown), the memory
timeline of one step, and the 40% rule (shardwise.bench.advice)."""

from __future__ import annotations

import statistics
from typing import Any

from shardwise.bench.probe import timed_steps
from shardwise.bench.steptime import PHASES, measured_split, predicted_split, rel_error, time_terms

PARTS = ("params", "grads", "master_params", "optimizer_states")
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "p2p", "all_to_all")
PREDICTED_KEYS = ("step_s", "compute_s", "gemm_s", "attention_s", "memory_bound_s", "optimizer_s", "host_s",
                  "offload_s", "comm_s", "exposed_comm_s", "tokens_per_s_per_gpu")


def _term(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    return {"predicted": predicted, "measured": measured, "rel_error": rel_error(predicted, measured)}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def memory_note(device: str) -> str:
    if device == "cuda":
        return ("memory_by_phase: torch.cuda.memory_stats() allocated/reserved peaks of each phase "
                "(peaks reset at each phase start), compared with the plan's phases")
    return ("memory_by_phase: host memory (process RSS at the end of each phase); it is not comparable with "
            "the GPU plan, which is compared on model-state bytes only (census)")


def _time_steps(steps: int, cuda: bool) -> tuple[list[int], int | None]:
    """(steps whose wall times are kept, the step whose exposed communication is read)."""
    from shardwise.bench.probe import profiled_step

    timed = timed_steps(steps)
    if not cuda:
        return timed, None
    prof = profiled_step(steps)
    return ([s for s in timed if s != prof] or timed), prof


def _rank_time(r: dict[str, Any], timed: list[int], prof: int | None) -> dict[str, Any]:
    sel = [s for s in r["steps"] if s["step"] in timed] or r["steps"]
    out: dict[str, Any] = {f"{ph}_s": _median([s[f"{ph}_s"] for s in sel]) or 0.0 for ph in PHASES}
    src = [s for s in r["steps"] if s["step"] == prof] if prof is not None else sel
    out["exposed_comm"] = {ph: _median([s["exposed"][ph] for s in src]) or 0.0 for ph in PHASES}
    errors = [s["exposed_error"] for s in src if "exposed_error" in s]
    if errors or (prof is not None and not src):
        out["exposed_comm_error"] = errors[0] if errors else f"step {prof} was not profiled"
    return out


def timing(p: Any, ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The measured step split beside the planner's, per term, with the relative error."""
    from shardwise.plan.evaluate import evaluate
    from shardwise.plan.flops import model_flops_per_token
    from shardwise.plan.timing import forward_share

    run, cuda = p.run, p.device == "cuda"
    timed, prof = _time_steps(steps, cuda)
    per_rank = [_rank_time(r, timed, prof) for r in ranks]
    records = ranks[0]["records"]
    sel = [rec for rec in records if rec["step"] in timed] or records
    step_s = _median([rec["step_time_s"] for rec in sel])
    tokens = sel[-1]["tokens"] if sel else 0
    tps = tokens / step_s if step_s else None
    fpt = model_flops_per_token(run.model, run.train.seq_len)
    peak = run.hardware.gpu.peak_flops(run.train.compute_dtype) if cuda else None
    # rank 0's split (its StepRecords give the step time); every rank's is kept under per_rank
    phase_s = {ph: per_rank[0][f"{ph}_s"] for ph in PHASES}
    exposed = per_rank[0]["exposed_comm"]
    planned = evaluate(run.model, run.hardware, run.train, run.strategy).time.as_dict()
    predicted = predicted_split(planned, forward_share(run.train))
    measured = measured_split(phase_s, exposed, step_s)
    profile = run.config.hardware.profile
    comparable = cuda or bool(profile)
    prices = (f"{run.hardware.world_size} ranks of the hardware profile {profile}" if profile else
              f"{run.hardware.world_size}x {run.hardware.gpu.name}")
    out: dict[str, Any] = {
        **{f"{ph}_s": phase_s[ph] for ph in PHASES}, "step_s": step_s,
        "exposed_comm_s": measured["exposed_comm"], "exposed_comm_by_phase": exposed,
        "exposed_comm_method": ranks[0].get("exposed_method"),
        "terms": time_terms(predicted, measured),
        "predicted": {k: planned[k] for k in PREDICTED_KEYS if k in planned},
        "comparable": comparable,
        "plan_prices": prices,
        "note": ("the plan prices " + prices
                 + ("" if comparable else "; this ran on the CPU, so the relative errors say how far this host is "
                    "from that GPU, not how good the model is (calibrate this host and pass "
                    "--set hardware.profile=FILE to compare like with like)")),
        "other_s": max(0.0, step_s - sum(phase_s.values())) if step_s else None,
        "tokens_per_s": tps, "tflops": tps * fpt / 1e12 if tps else None,
        "mfu": tps * fpt / (peak * p.world) if tps and peak else None,
        "timed_steps": timed, "profiled_step": prof, "per_rank": per_rank,
    }
    if "exposed_comm_error" in per_rank[0]:
        out["exposed_comm_error"] = per_rank[0]["exposed_comm_error"]
    return out


def compare(p: Any, ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Predicted and measured side by side for one point."""
    from shardwise.bench.advice import comm_bound
    from shardwise.plan.comm import plan_comm
    from shardwise.plan.evaluate import memory_as_run

    run = p.run
    plan = memory_as_run(run.model, run.hardware, run.train, run.strategy)
    comm_plan = plan_comm(run.model, run.hardware, run.train, plan.engine_strategy, plan.layout)
    cuda = p.device == "cuda"
    # model states: the planner's per-GPU bytes against the largest rank's census
    states = {t: _term(float(getattr(plan.gpu, t)), float(max((r["census"] or {}).get(t, 0) for r in ranks)))
              for t in PARTS}
    total_m = max(sum((r["census"] or {}).get(t, 0) for t in PARTS) for r in ranks)
    states["model_states"] = _term(float(plan.gpu.model_states), float(total_m))
    # collectives of the instrumented (last) step, bytes per rank as the planner counts them
    measured_comm = [(r["comm"] or {}).get("bytes", {}) for r in ranks]
    kinds = [k for k in COMM_KINDS if getattr(comm_plan, k) or any(m.get(k) for m in measured_comm)]
    comm = {k: _term(float(getattr(comm_plan, k)), float(max(m.get(k, 0) for m in measured_comm))) for k in kinds}
    # memory by phase, per rank (the instrumented step's readings; on CPU: host RSS)
    memory = {}
    for r in ranks:
        last = r["steps"][-1]["memory"] if r["steps"] else {}
        memory[f"rank{r['rank']}"] = {ph: last.get(ph, {}) for ph in PHASES}
    t = timing(p, ranks, steps)
    records = ranks[0]["records"]
    doc: dict[str, Any] = {
        "label": p.label, "short": " ".join(o.partition("=")[2] for o in p.overrides) or p.label,
        "overrides": p.overrides, "strategy": run.strategy.name, "engine": run.engine_strategy.engine,
        "world_size": p.world, "device": p.device, "micro_batch": run.config.run.micro_batch,
        "grad_accum": run.config.run.grad_accum, "seq_len": run.train.seq_len,
        "model_states": states, "comm": comm,
        "comm_step": steps, "comm_steady_state": steps >= 3,
        "memory_kind": "cuda_allocator" if cuda else "host_rss",
        "memory_by_phase": memory, "time": t,
        "memory_timeline": {"step": steps, "kind": "cuda_allocator" if cuda else "host_rss",
                            "ranks": {f"rank{r['rank']}": r.get("timeline") or {} for r in ranks}},
        "comm_bound": comm_bound(t["exposed_comm_s"], t["step_s"], run.model, run.hardware, run.train,
                                 run.strategy, hardware=t["plan_prices"]),
        "final_loss": records[-1]["loss"] if records else None,
    }
    if cuda:  # the plan's allocator figures exist only to compare with the allocator
        ph = plan.gpu.phases
        doc["memory_plan"] = {**ph, "allocated": plan.gpu.allocated,
                              "reserved": plan.gpu.reserved}
    return doc
