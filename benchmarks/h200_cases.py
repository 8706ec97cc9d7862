"""The planner against shardwise's own trainer measured on one NVIDIA H200.

`benchmarks/measurements/h200-trainer-cases.json` holds 11 runs (bf16-mixed, fused AdamW,
world size 1: torch.cuda.max_memory_allocated, nvidia-smi's peak, median step time) with the
plan of the time. This script plans each case with today's planner and writes predicted vs
measured to benchmarks/results/h200_cases.{json,md}: memory (no constant of the memory model is
fitted to these cases but the allocator slack of the device total), tokens/s in-sample (today's
constants, which were fitted or measured with these cases among the data) and held out (each case
planned by a fit without it: leave-one-out, read from benchmarks/results/timing_fit.json, which
`benchmarks/fit_timing.py` writes; run it first).

tests/accuracy/test_h200_cases.py asserts the bands (allocated ±5%, tokens/s in-sample ±20% — labelled
in-sample — and held out within ±25% on the cases docs/accuracy.md does not name, fits).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from shardwise import catalog
from shardwise.config.strategy import DDPKnobs, DeepSpeedKnobs, FSDPKnobs
from shardwise.plan.evaluate import evaluate
from shardwise.specs import ModelSpec, Strategy, TrainSpec

HERE = Path(__file__).parent
DATA = HERE / "measurements" / "h200-trainer-cases.json"
OUT = HERE / "results" / "h200_cases"
GIB = 2**30

# The two "config" models of the measurement file, from its "models" descriptions.
CONFIGS = {
    "l1b": ModelSpec(name="llama-3.2-1b-shape", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_embeddings=True),
    "l7b8": ModelSpec(name="llama-2-7b-widths-8-layers", hidden_size=4096, num_layers=8, num_heads=32,
                      num_kv_heads=32, intermediate_size=11008, vocab_size=32000),
}


def load_cases() -> list[dict]:
    return json.loads(DATA.read_text())["cases"]


def specs(case: dict):
    if case["model"] == "config":
        model = CONFIGS["l1b" if case["name"].startswith("l1b") else "l7b8"]
    else:
        model = catalog.get_model(case["model"])
    hw = catalog.build_hardware(gpu=case["gpu"], gpus=case["world_size"], gpus_per_node=case["world_size"])
    train = TrainSpec(seq_len=case["seq"], micro_batch=case["micro_batch"], checkpointing=case["activation"],
                      precision=case["precision"], optimizer_impl="fused")
    # measured with DeepSpeed's per-submodule ZeRO-3 hooks, before the layer unit was the default,
    # with fully_shard at world size 1, before one-rank shard groups could run as DDP, and with
    # DistributedDataParallel around the one DDP replica, before it ran bare
    return model, hw, train, Strategy.from_name(case["strategy"], ds=DeepSpeedKnobs(fetch_unit="module"),
                                                fsdp=FSDPKnobs(single_rank="fsdp"), ddp=DDPKnobs(wrap_one_rank=True))


def compare(case: dict) -> dict:
    model, hw, train, strategy = specs(case)
    e = evaluate(model, hw, train, strategy)
    g, m = e.memory.gpu, case["measured"]
    row = {
        "name": case["name"], "model": model.name, "strategy": strategy.name, "seq": train.seq_len,
        "micro_batch": train.micro_batch, "checkpointing": train.checkpointing,
        "allocated_gib": {"predicted": g.allocated / GIB, "measured": m["max_allocated_bytes"] / GIB},
        "device_gib": {"predicted": g.total / GIB, "measured": m["nvidia_smi_peak_bytes"] / GIB},
        "tokens_per_s": {"predicted": e.time.tokens_per_s_per_gpu, "measured": m["tokens_per_s"]},
        "mfu": {"predicted": e.time.mfu},
        "fits": {"predicted": e.fits, "measured": True},
        # the allocator-slack term, linear in the memory model's allocator_slack (memory_slack_loo
        # refits it held out)
        "slack_term_gib": g.allocator_unreclaimable / GIB, "required_gib": g.required / GIB,
        "usable_gib": e.memory.usable_bytes / GIB,
        "time_parts_s": {k: getattr(e.time, k) for k in ("gemm_s", "attention_s", "memory_bound_s",
                                                         "optimizer_s", "host_s", "step_s")},
        "measured_step_s": m["median_step_s"],
    }
    for key in ("allocated_gib", "device_gib", "tokens_per_s"):
        row[key]["rel_err"] = row[key]["predicted"] / row[key]["measured"] - 1  # tokens/s: in-sample
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| case | allocated GiB pred / meas | err | device GiB pred / nvidia-smi | err | tokens/s measured "
             "| held out (LOO) | err | in-sample | err | MFU pred | fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, d, t = r["allocated_gib"], r["device_gib"], r["tokens_per_s"]
        lines.append(f"| {r['name']} | {a['predicted']:.2f} / {a['measured']:.2f} | {a['rel_err']:+.1%} | "
                     f"{d['predicted']:.2f} / {d['measured']:.2f} | {d['rel_err']:+.1%} | {t['measured']:,.0f} | "
                     f"{t['held_out_loo']:,.0f} | {t['held_out_rel_err']:+.1%} | "
                     f"{t['predicted']:,.0f} | {t['in_sample_rel_err']:+.1%} | "
                     f"{r['mfu']['predicted']:.1%} | {'yes' if r['fits']['predicted'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def memory_slack_loo(rows: list[dict]) -> dict[str, dict]:
    """Leave-one-out of memory's one constant fitted to these cases, `allocator_slack`
    (catalog/memory.yaml: the median over the cases of the slack fraction that puts the planned
    device total on nvidia-smi's peak): each case's device total and fits with the median of the
    other ten. The slack term is allocator_slack × the larger phase's transients, so each case's
    implied fraction is read off its planned term, without re-planning."""
    slack = catalog.memory_model().allocator_slack
    implied = {}
    for r in rows:
        per_unit = r["slack_term_gib"] / slack  # GiB per unit of the fraction
        base = r["device_gib"]["predicted"] - r["slack_term_gib"]
        implied[r["name"]] = ((r["device_gib"]["measured"] - base) / per_unit if per_unit else None, base, per_unit)
    out = {}
    for r in rows:
        others = [v[0] for n, v in implied.items() if n != r["name"] and v[0] is not None]
        s = statistics.median(others)
        _, base, per_unit = implied[r["name"]]
        device = base + s * per_unit
        required = r["required_gib"] - r["slack_term_gib"] + s * per_unit
        out[r["name"]] = {"slack": s, "device_gib": device, "rel_err": device / r["device_gib"]["measured"] - 1,
                          "fits": required <= r["usable_gib"]}
    return out


def held_out() -> dict[str, float]:
    """Leave-one-out tokens/s per case, from benchmarks/results/timing_fit.json."""
    fit = json.loads((HERE / "results" / "timing_fit.json").read_text())
    return {r["name"]: r["loo"] for r in fit["cases"] if "loo" in r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT), help="path stem of the .json and .md results")
    args = ap.parse_args()
    out = Path(args.out)
    loo = held_out()
    rows = []
    for c in load_cases():
        row = compare(c)
        t = row["tokens_per_s"]
        t["in_sample_rel_err"] = t.pop("rel_err")
        t["held_out_loo"] = loo[c["name"]]
        t["held_out_rel_err"] = loo[c["name"]] / t["measured"] - 1
        rows.append(row)
    for row, (name, mem) in zip(rows, memory_slack_loo(rows).items(), strict=True):
        assert row["name"] == name
        row["device_gib"]["held_out_loo"] = mem["device_gib"]
        row["device_gib"]["held_out_rel_err"] = mem["rel_err"]
        row["device_gib"]["held_out_slack"] = mem["slack"]
        row["fits"]["held_out_loo"] = mem["fits"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"source": str(DATA.relative_to(HERE.parent)), "cases": rows},
                                                   indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
