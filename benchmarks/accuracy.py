"""The planner against published training runs.

Every YAML under benchmarks/published/ is one source (a paper, a README table, a blog) with the
runs it reports; each run carries its quote and the table or section it comes from. For each
run this builds the planner's specs, evaluates the named strategy and compares:

- peak memory per GPU (GiB) with the published figure, matched by kind: `reserved`
  (torch max_memory_reserved: torchtitan's logs) against the predicted reserved bytes,
  `active`/`allocated` against the predicted allocated bytes, `nvidia-smi` against the predicted
  device total, `unknown` against allocated (flagged);
- tokens/s per GPU (`evaluation.time.tokens_per_s_per_gpu`) and MFU (conventions differ by
  source: reported, not banded);
- fits vs trained: a *false OOM* is a run the planner says does not fit but that trained; a
  *missed OOM* is one the planner says fits but the source reports out of memory.

Bands: memory ±10%, tokens/s ±20%. Tokens/s is reported in-sample (today's constants, fitted
with every source among the data) and held out (each source planned by a time model fitted
without it: leave-one-source-out, from benchmarks/results/timing_fit.json, which
benchmarks/fit_timing.py writes; run it first). Nothing is asserted here
(tests/accuracy/test_published_runs.py checks the schema and that every run evaluates,
tests/accuracy/test_accuracy_doc.py the held-out bands and that these files are fresh); the numbers go
to benchmarks/results/accuracy_published.{json,md}.

    python benchmarks/accuracy.py            # writes both result files, prints the summary
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import cache
from pathlib import Path

import yaml

from shardwise import catalog
from shardwise.config.strategy import STRATEGY_NAMES
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import evaluate
from shardwise.specs import ModelSpec, Strategy, TrainSpec

HERE = Path(__file__).resolve().parent
PUBLISHED = HERE / "published"
RESULTS = HERE / "results"
GIB = 2**30
MEMORY_BAND = 0.10
TPS_BAND = 0.20

SOURCE_KEYS = ("id", "title", "url", "section", "retrieved", "notes")
RUN_KEYS = ("name", "model", "gpu", "gpus", "strategy", "seq_len", "micro_batch", "precision",
            "checkpointing", "published", "quote")
SKIP_KEYS = ("name", "skip", "published", "quote")
MEMORY_KINDS = ("reserved", "active", "allocated", "nvidia-smi", "unknown")
PUBLISHED_KEYS = {"tokens_per_s_per_gpu", "tokens_per_s", "mfu", "hfu", "tflops_per_gpu", "peak_memory_gib",
                  "peak_memory_gb", "memory_kind", "trained", "derived"}
# TrainSpec fields a run may set under `train:` besides the top-level ones.
TRAIN_TOP = ("seq_len", "micro_batch", "grad_accum", "precision", "checkpointing")


# --- loading ------------------------------------------------------------------------------
def load_sources(directory: Path | str = PUBLISHED) -> list[dict]:
    """Every source file, parsed, in name order: {"file", "source", "runs"}."""
    out = []
    for path in sorted(Path(directory).glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        out.append({"file": path.name, "source": doc["source"], "runs": doc["runs"]})
    return out


def load_runs(directory: Path | str = PUBLISHED) -> list[dict]:
    """Every run of every source, each with `_source` (the source block) and `_file`. A source's
    `train_defaults` (settings its framework uses unless a run says otherwise, each with its
    evidence in the source's notes) go under every run's `train:`."""
    return [_with_source(run, doc) for doc in load_sources(directory) for run in doc["runs"]]


def _with_source(run: dict, doc: dict) -> dict:
    merged = {**run, "_source": doc["source"], "_file": doc["file"]}
    defaults = doc["source"].get("train_defaults") or {}
    if defaults and not run.get("skip"):
        merged["train"] = {**defaults, **(run.get("train") or {})}
    return merged


def schema_errors(run: dict) -> list[str]:
    """What is missing or unknown in one run (and its source); empty when well-formed."""
    errs = []
    src = run.get("_source", {})
    for k in SOURCE_KEYS:
        if k not in src:
            errs.append(f"source lacks {k!r}")
    if not str(src.get("url", "")).startswith("http"):
        errs.append(f"source url {src.get('url')!r} is not a URL")
    if src.get("repo") and not src.get("commit"):
        errs.append("source names a repo but no commit")
    keys = SKIP_KEYS if run.get("skip") else RUN_KEYS
    for k in keys:
        if k not in run:
            errs.append(f"run {run.get('name')!r} lacks {k!r}")
    pub = run.get("published", {})
    if not isinstance(pub, dict) or "trained" not in pub:
        errs.append(f"run {run.get('name')!r}: published must be a mapping with 'trained'")
    else:
        extra = set(pub) - PUBLISHED_KEYS
        if extra:
            errs.append(f"run {run.get('name')!r}: unknown published keys {sorted(extra)}")
        if "peak_memory_gib" in pub and pub.get("memory_kind") not in MEMORY_KINDS:
            errs.append(f"run {run.get('name')!r}: memory_kind must be one of {MEMORY_KINDS}")
    if run.get("skip"):
        return errs
    if run.get("strategy") not in STRATEGY_NAMES:
        errs.append(f"run {run.get('name')!r}: unknown strategy {run.get('strategy')!r}")
    if run.get("gpu") not in catalog.gpu_names():
        errs.append(f"run {run.get('name')!r}: unknown gpu {run.get('gpu')!r}")
    if run.get("interconnect") and run["interconnect"] not in catalog.interconnect_names():
        errs.append(f"run {run.get('name')!r}: unknown interconnect {run['interconnect']!r}")
    model = run.get("model")
    if isinstance(model, str) and model not in catalog.model_names():
        errs.append(f"run {run.get('name')!r}: unknown catalog model {model!r}")
    if not isinstance(model, (str, dict)):
        errs.append(f"run {run.get('name')!r}: model must be a catalog name or an HF-style dict")
    return errs


# --- specs --------------------------------------------------------------------------------
@cache
def _model_from_json(text: str) -> ModelSpec:
    cfg = json.loads(text)
    return ModelSpec.from_hf_dict(cfg, name=cfg.get("_name", "published"), source="published run")


def model_spec(run: dict) -> ModelSpec:
    m = run["model"]
    if isinstance(m, str):
        return catalog.get_model(m)
    return _model_from_json(json.dumps(m, sort_keys=True))


def build(run: dict):
    """(model, hardware, train, strategy) for one run."""
    model = model_spec(run)
    hw = catalog.build_hardware(gpu=run["gpu"], gpus=run["gpus"], gpus_per_node=run.get("gpus_per_node"),
                                interconnect=run.get("interconnect"), memory_gb=run.get("gpu_memory_gb"))
    fields = {k: run[k] for k in TRAIN_TOP if k in run}
    extra = dict(run.get("train") or {})
    if "lora_targets" in extra:
        extra["lora_targets"] = tuple(extra["lora_targets"])
    if run.get("compile"):  # torch.compile fuses the elementwise chains
        extra.setdefault("fused_kernels", True)
    train = TrainSpec(**fields, **extra)
    knobs = dict(run.get("knobs") or {})
    if Strategy.from_name(run["strategy"]).engine == "fsdp2":
        # Published FSDP runs used their framework's default under accumulation (torchtitan,
        # Composer, fms-fsdp): gradients reduced every micro-batch, not held unsharded.
        # They also ran fully_shard whatever their shard group (none ran FSDP as DDP).
        knobs["fsdp"] = {"reduce_every_micro_batch": True, "single_rank": "fsdp", **knobs.get("fsdp", {})}
        # and resharded after forward as their framework does (the source's `fsdp_reshard_after_forward`,
        # with its evidence in the notes: FSDP1 FULL_SHARD and stock fully_shard reshard every layer,
        # torchtitan all but the last); SHARD_GRAD_OP (fsdp-grad-op) never reshards
        reshard = run.get("_source", {}).get("fsdp_reshard_after_forward")
        if reshard and run["strategy"] != "fsdp-grad-op":
            knobs["fsdp"].setdefault("reshard_after_forward", reshard)
        # and its root as its framework passes it (`fsdp_reshard_root`: torchtitan frees it at pp 1)
        root = run.get("_source", {}).get("fsdp_reshard_root")
        if root is not None and run.get("pp", 1) == 1:
            knobs["fsdp"].setdefault("reshard_root", root)
    if Strategy.from_name(run["strategy"]).engine == "deepspeed":
        # and published DeepSpeed runs its default ZeRO-3 hooks: one per submodule
        knobs["ds"] = {"fetch_unit": "module", **knobs.get("ds", {})}
    # the TP its framework runs (a source's `tp_impl`, evidence in its notes: Megatron-LM's for the
    # Megatron rows; else the engine's own, specs.strategy.TP_SCHEMES)
    knobs.setdefault("tp_impl", run.get("tp_impl") or run.get("_source", {}).get("tp_impl") or "auto")
    # and the sharded optimizer it runs (a source's `zero_impl`: Megatron-Core's distributed optimizer)
    if zero := run.get("zero_impl") or run.get("_source", {}).get("zero_impl"):
        knobs.setdefault("zero_impl", zero)
    # with its gradient buffer's dtype (`grad_reduce_in_bf16`: Megatron-Bridge's grad_reduce_in_fp32 false)
    bf16_grads = run.get("grad_reduce_in_bf16", run.get("_source", {}).get("grad_reduce_in_bf16"))
    if bf16_grads is not None and knobs.get("zero_impl") == "megatron":
        knobs.setdefault("grad_reduce_in_bf16", bf16_grads)
    # expert parallelism of MoE runs (plan/experts.py): ep, the busiest rank's load and etp where stated
    ep = {k: run[k] for k in ("ep", "ep_load_imbalance", "etp", "ep_overlap") if k in run}
    strategy = Strategy.from_name(run["strategy"], tp=run.get("tp", 1), pp=run.get("pp", 1), cp=run.get("cp", 1),
                                  **ep, **knobs)
    return model, hw, train, strategy


# --- comparison ---------------------------------------------------------------------------
def _rel(pred: float | None, pub: float | None) -> float | None:
    if pred is None or pub in (None, 0):
        return None
    return pred / pub - 1


def _predicted_memory(gpu, kind: str) -> float:
    allocated = getattr(gpu, "allocated", gpu.total)
    reserved = getattr(gpu, "reserved", gpu.total)
    value = {"reserved": reserved, "active": allocated, "allocated": allocated,
             "nvidia-smi": gpu.total, "unknown": allocated}[kind]
    return value / GIB


def compare(run: dict) -> dict:
    """Predicted vs published for one run (a skipped run returns its reason)."""
    src = run.get("_source", {})
    pub = run.get("published", {})
    base = {"name": run["name"], "source": src.get("id"), "quote": run.get("quote")}
    if run.get("skip"):
        return base | {"skipped": run["skip"]}
    try:
        model, hw, train, strategy = build(run)
        # "fits" here is a prediction of the device's limit: does the predicted peak exceed the
        # GPU's memory? (The planner's default 5% head room is a safety policy on top; published
        # runs are tuned to the edge, e.g. 31.5 of 32 GiB.)
        ev = evaluate(model, hw, train, strategy, margin=0.0)
    except ShardwiseError as e:
        return base | {"error": str(e)}
    gpu = ev.memory.gpu
    derived = pub.get("derived") or {}
    out = base | {
        "model": run["model"] if isinstance(run["model"], str) else f"custom h{model.hidden_size} L{model.num_layers}",
        "params_b": round(model.params / 1e9, 3),
        "gpu": run["gpu"] + (f" ({run['gpu_memory_gb']} GB)" if run.get("gpu_memory_gb") else ""),
        "gpus": run["gpus"], "strategy": run["strategy"], "tp": run.get("tp", 1), "pp": run.get("pp", 1),
        **({"cp": run["cp"]} if run.get("cp", 1) > 1 else {}), **({"ep": run["ep"]} if run.get("ep", 1) > 1 else {}),
        "seq_len": train.seq_len, "micro_batch": train.micro_batch, "grad_accum": train.grad_accum,
        "precision": train.precision, "fp8": train.fp8, "checkpointing": train.checkpointing,
        "compile": bool(run.get("compile")),
        "predicted_allocated_gib": round(getattr(gpu, "allocated", gpu.total) / GIB, 2),
        "predicted_reserved_gib": round(getattr(gpu, "reserved", gpu.total) / GIB, 2),
        "predicted_total_gib": round(gpu.total / GIB, 2),
        "fits": ev.fits, "trained": pub.get("trained"),
        "approximate": list(run.get("approximate") or []),
    }
    mem_pub = pub.get("peak_memory_gib")
    if mem_pub is not None:
        kind = pub.get("memory_kind", "unknown")
        pred = _predicted_memory(gpu, kind)
        err = _rel(pred, mem_pub)
        out |= {"memory_kind": kind, "published_memory_gib": mem_pub, "predicted_memory_gib": round(pred, 2),
                "memory_rel_err": round(err, 4), "memory_within_band": abs(err) <= MEMORY_BAND,
                "memory_derived": "peak_memory_gib" in derived}
    tps_pub = pub.get("tokens_per_s_per_gpu")
    tps_pred = ev.time.tokens_per_s_per_gpu
    out |= {"predicted_tokens_per_s_per_gpu": round(tps_pred, 1), "predicted_mfu": round(ev.time.mfu, 4),
            "predicted_step_s": round(ev.time.step_s, 4), "predicted_exposed_comm_s": round(ev.time.exposed_comm_s, 4)}
    if tps_pub is not None:
        err = _rel(tps_pred, tps_pub)
        out |= {"published_tokens_per_s_per_gpu": tps_pub, "tokens_rel_err": round(err, 4),
                "tokens_within_band": abs(err) <= TPS_BAND, "tokens_derived": "tokens_per_s_per_gpu" in derived}
    for k in ("mfu", "hfu", "tflops_per_gpu"):
        if k in pub:
            out[f"published_{k}"] = pub[k]
    if run.get("fits_unknown"):  # a setting the planner cannot express decides the memory
        out["fits_unknown"] = run["fits_unknown"]
        out["false_oom"] = out["missed_oom"] = False
        return out
    out["false_oom"] = (not ev.fits) and pub.get("trained") is True
    out["missed_oom"] = ev.fits and pub.get("trained") is False
    return out


# --- summary ------------------------------------------------------------------------------
def _stats(errs: list[float]) -> dict:
    if not errs:
        return {"n": 0}
    a = [abs(e) for e in errs]
    return {"n": len(errs), "median_rel_err": round(statistics.median(errs), 4),
            "median_abs_rel_err": round(statistics.median(a), 4), "max_abs_rel_err": round(max(a), 4)}


def summarize(results: list[dict]) -> dict:
    done = [r for r in results if "skipped" not in r and "error" not in r]
    mem = [r for r in done if "memory_rel_err" in r]
    tps = [r for r in done if "tokens_rel_err" in r]
    # runs whose every input the source states and the planner expresses (no mapped model, no
    # assumed setting, no torch.compile): the cleanest subset for calibration
    exact = [r for r in done if not r["approximate"] and not r["compile"]]
    exact_tps = [r for r in exact if "tokens_rel_err" in r]
    exact_mem = [r for r in exact if "memory_rel_err" in r]
    return {
        "runs": len(results), "compared": len(done),
        "skipped": sum("skipped" in r for r in results), "errors": sum("error" in r for r in results),
        "memory": _stats([r["memory_rel_err"] for r in mem])
        | {"within_band": sum(r["memory_within_band"] for r in mem), "band": MEMORY_BAND},
        "tokens_per_s": _stats([r["tokens_rel_err"] for r in tps])
        | {"within_band": sum(r["tokens_within_band"] for r in tps), "band": TPS_BAND,
           "derived": sum(r["tokens_derived"] for r in tps)},
        "tokens_per_s_held_out": _stats([r["held_out_tokens_rel_err"] for r in tps if "held_out_tokens_rel_err" in r])
        | {"within_band": sum(r.get("held_out_tokens_within_band", False) for r in tps), "band": TPS_BAND},
        "exact": {"runs": len(exact),
                  "memory": _stats([r["memory_rel_err"] for r in exact_mem])
                  | {"within_band": sum(r["memory_within_band"] for r in exact_mem)},
                  "tokens_per_s": _stats([r["tokens_rel_err"] for r in exact_tps])
                  | {"within_band": sum(r["tokens_within_band"] for r in exact_tps)},
                  "false_oom": sum(r["false_oom"] for r in exact),
                  "false_oom_runs": [r["name"] for r in exact if r["false_oom"]]},
        "trained_published": sum(r["trained"] is not None for r in done),
        "oom_published": sum(r["trained"] is False for r in done),
        "false_oom": [r["name"] for r in done if r["false_oom"]],
        "fits_unknown": [r["name"] for r in done if r.get("fits_unknown")],
        "missed_oom": [r["name"] for r in done if r["missed_oom"]],
    }


def held_out() -> dict[tuple[str, str], float]:
    """Leave-one-source-out tokens/s per (source, run) from benchmarks/results/timing_fit.json
    (benchmarks/fit_timing.py: each source planned by a time model fitted to the others)."""
    path = RESULTS / "timing_fit.json"
    if not path.exists():
        return {}
    return {(r["source"], r["name"]): r["loso"] for r in json.loads(path.read_text())["cases"]}


def _with_held_out(result: dict, loso: dict) -> dict:
    tps = loso.get((result.get("source"), result["name"]))
    if (result.get("fp8", "none") != "none" or result.get("ep", 1) > 1) and "predicted_tokens_per_s_per_gpu" in result:
        # fp8 and expert-parallel runs are never fitting cases (fit_timing.py): held out as planned
        tps = result["predicted_tokens_per_s_per_gpu"]
    if tps is None or "published_tokens_per_s_per_gpu" not in result:
        return result
    err = tps / result["published_tokens_per_s_per_gpu"] - 1
    return result | {"held_out_tokens_per_s_per_gpu": round(tps, 1), "held_out_tokens_rel_err": round(err, 4),
                     "held_out_tokens_within_band": abs(err) <= TPS_BAND}


def run_all(directory: Path | str = PUBLISHED) -> dict:
    sources = load_sources(directory)
    loso = held_out()
    by_source, everything = {}, []
    for doc in sources:
        src = doc["source"]
        results = [_with_held_out(compare(_with_source(run, doc)), loso) for run in doc["runs"]]
        everything += results
        by_source[src["id"]] = {"file": doc["file"], "title": src["title"], "url": src["url"],
                                "section": src.get("section"), "commit": src.get("commit"),
                                "summary": summarize(results), "runs": results}
    return {"bands": {"memory": MEMORY_BAND, "tokens_per_s": TPS_BAND},
            "summary": summarize(everything), "by_source": by_source}


# --- markdown -----------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.0%}"


def _num(x, nd=0) -> str:
    if x is None:
        return ""
    return f"{x:,.{nd}f}"


def _band_mark(ok: bool | None) -> str:
    return "" if ok is None else ("✓" if ok else "✗")


def to_markdown(report: dict) -> str:
    s = report["summary"]
    m, t = s["memory"], s["tokens_per_s"]
    lines = [
        "# Planner vs published training runs",
        "",
        "Generated by `python benchmarks/accuracy.py` from `benchmarks/published/*.yaml` (one file per source; every "
        "run quotes its row). Bands: memory ±10%, tokens/s per GPU ±20%. Error = predicted / published − 1. "
        "Tokens/s held out: each source planned by the time model fitted without it "
        "(benchmarks/fit_timing.py); in-sample: today's constants, fitted with every source; the per-run "
        "tables below are in-sample, with the held-out error beside it.",
        "",
        "† published value derived from the source's own numbers (formula in the YAML); ‡ run used torch.compile "
        "(not modelled by the planner); § an input is mapped or assumed (`approximate` in the YAML and JSON). MFU conventions differ by source (most count causal attention in full; the "
        "planner halves it): shown, not banded.",
        "",
        "## Summary",
        "",
        "| | runs | within band | median error | median abs. error | max abs. error |",
        "|---|---|---|---|---|---|",
        f"| tokens/s per GPU, held out (leave-one-source-out, ±{t['band']:.0%}) | {s['tokens_per_s_held_out']['n']} | "
        f"{s['tokens_per_s_held_out']['within_band']} | {_pct(s['tokens_per_s_held_out'].get('median_rel_err'))} | "
        f"{_pct(s['tokens_per_s_held_out'].get('median_abs_rel_err')).lstrip('+')} | "
        f"{_pct(s['tokens_per_s_held_out'].get('max_abs_rel_err')).lstrip('+')} |",
        f"| peak memory (±{m['band']:.0%}) | {m['n']} | {m['within_band']} | {_pct(m.get('median_rel_err'))} | "
        f"{_pct(m.get('median_abs_rel_err')).lstrip('+')} | {_pct(m.get('max_abs_rel_err')).lstrip('+')} |",
        f"| tokens/s per GPU, in-sample (±{t['band']:.0%}) | {t['n']} ({t['derived']} derived) | {t['within_band']} | "
        f"{_pct(t.get('median_rel_err'))} | {_pct(t.get('median_abs_rel_err')).lstrip('+')} | "
        f"{_pct(t.get('max_abs_rel_err')).lstrip('+')} |",
        "",
        f"Exact subset (no mapped model, no assumed setting, no torch.compile; unmarked rows below): "
        f"{s['exact']['runs']} runs; memory {s['exact']['memory']['within_band']}/{s['exact']['memory']['n']} in band, "
        f"tokens/s {s['exact']['tokens_per_s']['within_band']}/{s['exact']['tokens_per_s']['n']} in band "
        f"(median error {_pct(s['exact']['tokens_per_s'].get('median_rel_err'))}), "
        f"{s['exact']['false_oom']} false OOMs.",
        "",
        f"Runs: {s['runs']} recorded, {s['compared']} compared, {s['skipped']} skipped (not expressible), "
        f"{s['errors']} rejected by the planner. Published OOMs: {s['oom_published']}.",
        "",
        f"**False OOMs** (planner: does not fit; source: trained) — {len(s['false_oom'])}: "
        + (", ".join(f"`{n}`" for n in s["false_oom"]) or "none"),
        "",
        f"**Missed OOMs** (planner: fits; source: out of memory) — {len(s['missed_oom'])}: "
        + (", ".join(f"`{n}`" for n in s["missed_oom"]) or "none"),
        "",
        "## By source",
        "",
        "| source | runs | compared | memory in band | tokens/s in band | median tokens/s error | false OOM |",
        "|---|---|---|---|---|---|---|",
    ]
    for sid, b in report["by_source"].items():
        ss = b["summary"]
        lines.append(f"| [{sid}]({b['url']}) | {ss['runs']} | {ss['compared']} | "
                     f"{ss['memory']['within_band']}/{ss['memory']['n']} | "
                     f"{ss['tokens_per_s']['within_band']}/{ss['tokens_per_s']['n']} | "
                     f"{_pct(ss['tokens_per_s'].get('median_rel_err'))} | {len(ss['false_oom'])} |")
    for b in report["by_source"].values():
        lines += ["", f"### {b['title']}", "",
                  f"[{b['url']}]({b['url']})" + (f" — commit `{b['commit'][:12]}`" if b.get("commit") else "")
                  + (f" — {b['section']}" if b.get("section") else ""), ""]
        rows = [r for r in b["runs"] if "skipped" not in r and "error" not in r]
        if rows:
            lines += ["| run | GPU × n | strategy | seq × mb × ga | AC | mem pub (kind) | mem pred | err | "
                      "tok/s pub | tok/s pred | err | held-out err | MFU pub | MFU pred | fits / trained |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                strat = r["strategy"] + (f" tp{r['tp']}" if r["tp"] > 1 else "") + (f" pp{r['pp']}" if r["pp"] > 1 else "")
                strat += f" ep{r['ep']}" if r.get("ep", 1) > 1 else ""
                mem_pub = (f"{r['published_memory_gib']} ({r['memory_kind']})" + ("†" if r.get("memory_derived") else "")
                           if "published_memory_gib" in r else "")
                tps_pub = (_num(r["published_tokens_per_s_per_gpu"]) + ("†" if r.get("tokens_derived") else "")
                           if "published_tokens_per_s_per_gpu" in r else "")
                mfu_pub = f"{r['published_mfu']:.1%}" if "published_mfu" in r else (
                    f"{r['published_hfu']:.1%} (HFU)" if "published_hfu" in r else "")
                fits = f"{'fits' if r['fits'] else 'OOM'} / " + {True: "trained", False: "OOM", None: "?"}[r["trained"]]
                if r["false_oom"] or r["missed_oom"]:
                    fits = f"**{fits}**"
                lines.append(
                    f"| {r['name']}{'‡' if r['compile'] else ''}{'§' if r['approximate'] else ''} | {r['gpu']} × {r['gpus']} | {strat} | "
                    f"{r['seq_len']} × {r['micro_batch']} × {r['grad_accum']} | {r['checkpointing']} | {mem_pub} | "
                    f"{_num(r.get('predicted_memory_gib'), 1) if 'published_memory_gib' in r else _num(r['predicted_reserved_gib'], 1)} | "
                    f"{_pct(r.get('memory_rel_err'))} {_band_mark(r.get('memory_within_band'))} | {tps_pub} | "
                    f"{_num(r['predicted_tokens_per_s_per_gpu'])} | {_pct(r.get('tokens_rel_err'))} "
                    f"{_band_mark(r.get('tokens_within_band'))} | {_pct(r.get('held_out_tokens_rel_err'))} "
                    f"{_band_mark(r.get('held_out_tokens_within_band'))} | {mfu_pub} | {r['predicted_mfu']:.1%} | {fits} |")
        skipped = [r for r in b["runs"] if "skipped" in r or "error" in r]
        if skipped:
            lines += ["", "Not compared:", ""]
            lines += [f"- `{r['name']}`: " + (f"skipped — {r['skipped']}" if "skipped" in r else f"planner error — {r['error']}")
                      for r in skipped]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--published", default=str(PUBLISHED))
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    report = run_all(args.published)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy_published.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    (out / "accuracy_published.md").write_text(to_markdown(report))
    s = report["summary"]
    print(f"{s['runs']} runs, {s['compared']} compared, {s['skipped']} skipped, {s['errors']} errors")
    print(f"memory: {s['memory']['within_band']}/{s['memory']['n']} within ±{MEMORY_BAND:.0%}, "
          f"median error {_pct(s['memory'].get('median_rel_err'))}")
    print(f"tokens/s held out (leave-one-source-out): {s['tokens_per_s_held_out']['within_band']}/"
          f"{s['tokens_per_s_held_out']['n']} within ±{TPS_BAND:.0%}; in-sample: "
          f"{s['tokens_per_s']['within_band']}/{s['tokens_per_s']['n']}, "
          f"median error {_pct(s['tokens_per_s'].get('median_rel_err'))}")
    print(f"false OOMs: {len(s['false_oom'])}  missed OOMs: {len(s['missed_oom'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
