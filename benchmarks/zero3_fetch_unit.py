"""ZeRO-3's host cost per fetch unit: decoder layer (a ZeRO-3 leaf) vs every submodule.

DeepSpeed ZeRO-3 runs Python hooks around each unit it fetches and releases. This script runs
`shardwise train` on one rank with a narrow Qwen2 (hidden 64) of 6, 12 and 24 layers, under
zero2 (no hooks: the baseline) and zero3 with each fetch unit, and takes ZeRO-3's overhead as
the difference of median step times. It then fits

    overhead = passes * (units * U + tensors * P)

(units: modules carrying hooks; tensors: parameter tensors fetched), the split the planner's
ZeRO-3 hook term uses (shardwise.plan.timing). Narrow layers keep the compute small so the
hooks show; on CPU every hook is serial with the compute, so the difference is their cost.

    python benchmarks/zero3_fetch_unit.py [--layers 6 12 24] [--steps 20] [--device cpu]

Writes benchmarks/results/zero3_fetch_unit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "zero3_fetch_unit.json"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp-synthetic-cpu.yaml"
CASES = (("zero2", None), ("zero3", "module"), ("zero3", "layer"))
PASSES = 2  # forward and backward (no activation checkpointing)


def write_model(root: Path, layers: int) -> Path:
    from transformers import Qwen2Config

    d = root / f"qwen2-h64-l{layers}"
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=176, vocab_size=2048, tie_word_embeddings=True,
                      max_position_embeddings=2048, architectures=["Qwen2ForCausalLM"])
    cfg.save_pretrained(d)
    return d


def hook_counts(model_dir: Path) -> dict[str, int]:
    """Modules carrying ZeRO-3 hooks under each fetch unit, and parameter tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf_cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)  # never a checkpoint's code
        model = AutoModelForCausalLM.from_config(hf_cfg, trust_remote_code=False)
    layers = list(model.model.layers)
    inside = sum(len(list(layer.modules())) - 1 for layer in layers)  # hooked only as submodules
    total = len(list(model.modules()))
    return {"module": total, "layer": total - inside, "tensors": len(list(model.parameters()))}


def run_case(model_dir: Path, out: Path, strategy: str, unit: str | None, steps: int, device: str) -> float:
    cmd = [sys.executable, "-m", "shardwise.train.cli", str(EXAMPLE), "--set", f"model.path={model_dir}",
           "--set", "model.random_init=true", "--set", f"strategy.name={strategy}", "--set", "run.nproc=1",
           "--set", f"run.steps={steps}", "--set", "run.grad_accum=1", "--set", f"run.device={device}",
           "--set", f"checkpointing.output_dir={out}", "--set", "checkpointing.save_final=false"]
    if unit:
        cmd += ["--set", f"strategy.deepspeed.fetch_unit={unit}"]
    env = os.environ | {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", device), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy}/{unit} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())["median_step_s"]


def fit(rows: list[dict]) -> dict[str, float]:
    """Least squares of overhead/passes = units*U + tensors*P over all zero3 rows."""
    a = np.array([[r["units"], r["tensors"]] for r in rows], dtype=float)
    b = np.array([r["overhead_s"] / PASSES for r in rows])
    (u, p), *_ = np.linalg.lstsq(a, b, rcond=None)
    pred = a @ np.array([u, p])
    return {"unit_s": float(u), "tensor_s": float(p), "max_rel_residual": float(np.max(np.abs(pred - b) / b))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    rows, cases = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for layers in args.layers:
            model_dir = write_model(root, layers)
            counts = hook_counts(model_dir)
            step = {}
            for strategy, unit in CASES:
                key = f"{strategy}-{unit}" if unit else strategy
                step[key] = run_case(model_dir, root / f"run-{layers}-{key}", strategy, unit, args.steps, args.device)
                cases.append({"layers": layers, "strategy": strategy, "fetch_unit": unit, "median_step_s": step[key]})
                print(f"layers {layers:3d} {key:13s} {step[key] * 1e3:8.1f} ms", flush=True)
            for unit in ("module", "layer"):
                rows.append({"layers": layers, "fetch_unit": unit, "units": counts[unit], "tensors": counts["tensors"],
                             "overhead_s": step[f"zero3-{unit}"] - step["zero2"]})
    coef = fit(rows)
    result = {
        "about": "ZeRO-3 host overhead per fetch unit: median step time of shardwise train (1 rank, "
                 f"{args.device}, {args.steps} steps, synthetic seq 64, micro-batch 2, no accumulation) on a "
                 "hidden-64 Qwen2, zero3 minus zero2; fit overhead/passes = units*U + tensors*P",
        "device": args.device, "cases": cases, "overheads": rows, "fit": coef,
        "step_ratio_layer_vs_module": {str(r["layers"]): next(c["median_step_s"] for c in cases if c["layers"] == r["layers"]
                                                          and c["fetch_unit"] == "layer")
                                       / next(c["median_step_s"] for c in cases if c["layers"] == r["layers"]
                                              and c["fetch_unit"] == "module") for r in rows[::2]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(coef, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
