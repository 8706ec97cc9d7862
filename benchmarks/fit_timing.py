"""Fit the time model honestly, and report every figure held out.

The cases are the 11 runs of shardwise's trainer on one H200 (`h200_cases.py`, source
`shardwise-h200`) and every published run with a tokens/s figure (`accuracy.py`, one source per
YAML), except the fp8, the context-parallel and the expert-parallel ones: they test plan/fp8.py
(whose rate and casts are derived and whose GEMM efficiency is the bf16 kernels', assumed),
plan/context.py and plan/experts.py, so they are reported held out, never fitted on. The
candidates are the entries of `src/shardwise/catalog/timing.yaml` that carry
`bounds` (engine constants, and the GPU families' kernel efficiencies); each also carries a
`prior`, a value no tokens/s figure informed (measured elsewhere, derived, or assumed with a
citation).

A candidate *informs* a case when moving it across its bounds moves the case's planned
tokens/s by more than INFORM (2%). Then, on a set of training cases:

1. a candidate informed by at least 3 cases from at least 2 sources is **fitted**: least
   squares on log(planned / measured tokens/s), every source weighted equally, over the cases
   that no machine constant (below) informs; a fitted value at its bound fails the fit;
2. a host constant (`machine: true`: an engine's hooks, DeepSpeed's step, the host optimizer)
   is a property of the machine that ran the case, never fitted across sources: it is measured
   on the H200 host's cases that inform it (a one-constant solve of their step times, the
   fitted constants fixed), labelled `measured` with those cases, which are in-sample for it;
   with no training case left to inform it, it keeps its prior;
3. everything else keeps its prior (measured elsewhere, derived or assumed, and labelled so).

Held out by construction: leave-one-out (LOO) refits without each H200 case, leave-one-source-
out (LOSO) without each source, and each held-out case is planned with constants that never saw
it. `--write` puts the all-cases fit into catalog/timing.yaml; the default run writes
benchmarks/results/timing_fit.json (tests/accuracy/test_accuracy_doc.py regenerates it and fails when
the committed file differs).

    python benchmarks/fit_timing.py            # fit, LOO, LOSO -> benchmarks/results/timing_fit.json
    python benchmarks/fit_timing.py --write    # and write the fit into catalog/timing.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import yaml
from scipy.optimize import least_squares

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import accuracy  # noqa: E402  (benchmarks/ scripts)
import h200_cases  # noqa: E402

from shardwise import catalog  # noqa: E402
from shardwise.errors import ShardwiseError  # noqa: E402
from shardwise.plan.comm import plan_comm  # noqa: E402
from shardwise.plan.evaluate import memory_as_run  # noqa: E402
from shardwise.plan.timing import step_time  # noqa: E402

TIMING_YAML = HERE.parent / "src" / "shardwise" / "catalog" / "timing.yaml"
OUT = HERE / "results" / "timing_fit.json"
H200_SOURCE = "shardwise-h200"
INFORM = 0.02  # a candidate informs a case when it moves the case's tokens/s by more than 2%
MIN_CASES, MIN_SOURCES = 3, 2
AT_BOUND = 0.01  # a fitted value within 1% of its range from a bound is at the bound


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    measured: float  # tokens/s per GPU
    model: object
    hw: object
    train: object
    strategy: object  # what runs (FSDP2 with a one-rank group may run as DDP)
    layout: object
    comm: object

    def tokens_per_s(self, values: dict[str, float]) -> float:
        hw = apply(self.hw, values)
        return step_time(self.model, hw, self.train, self.strategy, self.layout, self.comm).tokens_per_s_per_gpu


def _case(name, source, measured, model, hw, train, strategy) -> Case:
    mem = memory_as_run(model, hw, train, strategy, margin=0.0)
    runs = mem.engine_strategy
    return Case(name, source, measured, model, hw, train, runs, mem.layout,
                plan_comm(model, hw, train, runs, mem.layout))


@cache
def all_cases() -> tuple[Case, ...]:
    out = []
    for c in h200_cases.load_cases():
        out.append(_case(c["name"], H200_SOURCE, c["measured"]["tokens_per_s"], *h200_cases.specs(c)))
    for run in accuracy.load_runs():
        tps = (run.get("published") or {}).get("tokens_per_s_per_gpu")
        if run.get("skip") or not tps:
            continue
        if (run.get("train") or {}).get("fp8", "none") != "none":
            continue  # fp8 runs test the fp8 model (plan/fp8.py), whose constants no run fits: held out of the fit
        if run.get("cp", 1) > 1 or run.get("ep", 1) > 1:
            continue  # so do context- and expert-parallel runs (plan/context.py, plan/experts.py): held out
        if run.get("held_out"):
            continue  # a run whose published figure its stated settings cannot reach (its reason beside it)
        try:
            out.append(_case(run["name"], run["_source"]["id"], tps, *accuracy.build(run)))
        except ShardwiseError:
            continue
    return tuple(out)


# --- the candidates ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    name: str  # "engine.<constant>" or "<family>.<efficiency>"
    lo: float
    hi: float
    prior: float
    prior_kind: str
    prior_basis: str
    machine: bool  # a property of the host that ran a case (measured per machine, not fitted)


def _entries() -> dict[str, dict]:
    doc = yaml.safe_load(TIMING_YAML.read_text())
    out = {f"engine.{k}": v for k, v in doc["engine"].items()}
    for fam, effs in doc["families"].items():  # a family's `borrow`/`basis` strings are no constants
        out |= {f"{fam}.{k}": v for k, v in effs.items() if isinstance(v, dict)}
    return out


def candidates() -> list[Candidate]:
    out = []
    for name, e in _entries().items():
        if "bounds" in e:
            p = e["prior"]
            out.append(Candidate(name, float(e["bounds"][0]), float(e["bounds"][1]), float(p["value"]),
                                 p["kind"], p["basis"], bool(e.get("machine", False))))
    return out


@cache
def _stated_by(family: str, name: str) -> str:
    """The family whose value of efficiency `name` `family` runs with: itself, or the one it
    borrows it from (following borrows: catalog/timing.yaml)."""
    seen = {family}
    while (base := catalog.family_borrows(family).get(name)) and base not in seen:
        family = base
        seen.add(family)
    return family


def apply(hw, values: dict[str, float]):
    """`hw` with candidate values in place (unvalidated copies: the fit's inner loop); a family
    that borrows an efficiency takes the candidate of the family it borrows from."""
    engine = {k[7:]: v for k, v in values.items() if k.startswith("engine.")}
    gpu = {}
    for k, v in values.items():
        fam, _, name = k.partition(".")
        if fam != "engine" and _stated_by(hw.gpu.family, name) == fam:
            gpu[name] = v
    update = {}
    if engine:
        update["timing"] = hw.timing.model_copy(update=engine)
    if gpu:
        update["gpu"] = hw.gpu.model_copy(update=gpu)
    return hw.model_copy(update=update) if update else hw


def priors(cands: list[Candidate]) -> dict[str, float]:
    return {c.name: c.prior for c in cands}


def informed(cands: list[Candidate], cases: list[Case], at: dict[str, float]) -> dict[str, list[Case]]:
    """The cases each candidate informs, judged at the values `at`."""
    out = {}
    for c in cands:
        hits = []
        for case in cases:
            lo = case.tokens_per_s(at | {c.name: c.lo})
            hi = case.tokens_per_s(at | {c.name: c.hi})
            if abs(math.log(hi / lo)) > INFORM:
                hits.append(case)
        out[c.name] = hits
    return out


class FitError(ShardwiseError):
    pass


def fit(cases: list[Case], cands: list[Candidate] | None = None, strict: bool = True,
        inf_all: dict[str, list[Case]] | None = None) -> dict:
    """The values and provenance of every candidate from `cases` (see the module doc).
    `inf_all`: the cases each candidate informs among a superset of `cases` (judged at the
    priors, so one judgement serves every held-out fit)."""
    cands = cands if cands is not None else candidates()
    values = priors(cands)
    names = {k.name for k in cases}
    if inf_all is None:
        inf_all = informed(cands, cases, values)
    inf = {n: [k for k in hits if k.name in names] for n, hits in inf_all.items()}
    # A host constant (an engine's hooks, its step bookkeeping, the host optimizer) belongs to the
    # machine that ran the case: it is measured there, never fitted across sources.
    fitted = [c for c in cands if not c.machine and len(inf[c.name]) >= MIN_CASES
              and len({k.source for k in inf[c.name]}) >= MIN_SOURCES]
    # machine constants are measured on the one host whose runs we have (the H200's), and planned
    # for every other source with that host's value; any other candidate the cases do not
    # inform enough keeps its prior
    inf = {c.name: [k for k in inf[c.name] if k.source == H200_SOURCE] if c.machine else inf[c.name]
           for c in cands}
    machine = [c for c in cands if c.machine and inf[c.name]]
    machine_cases = {k.name for c in machine for k in inf[c.name]}
    train = [k for k in cases if k.name not in machine_cases]
    prov: dict[str, dict] = {c.name: {"kind": c.prior_kind, "basis": c.prior_basis} for c in cands}
    at_bound = []
    if fitted and train:
        n_src = {}
        for k in train:
            n_src[k.source] = n_src.get(k.source, 0) + 1
        lo = np.array([c.lo for c in fitted])
        hi = np.array([c.hi for c in fitted])

        def residuals(u):
            v = values | {c.name: float(x) for c, x in zip(fitted, lo + (hi - lo) * u, strict=True)}
            return [math.log(k.tokens_per_s(v) / k.measured) / math.sqrt(n_src[k.source]) for k in train]

        x0 = np.clip([(values[c.name] - c.lo) / (c.hi - c.lo) for c in fitted], 0.0, 1.0)
        res = least_squares(residuals, x0, bounds=(0, 1), x_scale=1.0)
        for c, u in zip(fitted, res.x, strict=True):
            values[c.name] = float(c.lo + (c.hi - c.lo) * u)
            if u < AT_BOUND or u > 1 - AT_BOUND:
                at_bound.append(c.name)
            srcs = sorted({k.source for k in inf[c.name] if k in train})
            prov[c.name] = {"kind": "fitted", "cases": sorted(k.name for k in inf[c.name] if k in train),
                            "sources": srcs,
                            "basis": f"least squares on log tokens/s, {len(train)} cases from {len(n_src)} sources "
                                     f"(benchmarks/fit_timing.py); informed by "
                                     f"{sum(k in train for k in inf[c.name])} cases from {len(srcs)} sources"}
    for _ in range(2):  # coordinate descent: machine constants can share cases (ZeRO-2: hooks and step)
        for c in machine:
            values[c.name] = _solve(c, inf[c.name], values)
    machine_at_bound = []
    for c in machine:
        mine = sorted(k.name for k in inf[c.name])
        u = (values[c.name] - c.lo) / (c.hi - c.lo)
        edge = ""
        if u < AT_BOUND or u > 1 - AT_BOUND:  # the cases do not resolve it within the physical range
            machine_at_bound.append(c.name)
            edge = f"; at its {'lower' if u < 0.5 else 'upper'} bound: these cases do not resolve it"
        prov[c.name] = {"kind": "measured", "cases": mine, "sources": sorted({k.source for k in inf[c.name]}),
                        "basis": f"solved from the step times of {', '.join(mine)} (in-sample for them; a property "
                                 f"of the host that ran them, measured there, not fitted across sources){edge}"}
    if strict and at_bound:
        raise FitError(f"fitted constants at a bound: {at_bound} ({ {n: values[n] for n in at_bound} }); "
                       "the model or the bounds are wrong")
    return {"values": values, "provenance": prov, "at_bound": at_bound, "machine_at_bound": machine_at_bound,
            "fitted": [c.name for c in fitted], "machine": [c.name for c in machine]}


def _solve(c: Candidate, cases: list[Case], values: dict[str, float]) -> float:
    """The value of one machine constant that best explains `cases` (squared log error), the
    others fixed: a log-spaced scan of its bounds, refined around the best point. (A step is
    the longer of GPU and host work, so the error is flat wherever the host hides: no gradient
    method starts well there.)"""
    from scipy.optimize import minimize_scalar

    lo, hi = (math.log(c.lo), math.log(c.hi)) if c.lo > 0 else (c.lo, c.hi)
    to_value = math.exp if c.lo > 0 else float

    def sse(x: float) -> float:
        v = values | {c.name: to_value(x)}
        return sum(math.log(k.tokens_per_s(v) / k.measured) ** 2 for k in cases)

    grid = np.linspace(lo, hi, 41)
    best = int(np.argmin([sse(x) for x in grid]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    return to_value(minimize_scalar(sse, bounds=(a, b), method="bounded", options={"xatol": 1e-4}).x)


def predict(cases: list[Case], values: dict[str, float]) -> dict[str, float]:
    return {k.name: k.tokens_per_s(values) for k in cases}


def held_out(cases: list[Case], groups: dict[str, list[Case]]) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Each group's cases planned with a fit to all other cases: {case: predicted tokens/s}, and
    the fitted constants that sat at a bound in each held-out fit."""
    cands = candidates()
    inf_all = informed(cands, cases, priors(cands))
    pred, bounds = {}, {}
    for key, out in groups.items():
        names = {k.name for k in out}
        f = fit([k for k in cases if k.name not in names], cands, strict=False, inf_all=inf_all)
        pred |= predict(out, f["values"])
        if f["at_bound"]:
            bounds[key] = f["at_bound"]
    return pred, bounds


def run() -> dict:
    cases = list(all_cases())
    full = fit(cases)
    in_sample = predict(cases, full["values"])
    h200 = [k for k in cases if k.source == H200_SOURCE]
    loo, loo_bounds = held_out(cases, {k.name: [k] for k in h200})
    sources = sorted({k.source for k in cases})
    loso, loso_bounds = held_out(cases, {s: [k for k in cases if k.source == s] for s in sources})
    rows = []
    for k in cases:
        row = {"name": k.name, "source": k.source, "measured": round(k.measured, 1),
               "in_sample": round(in_sample[k.name], 1), "loso": round(loso[k.name], 1)}
        if k.name in loo:
            row["loo"] = round(loo[k.name], 1)
        rows.append(row)
    return {
        "about": "planned vs measured tokens/s per GPU: in-sample (constants fitted on every case), leave-one-out "
                 "(H200 cases) and leave-one-source-out (every source); benchmarks/fit_timing.py",
        "inform_threshold": INFORM, "min_cases": MIN_CASES, "min_sources": MIN_SOURCES,
        "values": {k: float(f"{v:.4g}") for k, v in full["values"].items()},
        "provenance": full["provenance"], "fitted": full["fitted"], "machine": full["machine"],
        "machine_at_bound": full["machine_at_bound"],
        "held_out_at_bound": {"loo": loo_bounds, "loso": loso_bounds},
        "cases": rows,
    }


def write_yaml(result: dict) -> None:
    """Put the fit's values and provenance into catalog/timing.yaml (every other entry as it is)."""
    doc = yaml.safe_load(TIMING_YAML.read_text())
    for name, value in result["values"].items():
        where, key = name.split(".", 1)
        entry = doc["engine"][key] if where == "engine" else doc["families"][where][key]
        prov = result["provenance"][name]
        entry["value"] = value
        entry["kind"] = prov["kind"]
        entry["basis"] = prov["basis"]
        for k in ("cases", "sources"):
            if k in prov:
                entry[k] = prov[k]
            else:
                entry.pop(k, None)
    header = TIMING_YAML.read_text().split("\nengine:", 1)[0]
    TIMING_YAML.write_text(header + "\n" + yaml.safe_dump(doc, sort_keys=False, width=110, allow_unicode=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write the fit into catalog/timing.yaml")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    result = run()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.write:
        write_yaml(result)
    print(json.dumps({k: result[k] for k in ("values", "fitted", "machine", "held_out_at_bound")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
