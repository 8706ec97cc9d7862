"""What ZeRO-3 holds gathered during a CPU training step, hook by hook (2 ranks).

Runs `python -m shardwise.train.cli CONFIG` as benchmarks/host_memory.py does (same config:
seq 64, micro-batch 1, bf16-mixed, LoRA r 8 on q_proj/v_proj or full fine-tuning), with
benchmarks/zero3_probe first on the ranks' PYTHONPATH: after every DeepSpeed ZeRO-3 module hook
(pre/post forward, pre/post backward), the engine's forward/backward/step, it records the
elements of parameters whose ds_status is AVAILABLE (and which decoder layers hold some),
DeepSpeed's own count (`__n_available_params`), the trace mode and VmRSS.

    python benchmarks/zero3_gathered.py --model llama-1.36b --mode lora --steps 4 \
        [--set strategy.deepspeed.max_live_parameters=100000000] [--out FILE]

Prints, per rank, step and pass, the largest AVAILABLE element count (and bf16 GiB), the
layers gathered at the end of forward, and the RSS. Writes the raw rows to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import host_memory as hm  # noqa: E402

GIB = 2**30
KNOBS = {"max_reuse_distance": 1_000_000_000, "max_live_parameters": 1_000_000_000,
         "prefetch_bucket_size": 50_000_000, "param_persistence_threshold": 100_000}


def planned_gathered(model: str, knobs: dict, ranks: int = 2) -> float:
    """Elements the planner says ZeRO-3 keeps gathered at the end of forward on every step after
    the first (shardwise.plan.stage.zero3_gathered, decoder layers as ZeRO-3 leaves), for the
    checkpoint `model` of tests/train/big_checkpoint.py with `knobs`."""
    import tempfile

    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from big_checkpoint import SHAPES

    from shardwise.config.strategy import DeepSpeedKnobs
    from shardwise.plan.stage import zero3_gathered
    from shardwise.specs import Strategy, TrainSpec
    from shardwise.specs.layout import ParallelLayout
    from shardwise.specs.model import ModelSpec

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                   "tie_word_embeddings": False, **SHAPES[model]}))
        spec = ModelSpec.from_hf_config(cfg)
    strategy = Strategy.from_name("zero3", ds=DeepSpeedKnobs(**knobs))
    layout = ParallelLayout.for_strategy(strategy, ranks, ranks)
    return zero3_gathered(spec, TrainSpec(), strategy.ds, layout)


def knobs_of(sets: list[str]) -> dict:
    """KNOBS with the case's `--set strategy.deepspeed.<knob>=N` overrides applied."""
    knobs = dict(KNOBS)
    for kv in sets:
        k, _, v = kv.partition("=")
        if k.rsplit(".", 1)[-1] in knobs:
            knobs[k.rsplit(".", 1)[-1]] = int(float(v))
    return knobs


def first_step_bound(ri: dict) -> int:
    """The first fwd+bwd DeepSpeed runs records the trace (partitioned_param_coordinator.py:277,
    reset_step from the root's forward pre-hook, parameter_offload.py:306); without a complete
    trace every module's params are released after its forward (:498), no prefetch (:422): only
    the module computing is gathered."""
    return max(ri["layer"], ri["embed"], ri["lm_head"])


def rule_inputs(ckpt_config: dict) -> dict:
    c = ckpt_config
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    hd = c["num_attention_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    return {"layer": h * hd * 2 + h * kv * 2 + 3 * h * f + 2 * h, "num_layers": c["num_hidden_layers"],
            "embed": v * h, "lm_head": 0 if c.get("tie_word_embeddings") else v * h, "norm": h}


def _set(cfg: dict, dotted: str) -> None:
    import yaml

    key, _, value = dotted.partition("=")
    *path, last = key.split(".")
    d = cfg
    for k in path:
        d = d.setdefault(k, {})
    d[last] = yaml.safe_load(value)


def run(model: str, mode: str, steps: int, sets: list[str], cache: Path) -> dict:
    import yaml

    ckpt = hm.checkpoint(cache, model)
    env = hm.child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "zero3_probe"), env["PYTHONPATH"]])
    with tempfile.TemporaryDirectory(prefix="z3-gathered-") as tmp:
        t = Path(tmp)
        config = hm.write_config(t, ckpt, "zero3", mode, steps)
        cfg = yaml.safe_load(config.read_text())
        for s in sets:
            _set(cfg, s)
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        (t / "phases").mkdir()
        (t / "trace").mkdir()
        env["SHARDWISE_HOST_PHASES_DIR"] = str(t / "phases")
        env["SHARDWISE_Z3_TRACE_DIR"] = str(t / "trace")
        proc = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(config)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        trace = {f.stem: [json.loads(x) for x in f.read_text().splitlines()] for f in sorted((t / "trace").glob("*.jsonl"))}
        phases = hm.phases(t / "phases")
    return {"model": model, "mode": mode, "steps": steps, "sets": sets, "rc": proc.returncode,
            "shapes": hm.shapes(ckpt), "rule_inputs": rule_inputs(json.loads((ckpt / "config.json").read_text())), "trace": trace, "phases": phases,
            "output_tail": proc.stdout[-4000:] if proc.returncode else ""}


