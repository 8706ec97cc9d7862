"""Write the generated tables of docs/accuracy.md from the result files.

Every table between `<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->` in
docs/accuracy.md is rendered here from benchmarks/results/timing_fit.json (fit_timing.py),
h200_cases.json (h200_cases.py), accuracy_published.json (accuracy.py),
src/shardwise/catalog/timing.yaml and, for the per-GPU table, the catalog itself (each GPU's family and
its constants' provenance); the prose around them is hand-written and quotes no figure
these tables do not show. tests/accuracy/test_accuracy_doc.py regenerates the result files and this
doc and fails when a committed one differs.

    python benchmarks/accuracy_doc.py           # rewrite docs/accuracy.md's generated tables
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "accuracy.md"
TIMING_YAML = HERE.parent / "src" / "shardwise" / "catalog" / "timing.yaml"
H200_SOURCE = "shardwise-h200"
LOO_BAND = 0.25  # the held-out band for every H200 case
TPS_BAND = 0.20  # published runs
MEMORY_BAND = 0.10  # published peaks (benchmarks/accuracy.py)
DEVICE_BAND = 0.15  # the H200 device total against nvidia-smi (tests/accuracy/test_h200_cases.py)
BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n).*?(<!-- END GENERATED: (?P=name) -->)", re.S)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1


def _pct(x: float) -> str:
    return f"{x:+.1%}".replace("-", "−")


def summary(fit: dict) -> dict:
    """Within-band counts: H200 cases LOO and in-sample (±25%), published LOSO and in-sample (±20%)."""
    h200 = [r for r in fit["cases"] if r["source"] == H200_SOURCE]
    pub = [r for r in fit["cases"] if r["source"] != H200_SOURCE]

    def count(rows, key, band):
        return sum(abs(_err(r[key], r["measured"])) <= band for r in rows)

    def med(rows, key):
        return statistics.median(abs(_err(r[key], r["measured"])) for r in rows)

    return {
        "h200": {"n": len(h200), "loo": count(h200, "loo", LOO_BAND), "in_sample": count(h200, "in_sample", LOO_BAND),
                 "loo_median_abs": med(h200, "loo"), "in_sample_median_abs": med(h200, "in_sample")},
        "published": {"n": len(pub), "loso": count(pub, "loso", TPS_BAND),
                      "in_sample": count(pub, "in_sample", TPS_BAND),
                      "loso_median_abs": med(pub, "loso"), "in_sample_median_abs": med(pub, "in_sample")},
    }


def render_summary(fit: dict, pub: dict, h200: dict) -> str:
    s = summary(fit)
    h, p = s["h200"], s["published"]
    fits = pub["summary"]
    cases = h200["cases"]
    dev_loo = sum(abs(c["device_gib"]["held_out_rel_err"]) <= DEVICE_BAND for c in cases)
    dev_in = sum(abs(c["device_gib"]["rel_err"]) <= DEVICE_BAND for c in cases)
    fits_loo = sum(c["fits"]["held_out_loo"] for c in cases)
    return "\n".join([
        "| evidence | held out | within band, held out | in-sample (labelled) | median abs. error held out / in-sample |",
        "|---|---|---|---|---|",
        f"| tokens/s, {h['n']} H200 trainer runs (±{LOO_BAND:.0%}) | leave-one-out | **{h['loo']}/{h['n']}** | "
        f"{h['in_sample']}/{h['n']} in-sample | {h['loo_median_abs']:.1%} / {h['in_sample_median_abs']:.1%} |",
        f"| tokens/s, {p['n']} published runs (±{TPS_BAND:.0%}) | leave-one-source-out | **{p['loso']}/{p['n']}** "
        f"({p['loso'] / p['n']:.0%}) | {p['in_sample']}/{p['n']} in-sample | "
        f"{p['loso_median_abs']:.1%} / {p['in_sample_median_abs']:.1%} |",
        f"| device memory (nvidia-smi), {len(cases)} H200 runs (±{DEVICE_BAND:.0%}) | leave-one-out (the slack "
        f"fraction) | **{dev_loo}/{len(cases)}**; fits: {fits_loo}/{len(cases)} | {dev_in}/{len(cases)} in-sample | – |",
        f"| fits, published runs that trained | no memory constant is fitted to them | false OOM: "
        f"**{len(fits['false_oom'])}**; missed OOM: {len(fits['missed_oom'])} | – | – |",
        "",
    ])


def _failing_term(row: dict, fit: dict) -> str:
    """Why a held-out H200 case misses: the host constants it measures that, held out, only
    one other case or none is left to measure."""
    parts = []
    for n in fit["machine"]:
        cases = fit["provenance"][n].get("cases", [])
        if row["name"] not in cases:
            continue
        others = [c for c in cases if c != row["name"]]
        name = n.split(".", 1)[1]
        if not others:
            parts.append(f"nothing else measures `{name}`: its prior is used")
        elif len(others) == 1:
            parts.append(f"`{name}` is measured on {others[0]} alone")
    return "; ".join(parts) or "the GPU-side terms"


def render_h200(fit: dict, h200: dict) -> str:
    by_name = {r["name"]: r for r in fit["cases"] if r["source"] == H200_SOURCE}
    lines = ["| case | allocated GiB err | device GiB err, LOO (in-sample) | tokens/s measured | LOO err | "
             "in-sample err | fits, LOO | held out, what fails it |", "|---|---|---|---|---|---|---|---|"]
    for c in h200["cases"]:
        r = by_name[c["name"]]
        loo = _err(r["loo"], r["measured"])
        why = "" if abs(loo) <= LOO_BAND else _failing_term(r, fit)
        d = c["device_gib"]
        lines.append(f"| {c['name']} | {_pct(c['allocated_gib']['rel_err'])} | {_pct(d['held_out_rel_err'])} "
                     f"({_pct(d['rel_err'])}) | {r['measured']:,.0f} | {'**' if why else ''}{_pct(loo)}"
                     f"{'**' if why else ''} | {_pct(_err(r['in_sample'], r['measured']))} | "
                     f"{'yes' if c['fits']['held_out_loo'] else 'NO'} | {why} |")
    return "\n".join(lines) + "\n"


def render_sources(fit: dict, pub: dict) -> str:
    rows = [r for r in fit["cases"] if r["source"] != H200_SOURCE]
    lines = ["| source | runs with tokens/s | LOSO within ±20% | in-sample within ±20% | LOSO median error | "
             "false OOM | missed OOM |", "|---|---|---|---|---|---|---|"]
    for sid in sorted({r["source"] for r in rows}):
        mine = [r for r in rows if r["source"] == sid]
        s = pub["by_source"].get(sid, {}).get("summary", {})
        lines.append(
            f"| {sid} | {len(mine)} | {sum(abs(_err(r['loso'], r['measured'])) <= TPS_BAND for r in mine)} | "
            f"{sum(abs(_err(r['in_sample'], r['measured'])) <= TPS_BAND for r in mine)} | "
            f"{_pct(statistics.median(_err(r['loso'], r['measured']) for r in mine))} | "
            f"{len(s.get('false_oom', []))} | {len(s.get('missed_oom', []))} |")
    return "\n".join(lines) + "\n"


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _family_entries(fam: str, effs: dict) -> list[tuple[str, dict]]:
    """A family's own constants; a whole-family or per-constant `borrow` is one row naming the family
    it borrows from (its value is that family's: the per-GPU table shows it)."""
    if "borrow" in effs:
        return [(f"{fam} (all)", {"borrow": effs["borrow"], "basis": effs["basis"]})]
    return [(f"{fam} `{k}`", e) for k, e in effs.items()]


def render_constants() -> str:
    doc = yaml.safe_load(TIMING_YAML.read_text())
    lines = ["| constant | value | provenance | basis |", "|---|---|---|---|"]
    entries = [(f"`{k}`", e) for k, e in doc["engine"].items()]
    entries += [row for fam, effs in doc["families"].items() for row in _family_entries(fam, effs)]
    for name, e in entries:
        if "borrow" in e:
            basis = " ".join(str(e["basis"]).split()).replace("|", "/")
            lines.append(f"| {name} | {e['borrow']}'s | assumed: borrowed from {e['borrow']} | {basis} |")
            continue
        kind, basis = e["kind"], " ".join(str(e["basis"]).split())
        if kind == "fitted":
            kind = f"fitted ({len(e.get('cases', []))} cases, {len(e.get('sources', []))} sources)"
            basis = ""
        elif e.get("cases"):  # measured on the cases that inform it (in-sample for them)
            kind = f"measured on {', '.join(e['cases'])} (in-sample for them)"
            if e.get("machine"):  # a host constant: its basis repeats the cases
                basis = "At its bound: those cases do not resolve it. " if "bound" in str(e["basis"]) else ""
        if "prior" in e:
            p = e["prior"]
            basis += f"Prior {_fmt(float(p['value']))} ({p['kind']}): {' '.join(str(p['basis']).split())}"
        lines.append(f"| {name} | {_fmt(float(e['value']))} | {kind} | {basis.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


GPU_CONSTANTS = (("gemm_efficiency", "GEMM"), ("attention_efficiency", "attention (SDPA)"),
                 ("flash_attention_efficiency", "attention (flash-attn 2)"),
                 ("triton_attention_efficiency", "attention (llm-foundry's Triton)"), ("hbm_efficiency", "streaming (HBM)"))


def _gpu_cell(gpu, name: str) -> str:
    """One GPU's constant: its value and how it was established, from the catalog's provenance."""
    from shardwise import catalog

    prov = gpu.efficiency_provenance.get(name)
    if prov is None:  # no separate figure for this kernel: the SDPA one is used
        return "as SDPA"
    value = getattr(gpu, name)
    if prov.kind == "assumed":
        src = catalog.family_borrows(gpu.family).get(name)
        if src:
            origin = catalog.family_efficiencies(src)[1][name].kind
            what = f"**assumed**, borrowed from {src} ({origin} there)"
        else:
            what = f"**assumed** ({gpu.family})"
    elif prov.kind == "fitted":
        what = f"fitted on {', '.join(prov.sources)}"
    elif prov.kind == "measured" and prov.sources:
        what = f"measured on {', '.join(prov.sources)} (in-sample)"
    else:
        what = prov.kind
    return f"{value:.3g} {what}"


def render_gpus() -> str:
    """Per catalog GPU: each kernel efficiency the planner prices it with, and whether it is fitted
    (on which sources), measured, or assumed (borrowed from which family), from catalog/timing.yaml
    through the catalog: the same figures `shardwise plan` uses."""
    from shardwise import catalog

    lines = ["| GPU | family | " + " | ".join(label for _, label in GPU_CONSTANTS) + " | assumed |",
             "|---|---|" + "---|" * len(GPU_CONSTANTS) + "---|"]
    for name in catalog.gpu_names():
        gpu = catalog.get_gpu(name)
        assumed = sum(p.kind == "assumed" for p in gpu.efficiency_provenance.values())
        cells = " | ".join(_gpu_cell(gpu, n) for n, _ in GPU_CONSTANTS)
        lines.append(f"| {name} | {gpu.family} | {cells} | {assumed} of {len(gpu.efficiency_provenance)} |")
    return "\n".join(lines) + "\n"


def render_fp8(pub: dict) -> str:
    """The fp8 runs (plan/fp8.py): never fitting cases, so every figure is held out."""
    rows = [r for src in pub["by_source"].values() for r in src["runs"] if r.get("fp8", "none") != "none"
            and "published_tokens_per_s_per_gpu" in r]
    lines = ["| run | source | recipe | tokens/s published | planned | error | peak published | planned |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = (f"{r['published_memory_gib']} GiB | {r['predicted_memory_gib']} GiB ({_pct(r['memory_rel_err'])})"
               if "published_memory_gib" in r else "— | —")
        lines.append(f"| {r['name']} | {r['source']} | {r['fp8']} | {r['published_tokens_per_s_per_gpu']:,} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | {_pct(r['tokens_rel_err'])} | {mem} |")
    within = sum(abs(r["tokens_rel_err"]) <= TPS_BAND for r in rows)
    lines += ["", f"{within} of {len(rows)} within ±20% tokens/s, held out (no fp8 run is a fitting case)."]
    return "\n".join(lines) + "\n"


def render_parallel(pub: dict, key: str, what: str) -> str:
    """The runs with `key` (cp, ep) > 1 (plan/context.py, plan/experts.py): never fitting cases,
    so every figure is held out; tokens/s and peak memory where the source publishes them."""
    rows = [r for src in pub["by_source"].values() for r in src["runs"] if r.get(key, 1) > 1 and "error" not in r]
    lines = [f"| run | source | {key} | seq | tokens/s published | planned | error | peak published | planned |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = (f"{r['published_tokens_per_s_per_gpu']:,} | {r['predicted_tokens_per_s_per_gpu']:,.0f} | "
               f"{_pct(r['tokens_rel_err'])}" if "tokens_rel_err" in r else "— | — | —")
        mem = (f"{r['published_memory_gib']} GiB | {r['predicted_memory_gib']} GiB ({_pct(r['memory_rel_err'])})"
               if "memory_rel_err" in r else "— | —")
        lines.append(f"| {r['name']} | {r['source']} | {r[key]} | {r['seq_len']:,} | {tps} | {mem} |")
    tps_rows = [r for r in rows if "tokens_rel_err" in r]
    mem_rows = [r for r in rows if "memory_rel_err" in r]
    tps = sum(abs(r["tokens_rel_err"]) <= TPS_BAND for r in tps_rows)
    mem = sum(abs(r["memory_rel_err"]) <= MEMORY_BAND for r in mem_rows)
    lines += ["", f"{tps} of {len(tps_rows)} within ±20% tokens/s and {mem} of {len(mem_rows)} within ±10% peak "
              f"memory, held out (no {what} run is a fitting case)."]
    return "\n".join(lines) + "\n"


def render_memory(pub: dict) -> str:
    """Every published run with a peak, planned against it (no memory constant is fitted to a
    published run: held out as it stands)."""
    rows = [r for src in pub["by_source"].values() for r in src["runs"] if "memory_rel_err" in r]
    lines = ["| run | source | statistic | peak published | planned | error |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["source"], r["name"])):
        lines.append(f"| {r['name']} | {r['source']} | {r['memory_kind']} | {r['published_memory_gib']} GiB | "
                     f"{r['predicted_memory_gib']} GiB | {_pct(r['memory_rel_err'])}{'' if r['memory_within_band'] else ' ✗'} |")
    within = sum(r["memory_within_band"] for r in rows)
    lines += ["", f"{within} of {len(rows)} within ±10% (✗: outside)."]
    return "\n".join(lines) + "\n"


def readme_claims(fit: dict, published: dict | None = None) -> list[str]:
    """The held-out and in-sample counts the README quotes (tests/accuracy/test_accuracy_doc.py checks
    that README.md says them)."""
    s = summary(fit)
    h, p = s["h200"], s["published"]
    published = published or _load("accuracy_published.json")
    mem = published["summary"]["memory"]
    runs = [r for src in published["by_source"].values() for r in src["runs"] if "published_tokens_per_s_per_gpu" in r]
    fp8 = [r for r in runs if r.get("fp8", "none") != "none"]
    cp = [r for r in runs if r.get("cp", 1) > 1]
    ep = [r for r in runs if r.get("ep", 1) > 1]
    held = [f"for {sum(abs(r['tokens_rel_err']) <= TPS_BAND for r in fp8)} of the {len(fp8)} fp8 runs",
            f"{sum(abs(r['tokens_rel_err']) <= TPS_BAND for r in cp)} of the {len(cp)} context-parallel",
            f"{sum(abs(r['tokens_rel_err']) <= TPS_BAND for r in ep)} of the {len(ep)} expert-parallel ones"]
    return [*held, f"{published['summary']['compared']} published runs",
            f"within ±10% for {mem['within_band']} of the {mem['n']} that publish one", f"±25% for {h['loo']} of {h['n']} held out", f"(in-sample: {h['in_sample']} of {h['n']}",
            f"±20% for {p['loso']} of {p['n']} with each source held", f"(in-sample: {p['in_sample']} of {p['n']})"]


def render() -> dict[str, str]:
    fit, h200, pub = _load("timing_fit.json"), _load("h200_cases.json"), _load("accuracy_published.json")
    return {"summary": render_summary(fit, pub, h200), "h200": render_h200(fit, h200),
            "sources": render_sources(fit, pub), "constants": render_constants(), "gpus": render_gpus(),
            "fp8": render_fp8(pub), "cp": render_parallel(pub, "cp", "context-parallel"),
            "ep": render_parallel(pub, "ep", "expert-parallel"), "memory": render_memory(pub)}


def apply(text: str, blocks: dict[str, str]) -> str:
    seen = set()

    def sub(m: re.Match) -> str:
        seen.add(m["name"])
        return m.group(1) + blocks[m["name"]] + m.group(3)

    out = BLOCK.sub(sub, text)
    missing = set(blocks) - seen
    if missing:
        raise SystemExit(f"{DOC}: no generated block for {sorted(missing)}")
    return out


def main() -> int:
    DOC.write_text(apply(DOC.read_text(), render()))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
