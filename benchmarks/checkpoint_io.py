"""Save and load time and bytes per rank of the sharded checkpoint (shardwise.train.checkpoint.sharded),
for tiny-llama and qwen2.5-0.5b on CPU, 2 gloo ranks, per strategy; and what a save costs a run.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py           # ~10-15 min
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py --quick   # tiny only, ~1 min,
                                                                   # prints the tables, writes nothing

Each case is one launch of benchmarks/checkpoint_io_worker.py on 2 ranks (see its docstring for
what is timed and how the load is verified). The checkpoints go to a temporary directory that
is deleted after each case. A full run writes benchmarks/results/checkpoint_io.json (every
number, per rank) and benchmarks/results/checkpoint_io.md (tables and a reading).

A 0.5B case runs only when its estimated peak host memory (2 ranks) fits in MemAvailable with
a margin; otherwise it is recorded as skipped with the numbers. A case that fails is recorded
with its error (traceback tail), never dropped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io_worker import GUARD_EXIT, mem_available  # the worker's module top is stdlib-only

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORKER = HERE / "checkpoint_io_worker.py"
WORLD = 2
DEFAULT_INTERVAL_S = 30 * 60  # checkpointing.save_every_minutes' default (shardwise.config.schema)
EVERY_STEPS = 100
GiB = 1 << 30

# (model, seq, micro_batch, steps before the first save, save/load repetitions, launch timeout s)
MODELS = {
    "tiny-llama": (64, 4, 4, 3, 240),
    "qwen2.5-0.5b": (64, 1, 2, 1, 540),
}
TINY_STRATEGIES = ["fsdp", "zero3", "ddp", "zero2"]
BIG_STRATEGIES = ["fsdp", "zero3", "ddp", "zero2"]  # zero2 last: run if the time budget allows

# Peak host bytes per parameter per rank, fp32 + AdamW, 2 ranks: an estimate that decides whether a
# 0.5B case is started (the worker's guard stops it anyway if the host runs low). Calibrated on
# this machine (23.5 GiB, torch 2.13, deepspeed 0.19.8) from the peak RSS of each case on
# qwen2.5-0.5b; the run's own measured peaks are in the results. Canonical state alone is
# 16 B/param on a replica (weights 4, grads 4, moments 8) or half of it sharded over 2 ranks.
#  fsdp : measured 6.8-7.0 GiB/rank: shards 8 B/param + the full model built before fully_shard
#  ddp  : measured 10.3 GiB/rank: the full 16 B/param + backward temporaries
#  zero2: measured 12.7 / 8.8 GiB: full params 4, master/grads/moments halved 8, plus the save's
#         assembled share (unequal: the tied 136M-param embedding sits on rank 0)
#  zero3: 7.7 GiB/rank after the training steps; `checkpoint_state` (the save's first phase: every
#         full tensor assembled, rank 0 keeping the embedding and half the layers) then took rank 0
#         past 12.5 GiB until the guard stopped it (--ignore-memory-estimate runs it anyway)
BYTES_PER_PARAM = {"fsdp": 14, "ddp": 20, "zero2": 21, "zero3": 26}
RANK_OVERHEAD = GiB // 2  # interpreter, torch, deepspeed, transformers (partly shared between ranks)
MARGIN = 1 * GiB


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def machine() -> dict:
    import deepspeed
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(mem_total() / GiB, 1),
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "omp_num_threads_per_rank": 1, "world_size": WORLD, "backend": "gloo",
    }


def model_params(name: str) -> int:
    from shardwise.catalog import get_model

    return get_model(name).params


def run_case(model: str, strategy: str, tmp: Path, budget_left: float) -> dict:
    from shardwise.train.launch.spawn import spawn

    seq, mb, steps, repeats, timeout = MODELS[model]
    case_dir = tmp / f"{model}-{strategy}"
    case_dir.mkdir()
    result = case_dir / "result.json"
    log = case_dir / "log"
    argv = [str(WORKER), "--model", model, "--strategy", strategy, "--seq", str(seq), "--micro-batch", str(mb),
            "--steps", str(steps), "--repeats", str(repeats), "--ckpt-dir", str(case_dir / "run"),
            "--result", str(result), "--log", str(log)]
    t0 = time.perf_counter()
    rc = spawn(argv, WORLD, timeout_s=min(timeout, max(budget_left, 60)), threads_per_rank=1,
               extra_env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    out: dict = {"model": model, "strategy": strategy, "launch_wall_s": wall, "exit_code": rc}
    if rc == 0 and result.is_file():
        raw = json.loads(result.read_text())
        try:
            out |= {"status": "ok", **summarize(raw)}
        except Exception as e:  # a number the worker wrote is not what summarize expects: keep it all
            out |= {"status": "failed", "reason": f"summarize: {type(e).__name__}: {e}", "raw": raw, "errors": []}
    else:
        errors = []
        for r in range(WORLD):
            f = Path(f"{result}.rank{r}.error.json")
            if f.is_file():
                errors.append(json.loads(f.read_text()))
        tails = {}
        for r in range(WORLD):
            f = Path(f"{log}.rank{r}")
            if f.is_file():
                lines = [ln for ln in f.read_text(errors="replace").splitlines()
                         if ln.strip() and "Warning" not in ln and "return func(" not in ln]
                tails[f"rank{r}"] = lines[-25:]
        out |= {"status": "failed", "errors": errors, "log_tail": tails,
                "reason": (f"exit code {rc}" + (" (ran past its time limit)" if rc == 124 else "")
                           + (" (stopped by the benchmark's memory guard)" if rc == GUARD_EXIT else "")
                           + (" (killed by a signal: out of memory?)" if rc > 128 else ""))}
    shutil.rmtree(case_dir, ignore_errors=True)
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(raw: dict) -> dict:
    """Per-case numbers from every rank's record. A collective save/load takes as long as
    its slowest rank: the case's time per repetition is the max over ranks, then the median."""
    ranks = raw["ranks"]
    reps = raw["repeats"]
    save_s = _median([max(r["saves"][i]["total_s"] for r in ranks) for i in range(reps)])
    load_s = _median([max(r["loads"][i]["total_s"] for r in ranks) for i in range(reps)])
    n_steps = min(len(r["step_times_s"]) for r in ranks)
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(n_steps)]
    step_s = _median(per_step[1:] or per_step)  # the first step warms up allocators and caches
    bytes_rank = [r["bytes"]["rank_bytes"] for r in ranks]
    total = ranks[0]["bytes"]["all_listed_bytes"] + ranks[0]["bytes"]["manifest_bytes"]
    p = raw["num_params"]
    canonical = 3 * 4 * p  # fp32 weights + exp_avg + exp_avg_sq

    def phases(rec: dict) -> dict:
        keys = ("checkpoint_state", "dcp_save", "dcp_write_item", "fsync", "sha256", "dcp_load")
        d = {k: rec.get(f"{k}_s", 0.0) for k in keys if f"{k}_s" in rec}
        d["total"] = rec["total_s"]
        accounted = d.get("checkpoint_state", 0) + d.get("dcp_save", 0) + d.get("sha256", 0) + d.get("dcp_load", 0)
        d["other"] = rec["total_s"] - accounted
        return {k: round(v, 4) for k, v in d.items()}

    last = reps - 1
    return {
        "num_params": p,
        "seq_len": raw["seq_len"], "micro_batch": raw["micro_batch"], "repeats": reps,
        "step_s": step_s, "step_s_all": per_step,
        "save_s": save_s, "load_s": load_s,
        "save_s_per_rank": [[r["saves"][i]["total_s"] for i in range(reps)] for r in ranks],
        "load_s_per_rank": [[r["loads"][i]["total_s"] for i in range(reps)] for r in ranks],
        "save_phases_per_rank_last": [phases(r["saves"][last]) for r in ranks],
        "load_phases_per_rank_last": [phases(r["loads"][last]) for r in ranks],
        "manifest_sha256_verify_s_rank0": ranks[0]["manifest_verify_s"],
        "checkpoint_state_alone_s_per_rank": [r["checksum_pass_s"] for r in ranks],
        "bytes_per_rank": bytes_rank,
        "bytes_shared_rank0": sum(ranks[0]["bytes"]["shared_files"].values()) + ranks[0]["bytes"]["manifest_bytes"],
        "total_bytes": total,
        "canonical_bytes_12P": canonical,
        "total_over_canonical": total / canonical,
        "rank_byte_imbalance": max(bytes_rank) / max(min(bytes_rank), 1),
        "save_MBps": total / save_s / 1e6,
        "load_MBps": total / load_s / 1e6,
        "save_share_default_interval": save_s / (DEFAULT_INTERVAL_S + save_s),
        "save_share_every_100_steps": save_s / (EVERY_STEPS * step_s + save_s),
        "peak_rss_gib_per_rank": [round(r["peak_rss"] / GiB, 2) for r in ranks],
        "build_s_rank0": ranks[0]["build"], "build_for_load_s_rank0": ranks[0]["build_for_load"],
        "verify": {"ok": all(r["verify"]["ok"] for r in ranks), "per_rank": [r["verify"] for r in ranks]},
        "files_rank0": ranks[0]["bytes"]["rank_files"],
        "rss_by_phase_per_rank": [r.get("rss_by_phase") for r in ranks],
    }


