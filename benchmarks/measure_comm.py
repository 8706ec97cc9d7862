"""Regenerate benchmarks/results/measured_comm.json: bytes each rank hands to collectives.

    python benchmarks/measure_comm.py                  # every case (2 gloo processes, ~2-3 min)
    python benchmarks/measure_comm.py zero3@ga1 fsdp@ga2   # just these (merged into the file)

CPU only. Per case (variant × gradient accumulation) and rank: bytes per optimizer step per
collective kind (unit: shardwise/bench/comm.py), calls, dtypes, and the same in units of
Ψ·4 bytes. The planner is never consulted here.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "measured_comm.json"


def _versions() -> dict[str, str]:
    import deepspeed
    import torch
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def volume(bytes_per_kind: dict[str, float]) -> float:
    """Ring-traffic volume: an all-reduce moves twice its size, everything else once."""
    return sum((2 if k == "all_reduce" else 1) * v for k, v in bytes_per_kind.items())


def measure(cases: list[str]) -> dict:
    from shardwise.bench import comm_worker as w

    sizes = w.param_sizes()
    psi = sum(sizes.values())
    unit = 4 * psi
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    out: dict = {
        "what": "bytes each rank hands to torch.distributed collectives per optimizer step (mean of the last steps_measured of steps_run steps), "
                "counted by a TorchDispatchMode on c10d ops (src/shardwise/bench/comm.py); "
                "all_reduce = tensor bytes, all_gather = full gathered output, reduce_scatter = full input, "
                "reduce = tensor reduced to one rank, broadcast = tensor; volume = 2*all_reduce + the rest",
        "psi": psi, "unit_bytes": unit, "unit": "psi*4 bytes (one fp32 copy of the model)",
        "world_size": w.WORLD, "seq_len": w.SEQ, "micro_batch": w.BATCH,
        "steps_run": w.STEPS, "steps_measured": w.MEASURED_STEPS,
        "model": {"model_type": "llama", **w.TINY_LLAMA},
        "param_numel": sizes,
        "engines": "shardwise's build_engine on bench_config (the run bridge), driven as the training "
                   "loop drives it: sync_grads(last) + forward_backward per micro-batch, then step",
        "versions": _versions(),
        "cases": dict(old.get("cases", {})),
    }
    runs = w.measure_comm(cases, timeout_s=60 + 30 * len(cases))
    for case, ranks in runs.items():
        variant, ga = w.parse_case(case)
        entry: dict = {"variant": variant, "grad_accum": ga,
                       "config": w.bench_config(variant, ga).model_dump(mode="json")}
        if variant.startswith("zero"):
            entry["deepspeed_config"] = w.ds_config(variant, ga)
        entry["ranks"] = []
        for r in ranks:
            if "error" in r:
                entry["ranks"].append(r)
                continue
            b = r["bytes_per_step"]
            entry["ranks"].append(r | {
                "volume": volume(b),
                "in_psi4": {k: round(v / unit, 5) for k, v in b.items()} | {"volume": round(volume(b) / unit, 5)},
            })
        out["cases"][case] = entry
    return out


def main(argv: list[str]) -> None:
    from shardwise.bench import comm_worker as w

    cases = argv[1:] or list(w.ALL_CASES)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = measure(cases)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    for case, e in result["cases"].items():
        r = e["ranks"][0]
        print(f"{case:22s}", r.get("in_psi4", r.get("error")))


if __name__ == "__main__":
    main(sys.argv)