def summary(doc: dict) -> str:
    s = doc["shapes"]
    lines = [f"{doc['model']} {doc['mode']} {doc['sets']}: rc {doc['rc']}; layer {s['layer']:,} root {s['root']:,} "
             f"params {s['params']:,} (bf16 {2 * s['params'] / GIB:.2f} GiB)"]
    knobs = knobs_of(doc["sets"])
    ri = doc["rule_inputs"]
    for first in (True, False):
        n = first_step_bound(ri) if first else planned_gathered(doc["model"], knobs)
        lines.append(f"  rule ({'first step' if first else 'later steps'}): {n / 1e6:.1f}M gathered at the end of "
                     f"forward ({2 * n / GIB:.2f} GiB bf16)" + (" (largest module: while it computes)" if first else ""))
    for rank, rows in doc["trace"].items():
        ph = {r["phase"]: r for r in doc["phases"].get(rank, [])}
        loaded = ph.get("loaded", {}).get("VmRSS")
        last = doc["phases"].get(rank, [{}])[-1]
        lines.append(f"  {rank}: loaded RSS {loaded / GIB:.2f} GiB, training peak (VmHWM) "
                     f"{last.get('VmHWM', 0) / GIB:.2f} GiB" if loaded else f"  {rank}")
        for step in sorted({r["step"] for r in rows}):
            for p in ("fwd", "bwd", "step"):
                rs = [r for r in rows if r["step"] == step and r["pass"] == p]
                if not rs:
                    continue
                top = max(rs, key=lambda r: r["avail"])
                end = rs[-1]
                lines.append(
                    f"    step {step} {p:4s} trace {end['trace']:8s} max avail {top['avail'] / 1e6:8.1f}M "
                    f"({2 * top['avail'] / GIB:.2f} GiB bf16; frozen {top['avail_frozen'] / 1e6:.1f}M) at "
                    f"{top['event']} {top['module']}; max RSS {max(r['rss'] for r in rs) / GIB:.2f} GiB; end: avail "
                    f"{end['avail'] / 1e6:.1f}M layers {_ranges(end['layers'])} other {end['other']} "
                    f"RSS {end['rss'] / GIB:.2f}")
    return "\n".join(lines)


def compact(doc: dict) -> dict:
    """One case for benchmarks/results/zero3_gathered.json: the rule's elements beside, per rank
    and step, the measured largest non-persistent AVAILABLE elements (DeepSpeed's persistent
    params are in the steady RSS), the layers still gathered at the end of forward, the RSS
    there and at the training peak over the steady RSS (after the last optimizer step). The
    persistent params are gathered during the first forward: step 1's figures count them out
    before they are there (up to `persistent` low, clamped at 0)."""
    knobs = knobs_of(doc["sets"])
    ri = doc["rule_inputs"]
    out = {"model": doc["model"], "mode": doc["mode"], "sets": doc["sets"], "knobs": knobs, "rule_inputs": ri,
           "rule": {"first_step": first_step_bound(ri), "later_steps": planned_gathered(doc["model"], knobs)},
           "ranks": {}}
    for rank, rows in doc["trace"].items():
        persist = min(r["avail"] for r in rows if r["event"] == "engine_step_end")
        ph = doc["phases"][rank]
        steady = [r for r in ph if r["phase"] == "step"][-1]["VmRSS"]
        steps = {}
        for step in sorted({r["step"] for r in rows if r["step"] > 0}):
            rs = [r for r in rows if r["step"] == step]
            end = [r for r in rs if r["event"] == "engine_forward_end"][-1]
            steps[step] = {"trace": end["trace"], "max_gathered": max(0, max(r["avail"] for r in rs) - persist),
                           "end_of_forward_gathered": max(0, end["avail"] - persist), "end_of_forward_layers": _ranges(end["layers"]),
                           "end_of_forward_other": end["other"], "end_of_forward_rss_over_steady": end["rss"] - steady}
        out["ranks"][rank] = {"persistent": persist, "steady_rss": steady, "train_peak": ph[-1]["VmHWM"],
                              "loaded_rss": next(r for r in ph if r["phase"] == "loaded")["VmRSS"],
                              "peak_over_steady": ph[-1]["VmHWM"] - steady, "steps": steps}
    return out


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1.36b")
    ap.add_argument("--mode", choices=("lora", "full"), default="lora")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="config key=value (YAML value)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "shardwise-checkpoints")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summary", type=Path, help="print the summary of a saved --out and exit")
    ap.add_argument("--compact", type=Path, nargs="+", help="saved --out files: write their `compact` rows "
                    "to benchmarks/results/zero3_gathered.json and exit")
    a = ap.parse_args()
    if a.compact:
        res = ROOT / "benchmarks" / "results" / "zero3_gathered.json"
        rows = [compact(json.loads(f.read_text())) for f in a.compact]
        res.write_text(json.dumps({"deepspeed": __import__("deepspeed").__version__, "cases": rows}, indent=1) + "\n")
        return
    if a.summary:
        print(summary(json.loads(a.summary.read_text())))
        return
    doc = run(a.model, a.mode, a.steps, a.sets, a.cache)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc) + "\n")
    print(summary(doc))
    if doc["rc"]:
        print(doc["output_tail"])


if __name__ == "__main__":
    main()