def memory_check(model: str, strategy: str) -> dict:
    p = model_params(model)
    per_rank = BYTES_PER_PARAM[strategy] * p + RANK_OVERHEAD
    need = WORLD * per_rank + MARGIN
    avail = mem_available()
    return {"params": p, "estimated_peak_per_rank_gib": round(per_rank / GiB, 2),
            "needed_gib_incl_margin": round(need / GiB, 2), "mem_available_gib": round(avail / GiB, 2),
            "fits": need <= avail}


def fmt_mb(b: float) -> str:
    return f"{b / 1e6:,.1f}" if b < 1e9 else f"{b / 1e6:,.0f}"


def pct(x: float) -> str:
    return f"{100 * x:.3f}%" if x < 0.01 else f"{100 * x:.1f}%"


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# Checkpoint save/load cost (`benchmarks/checkpoint_io.py`)",
        "",
        f"{m['date']}; {m['cpu_count']} CPU cores, {m['mem_total_gib']} GiB RAM; torch {m['torch']}, "
        f"deepspeed {m['deepspeed']}, transformers {m['transformers']}. {WORLD} ranks (gloo, 1 thread each), "
        "fp32, AdamW, synthetic data; checkpoints on the local disk (a temporary directory). Script run time: "
        f"{res['run_time_s']:.0f} s.",
        "",
        "Save/load = wall time of the collective `save_checkpoint` / `load_checkpoint` (slowest rank; median of "
        "the repetitions). Bytes per rank = the rank's `__<rank>_*.distcp` + `rank-<rank>.json`; total = every "
        "file of the manifest + the manifest. Share of run time: save / (interval + save) at the default "
        "`save_every_minutes: 30`, and at every 100 steps of the step time measured here.",
        "",
        "| model | strategy | params | step s | save s | load s | bytes/rank MB | total MB | total / 12·P "
        "| save MB/s | load MB/s | share @30 min | share @100 steps | peak RSS/rank GiB | load verified |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in res["cases"]:
        if c["status"] != "ok":
            why = c.get("reason", "")
            n = c.get("memory", {}).get("params")
            lines.append(f"| {c['model']} | {c['strategy']} | {f'{n / 1e6:.1f}M' if n else ''} | "
                         f"{c['status'].upper()}: {why} |" + " |" * 11)
            continue
        lines.append(
            f"| {c['model']} | {c['strategy']} | {c['num_params'] / 1e6:.{1 if c['num_params'] > 1e7 else 2}f}M | {c['step_s']:.3f} | "
            f"{c['save_s']:.3f} | {c['load_s']:.3f} | {' / '.join(fmt_mb(b) for b in c['bytes_per_rank'])} | "
            f"{fmt_mb(c['total_bytes'])} | {c['total_over_canonical']:.3f} | {c['save_MBps']:.0f} | "
            f"{c['load_MBps']:.0f} | {pct(c['save_share_default_interval'])} | "
            f"{pct(c['save_share_every_100_steps'])} | "
            f"{' / '.join(str(x) for x in c['peak_rss_gib_per_rank'])} | {'yes' if c['verify']['ok'] else 'NO'} |")
    lines += [
        "",
        "Where the save time goes (slowest rank, last repetition, seconds): `checkpoint_state` = the engine "
        "hands over its canonical tensors (ZeRO: every parameter's full fp32 value and moments assembled by "
        "a collective, each rank keeping its share, largest parameters first to the least-loaded rank); `dcp.save` = DCP's planning collectives, "
        "serialisation and writes, of which `fsync` is the flush to disk; `sha256` = hashing for the manifest "
        "(each rank its own files, rank 0 the index); other = barriers, the all_gather of file entries, "
        "manifest, rename. `(write items)` = DCP's per-item `torch.save` into the rank's file (serialisation "
        "and the write calls, within dcp.save; the rest of dcp.save is planning collectives, copies and the "
        "index). Load: `dcp.load` and the rest (ZeRO: scattering into the flat partitions). "
        "`verify` = `read_manifest(verify_hashes=True)` on rank 0, what preflight does before a resume.",
        "",
        "| model | strategy | save | checkpoint_state | dcp.save | (write items) | (fsync) | sha256 | other | load "
        "| dcp.load | load other | verify (sha256, rank 0) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["cases"]:
        if c["status"] != "ok":
            continue
        s = max(c["save_phases_per_rank_last"], key=lambda d: d["total"])
        ld = max(c["load_phases_per_rank_last"], key=lambda d: d["total"])
        lines.append(
            f"| {c['model']} | {c['strategy']} | {s['total']:.3f} | {s.get('checkpoint_state', 0):.3f} | "
            f"{s.get('dcp_save', 0):.3f} | {s.get('dcp_write_item', 0):.3f} | {s.get('fsync', 0):.3f} | {s.get('sha256', 0):.3f} | {s['other']:.3f} | "
            f"{ld['total']:.3f} | {ld.get('dcp_load', 0):.3f} | {ld['other']:.3f} | "
            f"{c['manifest_sha256_verify_s_rank0']:.3f} |")
    bad = [c for c in res["cases"] if c["status"] != "ok"]
    if bad:
        lines += ["", "## Not measured", ""]
        for c in bad:
            lines.append(f"- **{c['model']} / {c['strategy']}**: {c['status']}: {c.get('reason', '')}")
            for e in c.get("errors", []):
                last = [ln for ln in str(e.get("error", "")).strip().splitlines() if ln.strip()][-3:]
                lines.append(f"  - rank {e.get('rank')}: `{' / '.join(x.strip() for x in last)}`")
    lines += ["", "## Reading", "", *res["reading"], "", "## Notes", "", *[f"- {n}" for n in res["notes"]], ""]
    return "\n".join(lines)


def reading(cases: list[dict]) -> list[str]:
    """Sentences computed from this run's numbers (nothing here is typed in advance)."""
    ok = [c for c in cases if c["status"] == "ok"]
    out: list[str] = []
    big = [c for c in ok if c["model"] != "tiny-llama"] or ok
    if not big:
        return ["No case completed; see the failures above."]
    ref = max(big, key=lambda c: c["num_params"])
    model = ref["model"]
    rows = [c for c in big if c["model"] == model]

    def frac(c: dict, key: str) -> float:
        s = max(c["save_phases_per_rank_last"], key=lambda d: d["total"])
        return s.get(key, 0.0) / s["total"]

    parts = []
    for c in rows:
        s = max(c["save_phases_per_rank_last"], key=lambda d: d["total"])
        parts.append(f"{c['strategy']} {c['save_s']:.1f} s (checkpoint_state {frac(c, 'checkpoint_state'):.0%}, "
                     f"dcp.save {frac(c, 'dcp_save'):.0%} [per-item torch.save + write "
                     f"{frac(c, 'dcp_write_item'):.0%}, fsync {frac(c, 'fsync'):.0%}], "
                     f"sha256 {frac(c, 'sha256'):.0%}, other {s['other'] / s['total']:.0%})")
    out.append(f"On {model} ({ref['num_params'] / 1e6:.{0 if ref['num_params'] > 1e8 else 2}f}M params, {fmt_mb(ref['total_bytes'])} MB per "
               f"checkpoint, {ref['total_over_canonical']:.3f}× the 12 bytes/param of fp32 weights + two AdamW "
               f"moments) a save takes: " + "; ".join(parts) + ".")
    zero = [c for c in rows if c["strategy"].startswith("zero")]
    torch_ = [c for c in rows if not c["strategy"].startswith("zero")]
    if zero and torch_:
        zs = max(zero, key=lambda c: c["save_s"])
        ts = min(torch_, key=lambda c: c["save_s"])
        cs = max(zs["save_phases_per_rank_last"], key=lambda d: d["total"]).get("checkpoint_state", 0.0)
        out.append(f"The ZeRO per-parameter gather is the difference between the engines: {zs['strategy']}'s "
                   f"`checkpoint_state` alone takes {cs:.1f} s (every parameter's fp32 value and both moments "
                   f"all-reduced to full size on every rank, then each rank keeps its size-balanced share), while "
                   f"{ts['strategy']} hands over its tensors as they are ({ts['save_s']:.1f} s for the whole save).")
    fs = [max(c["save_phases_per_rank_last"], key=lambda d: d["total"]) for c in rows]
    out.append(f"The disk is not the bottleneck: fsync takes {min(d.get('fsync', 0) for d in fs):.1f}-"
               f"{max(d.get('fsync', 0) for d in fs):.1f} s of each save (writeback runs during the writes), while "
               f"DCP's per-item serialisation and write calls take {min(d.get('dcp_write_item', 0) for d in fs):.1f}-"
               f"{max(d.get('dcp_write_item', 0) for d in fs):.1f} s: one core per rank copying "
               f"~{fmt_mb(max(ref['bytes_per_rank']))} MB through torch.save.")
    skew = [c for c in rows if c["rank_byte_imbalance"] > 1.2]
    for c in skew:
        out.append(f"{c['strategy']} writes unequal shares ({' / '.join(fmt_mb(b) for b in c['bytes_per_rank'])} MB "
                   f"per rank, {c['rank_byte_imbalance']:.2f}×): the engine assigns whole parameters to ranks "
                   f"round-robin by index, so the largest tensor (here the tied embedding, parameter 0) and its "
                   f"moments all land on rank 0, and the save waits for that rank.")
    hashes = [max(c["save_phases_per_rank_last"], key=lambda d: d["total"]).get("sha256", 0.0) for c in rows]
    out.append(f"Hashing for the manifest costs {min(hashes):.1f}-{max(hashes):.1f} s per save at this size "
               f"(single-threaded sha256 over each rank's own ~{fmt_mb(max(ref['bytes_per_rank']))} MB, read back "
               f"from the page cache), and a resume's preflight hashes the whole checkpoint again on one rank "
               f"({ref['manifest_sha256_verify_s_rank0']:.1f} s here).")
    worst = max(rows, key=lambda c: c["save_s"])
    out.append(f"At the default interval of 30 minutes the most expensive save here ({worst['strategy']}, "
               f"{worst['save_s']:.1f} s) costs {pct(worst['save_share_default_interval'])} of run time; that "
               f"figure transfers to a GPU run of the same model and disk, since the save's cost does not depend "
               f"on the step time. Every 100 steps at this machine's CPU step time ({worst['step_s']:.1f} s) it "
               f"would be {pct(worst['save_share_every_100_steps'])}, but a GPU step is orders of magnitude shorter, so "
               f"a step-based interval there costs proportionally more: that column is illustrative only.")
    bad = [c for c in ok if not c["verify"]["ok"]]
    if bad:
        out.append("LOAD VERIFICATION FAILED for " + ", ".join(f"{c['model']}/{c['strategy']}" for c in bad)
                   + " (see verify.per_rank in the JSON).")
    else:
        out.append(f"Every load that ran was real: after `load_checkpoint` into a freshly built engine the "
                   f"probe loss equals the pre-save loss exactly (a fresh engine's differs), and the checksums "
                   f"of all {sum(c['verify']['per_rank'][0]['checksum_keys'] for c in ok)} canonical tensors "
                   f"per rank 0 (weights and both moments) and the optimizer step count match.")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-llama only (about a minute)")
    ap.add_argument("--budget-s", type=float, default=870.0,
                    help="wall-clock budget: a 0.5B case that would not finish within it is skipped")
    ap.add_argument("--strategies", nargs="+", default=None, help="restrict the strategies (both models)")
    ap.add_argument("--ignore-memory-estimate", action="store_true",
                    help="start every case; only the workers' guard (MemAvailable < 1 GiB) stops one")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t_start = time.perf_counter()
    plan = [("tiny-llama", s) for s in TINY_STRATEGIES]
    if not args.quick:
        plan += [("qwen2.5-0.5b", s) for s in BIG_STRATEGIES]
    if args.strategies:
        plan = [(m, s) for m, s in plan if s in args.strategies]
    tmp = Path(tempfile.mkdtemp(prefix="shardwise-ckpt-io-"))
    cases: list[dict] = []
    last_big_wall = None
    try:
        for model, strategy in plan:
            elapsed = time.perf_counter() - t_start
            left = args.budget_s - elapsed
            mem = memory_check(model, strategy)
            if not mem["fits"] and not args.ignore_memory_estimate:
                cases.append({"model": model, "strategy": strategy, "status": "skipped", "memory": mem,
                              "reason": f"estimated peak host memory {WORLD} × {mem['estimated_peak_per_rank_gib']}"
                                        f" GiB + margin = {mem['needed_gib_incl_margin']} GiB > MemAvailable "
                                        f"{mem['mem_available_gib']} GiB"})
                print(f"[{elapsed:6.0f} s] {model}/{strategy}: skipped ({cases[-1]['reason']})", flush=True)
                continue
            if model != "tiny-llama" and last_big_wall is not None and left < 1.1 * last_big_wall:
                cases.append({"model": model, "strategy": strategy, "status": "skipped", "memory": mem,
                              "reason": f"time budget: {left:.0f} s of --budget-s {args.budget_s:.0f} left, the "
                                        f"previous 0.5B case took {last_big_wall:.0f} s"})
                print(f"[{elapsed:6.0f} s] {model}/{strategy}: skipped ({cases[-1]['reason']})", flush=True)
                continue
            print(f"[{elapsed:6.0f} s] {model}/{strategy}: running (memory estimate "
                  f"{mem['needed_gib_incl_margin']} GiB of {mem['mem_available_gib']} GiB available)", flush=True)
            c = run_case(model, strategy, tmp, left) | {"memory": mem}
            if model != "tiny-llama":
                last_big_wall = c["launch_wall_s"]
            cases.append(c)
            if c["status"] == "ok":
                print(f"          step {c['step_s']:.3f} s, save {c['save_s']:.3f} s, load {c['load_s']:.3f} s, "
                      f"{fmt_mb(c['total_bytes'])} MB, verified {c['verify']['ok']}, launch {c['launch_wall_s']:.0f} s",
                      flush=True)
            else:
                print(f"          FAILED: {c['reason']}", flush=True)
                for e in c["errors"]:
                    print("          " + str(e.get("error", "")).strip().splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    run_time = time.perf_counter() - t_start
    res = {
        "what": "wall time of save_checkpoint / load_checkpoint (shardwise.train.checkpoint.sharded) per rank, bytes per "
                "rank from the manifest, per (model, strategy), 2 spawned gloo ranks on CPU; the save's share of "
                "run time at the default interval (30 min) and at every 100 steps of the CPU step time",
        "machine": machine(),
        "run_time_s": run_time,
        "quick": args.quick,
        "default_interval_s": DEFAULT_INTERVAL_S,
        "every_steps": EVERY_STEPS,
        "memory_estimate_bytes_per_param": BYTES_PER_PARAM,
        "cases": cases,
        "notes": [
            "CPU step times are not GPU step times: the 'every 100 steps' share is illustrative; the share at the "
            "default 30-minute interval depends only on the save time and is the one that transfers (for the "
            "same model size, world size and storage).",
            "Step time: slowest rank per step, median over the steps after the first; fp32, one thread per rank.",
            "The load reads right after the save, so the files are in the page cache: load time is not a cold "
            "read from disk (the save's fsync does reach the disk). Load MB/s divides the checkpoint's size by the "
            "load time, but ddp and ZeRO ranks each read every tensor in full (a replica / full tensors to "
            "scatter), FSDP ranks only their shards.",
            "Phase times come from timing wrappers the worker installs around engine.checkpoint_state, "
            "torch.distributed.checkpoint.save/load, os.fsync and the manifest's _sha256 (instrumentation only).",
            "Load verification: one no-grad forward on a fixed batch before the save and after loading into a "
            "freshly built engine (exact equality), a fresh engine's loss (must differ), per-key float64 "
            "sum and sum of squares of every canonical tensor each rank holds (weights, exp_avg, exp_avg_sq), "
            "and the optimizer step count.",
            f"0.5B cases run only when the estimated peak (bytes/param per rank: {BYTES_PER_PARAM}, plus 0.5 GiB "
            "per rank, plus a 1 GiB margin) fits in MemAvailable; each rank also stops itself if the host's "
            "MemAvailable falls under 1 GiB. Measured peak RSS per rank is in the table; the RSS at the start "
            "of each phase is in rss_by_phase_per_rank.",
        ],
    }
    res["reading"] = reading(cases)
    if args.quick:  # a check: the results files hold the full run only
        print(markdown(res), flush=True)
    else:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "checkpoint_io.json").write_text(json.dumps(res, indent=1) + "\n")
        (RESULTS / "checkpoint_io.md").write_text(markdown(res))
        print(f"wrote {RESULTS / 'checkpoint_io.json'} and .md in {run_time:.0f} s", flush=True)
    sys.exit(0 if all(c["status"] != "failed" for c in cases) else 1)


if __name__ == "__main__":
    main()
