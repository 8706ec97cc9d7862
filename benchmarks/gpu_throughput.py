"""The trainer's throughput on the H200 cases, now vs the measurements of 2026-11-30.

Runs every case of `benchmarks/measurements/h200-trainer-cases.json` (model, strategy, seq,
micro-batch, activation checkpointing, steps; bf16-mixed, world size 1) through the trainer's
own path (TrainConfig → run bridge → preflight memory check → `train`), in one process, and
writes per case: tokens/s (median over the steps after the first), MFU (the trainer's
convention: `plan/flops.py` `run_flops_per_token` over the GPU's dense bf16 peak), peak
allocated memory and the final loss, beside the measured figures of the file and the ratio.

    python benchmarks/gpu_throughput.py                 # on one GPU, about 5 minutes
    python benchmarks/gpu_throughput.py --cases q05-fsdp,l7b8-fsdp
    python benchmarks/gpu_throughput.py --cpu           # the same cases at tiny size on CPU (CI)

`--cpu` maps each case to the tiny shape of its family (tiny-qwen / tiny-llama), seq 128,
micro-batch 2, 4 steps: it checks correctness (finite, falling loss through every engine: the
fsdp cases keep `fully_shard` there, `--fsdp-single-rank fsdp`, where a GPU run takes the
trainer's default, which may run them as DDP) and
records relative speed; CPU tokens/s say nothing about a GPU. Offload cases are skipped on CPU
(DeepSpeed's CPU Adam op is compiled on first use; FSDP2's CPU offload is a no-op there).
Results: benchmarks/results/gpu_throughput[_cpu].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
CASES = HERE / "measurements" / "h200-trainer-cases.json"
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

TINY = {"qwen2.5-0.5b": "tiny-qwen", "llama-2-7b": "tiny-llama", "config": "tiny-llama"}
CPU_SEQ, CPU_MICRO, CPU_STEPS = 128, 2, 4


def load_cases(names: list[str] | None = None) -> list[dict]:
    cases = json.loads(CASES.read_text())["cases"]
    if names:
        unknown = set(names) - {c["name"] for c in cases}
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)}; known: {', '.join(c['name'] for c in cases)}")
        cases = [c for c in cases if c["name"] in names]
    return cases


def _model_section(case: dict, cpu: bool, workdir: Path) -> dict:
    """Catalog name, tiny shape on CPU, or the file's "config" shapes written as a local
    config.json built with random weights (the measurements did the same)."""
    if cpu:
        return {"name": TINY[case["model"]], "attention": "sdpa"}
    if case["model"] != "config":
        return {"name": case["model"], "attention": "sdpa"}
    from h200_cases import CONFIGS

    key = case["name"].split("-")[0]
    d = workdir / key
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIGS[key].to_hf_dict()))
    return {"name": None, "path": str(d), "random_init": True, "attention": "sdpa"}


def case_config(case: dict, cpu: bool, workdir: Path, single_rank: str = "auto"):
    from shardwise.config.schema import TrainConfig

    seq, micro, steps = (CPU_SEQ, CPU_MICRO, CPU_STEPS) if cpu else (case["seq"], case["micro_batch"], case["steps"])
    return TrainConfig.model_validate({
        "name": case["name"],
        "model": _model_section(case, cpu, workdir),
        # CPU: one batch seen every step (the loss must fall); GPU: fresh random batches, as measured
        "data": {"kind": "synthetic", "synthetic": {"samples": micro if cpu else micro * steps, "seq_len": seq}},
        # FSDP2 on one GPU runs as DDP where the plan says so (auto); "fsdp" keeps fully_shard, as measured
        "strategy": {"name": case["strategy"], "fsdp": {"single_rank": single_rank}},
        "optimizer": {"lr": 3e-3 if cpu else 1e-4, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "precision": "fp32" if cpu else case["precision"],
        "checkpointing": {"activation": case["activation"], "output_dir": str(workdir / case["name"]),
                          "save_every_minutes": None, "save_on_interrupt": False},
        "run": {"steps": steps, "micro_batch": micro, "device": "cpu" if cpu else "cuda", "nproc": 1},
        "logging": {"progress": False, "tensorboard": False},
        "hardware": {"gpu": case.get("gpu", "h200"), "check_memory": not cpu},
    })


def run_case(case: dict, env, cpu: bool, workdir: Path, single_rank: str = "auto") -> dict:
    import torch

    from shardwise.plan.flops import run_flops_per_token
    from shardwise.run import run_spec
    from shardwise.train.loop import train
    from shardwise.train.preflight import check_memory

    cfg = case_config(case, cpu, workdir, single_rank)
    run = run_spec(cfg, 1, "cpu" if cpu else "cuda")
    if not cpu:
        check_memory(run)  # the trainer refuses a planned OOM before building anything
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    res = train(run, env)
    wall = time.perf_counter() - t0
    steady = [r.tokens / r.step_time_s for r in res.records[1:]] or [res.records[0].tokens / res.records[0].step_time_s]
    tps = statistics.median(steady)
    out = {"tokens_per_s": tps, "losses": res.losses, "wall_s": wall, "engine": run.engine_strategy.engine,
           "cross_entropy": run.train.cross_entropy}
    if not cpu:
        peak = run.hardware.gpu.peak_flops(run.train.compute_dtype)
        out |= {"mfu": tps * run_flops_per_token(run.model, run.train) / peak,
                "max_allocated_bytes": float(torch.cuda.max_memory_allocated())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (correctness, relative speed)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/...)")
    ap.add_argument("--fsdp-single-rank", choices=("auto", "ddp", "fsdp"), default=None,
                    help="what the fsdp cases run as on one rank (strategy.fsdp.single_rank; measured: fully_shard). "
                         "Default: auto on a GPU (the trainer's default); fsdp with --cpu, so every engine runs")
    args = ap.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from shardwise.train.launch.rank import init_distributed

    if args.cpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu for the tiny CPU cases")
    cases = load_cases([c for c in args.cases.split(",") if c])
    single_rank = args.fsdp_single_rank or ("fsdp" if args.cpu else "auto")
    env = init_distributed("cpu" if args.cpu else "cuda")
    reference = {c["name"]: c["measured"] for c in json.loads(CASES.read_text())["cases"]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            if args.cpu and "offload" in case["strategy"]:
                rows.append({"name": case["name"], "skipped": "offload case: not run on CPU (see the docstring)"})
                continue
            now = run_case(case, env, args.cpu, Path(tmp), single_rank)
            row = {"name": case["name"], "strategy": case["strategy"], "engine": now["engine"], "model": case["model"],
                   "now": now}
            if not args.cpu:
                before = reference[case["name"]]
                row["before"] = {"tokens_per_s": before["tokens_per_s"], "max_allocated_bytes": before["max_allocated_bytes"],
                                 "mfu": before["per_step"][-1].get("mfu")}
                row["speedup"] = now["tokens_per_s"] / before["tokens_per_s"]
                row["memory_ratio"] = now["max_allocated_bytes"] / before["max_allocated_bytes"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "now"} | {
                "tokens_per_s": round(now["tokens_per_s"]), "mfu": now.get("mfu")}), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    out = args.out or RESULTS / ("gpu_throughput_cpu.json" if args.cpu else "gpu_throughput.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "torch": torch.__version__, "cpu_mode": args.cpu,
                               "date": time.strftime("%Y-%m-%d"), "cases": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
