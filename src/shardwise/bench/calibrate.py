"""`shardwise calibrate`: measure what this machine's devices sustain and write a hardware profile
(`shardwise.specs.profile`) that `shardwise plan --profile` and the trainer's
`hardware.profile` use instead of the catalog's figures.

Measured, on CUDA when there is a GPU, else on the CPU (and then said so in the profile):

- GEMM throughput at the shapes of the configured model's linears (the planner's `_layer_gemms`
  widths, a few thousand tokens), in the compute dtype (bf16 on CUDA, fp32 on CPU);
- causal SDPA forward + backward throughput in model FLOPs (6·s·h per token, as the planner counts);
- memory bandwidth of a large copy (read + write);
- torch AdamW on CPU tensors (the host step of FSDP2's CPU offload), params/s;
- host→device copies from pinned memory (CUDA only);
- all-reduce / all-gather / reduce-scatter bus bandwidth per message size over `--gpus` local
  ranks (NCCL on CUDA, gloo on CPU), and the latency of the smallest message.

On a GPU the catalog entry matching `torch.cuda.get_device_name` keeps its datasheet peaks and
the profile sets the efficiencies (measured / peak), so MFU stays relative to the datasheet. On a
CPU, or a GPU the catalog lacks, the measured rates become the peaks and the efficiencies 1.0.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SIZES_CPU = (1 << 12, 1 << 16, 1 << 20, 1 << 23)  # bytes per collective message
SIZES_CUDA = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28)
# torch.cuda.get_device_name substrings → catalog GPU (first match wins)
GPU_NAMES = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100-SXM4-40GB", "a100-40g"),
             ("A100-PCIE-40GB", "a100-40g"), ("A100", "a100-80g"), ("L40S", "l40s"), ("4090", "rtx-4090"),
             ("3090", "rtx-3090"), ("V100", "v100-32g"), ("MI300X", "mi300x"))


def _timed(fn, repeat: int, sync) -> float:
    """Median seconds of `fn` over `repeat` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def catalog_gpu(device_name: str) -> str | None:
    for needle, name in GPU_NAMES:
        if needle.lower() in device_name.lower():
            return name
    return None


def measure_device(model_name: str = "llama-2-7b", quick: bool = False) -> dict[str, Any]:
    """GEMM, attention, bandwidth and (CUDA) PCIe rates of this process's device."""
    import torch

    from shardwise import catalog

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = catalog.get_model(model_name)
    scale = 1 if cuda else 8  # CPU: the model's shapes scaled down, same aspect ratios
    h = max(64, model.hidden_size // scale)
    widths = sorted({max(64, w // scale) for w in (model.q_dim, model.kv_dim, model.intermediate_size)})
    tokens = (4096 if cuda else 512) // (2 if quick else 1)
    repeat = 3 if quick else 10
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype)}

    gemm = {}
    for n in widths:
        a = torch.randn(tokens, h, device=dev, dtype=dtype)
        b = torch.randn(h, n, device=dev, dtype=dtype)
        t = _timed(lambda a=a, b=b: a @ b, repeat, sync)
        gemm[f"{tokens}x{h}x{n}"] = 2 * tokens * h * n / t
    out["gemm_flops"] = gemm
    out["gemm_best_flops"] = max(gemm.values())

    heads, d = max(1, model.num_heads // scale), model.head_dim
    seq = (4096 if cuda else 512) // (2 if quick else 1)
    q, k, v = (torch.randn(1, heads, seq, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))

    def attention():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.sum().backward()

    t = _timed(attention, repeat, sync)
    out["attention_flops"] = 6 * seq * seq * heads * d / t  # the planner's causal model FLOPs

    numel = (1 << 28 if cuda else 1 << 25) // (2 if quick else 1)
    src = torch.empty(numel, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), repeat, sync)
    out["memory_bytes_per_s"] = 2 * 4 * numel / t

    # torch AdamW on CPU tensors: the host step FSDP2's CPUOffloadPolicy runs
    n_params = (1 << 22) // (2 if quick else 1)
    p = torch.nn.Parameter(torch.randn(n_params))
    p.grad = torch.randn(n_params)
    opt = torch.optim.AdamW([p], lr=1e-4)
    t = _timed(opt.step, repeat, lambda: None)
    out["host_torch_adam_params_per_s"] = n_params / t

    if cuda:
        host = torch.empty(numel, dtype=torch.float32).pin_memory()
        t = _timed(lambda: src.copy_(host, non_blocking=True), repeat, sync)
        out["pcie_bytes_per_s"] = 4 * numel / t
    return out


# ----------------------------------------------------------------------------- collectives


def _collectives_rank(out_path: str, quick: bool) -> None:
    """One rank of the collective measurement (run by `shardwise.train.launch.spawn`)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda" if cuda else "cpu")
    sync = (lambda: (torch.cuda.synchronize(), dist.barrier())) if cuda else dist.barrier
    repeat = 3 if quick else 10
    sizes = SIZES_CUDA if cuda else SIZES_CPU
    results: dict[str, dict[str, float]] = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}
    # torch ≥ 2.13 names the flat-tensor collectives *_single (the *_tensor names are deprecated)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for size in sizes:
        n = max(world, size // 4 // world * world)
        full = torch.ones(n, device=dev)
        shard = torch.ones(n // world, device=dev)
        t = _timed(lambda full=full: dist.all_reduce(full), repeat, sync)
        results["all_reduce"][str(4 * n)] = t
        t = _timed(lambda full=full, shard=shard: all_gather(full, shard), repeat, sync)
        results["all_gather"][str(4 * n)] = t
        t = _timed(lambda full=full, shard=shard: reduce_scatter(shard, full), repeat, sync)
        results["reduce_scatter"][str(4 * n)] = t
    if rank == 0:
        Path(out_path).write_text(json.dumps({"world": world, "backend": dist.get_backend(), "seconds": results}))
    dist.barrier()
    dist.destroy_process_group()


def bus_bandwidth(seconds: dict[str, dict[str, float]], world: int) -> dict[str, Any]:
    """nccl-tests' bus bandwidth per kind and size: S·(n−1)/n / t for all-gather and
    reduce-scatter, twice that for all-reduce; the link figure is the largest message's (the
    median over kinds), the latency the smallest message's time per hop."""
    per_kind: dict[str, dict[str, float]] = {}
    for kind, by_size in seconds.items():
        factor = 2 if kind == "all_reduce" else 1
        per_kind[kind] = {s: factor * int(s) * (world - 1) / world / t for s, t in by_size.items()}
    largest = max(int(s) for s in seconds["all_gather"])
    smallest = min(int(s) for s in seconds["all_gather"])
    bus = statistics.median(per_kind[k][str(largest)] for k in per_kind)
    latency = statistics.median(seconds[k][str(smallest)] for k in seconds) / max(1, world - 1)
    return {"bus_bytes_per_s": bus, "latency_s": latency, "per_kind": per_kind}


def measure_collectives(world: int, quick: bool = False, timeout_s: float = 120) -> dict[str, Any]:
    from shardwise.errors import ShardwiseError
    from shardwise.train.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        argv = ["-m", "shardwise.bench.calibrate", "--collectives-rank", str(out)] + (["--quick"] if quick else [])
        code = spawn(argv, world, timeout_s=timeout_s, threads_per_rank=1)
        if code != 0 or not out.exists():
            raise ShardwiseError(f"calibrate: the {world}-rank collective measurement failed (exit {code})")
        raw = json.loads(out.read_text())
    return {"world": raw["world"], "backend": raw["backend"], "seconds": raw["seconds"],
            **bus_bandwidth(raw["seconds"], raw["world"])}


# ----------------------------------------------------------------------------- the profile


def build_profile(device: dict[str, Any], collectives: dict[str, Any] | None) -> dict[str, Any]:
    """The hardware-profile document (specs/profile.py's schema) from the measurements."""
    from shardwise import catalog

    name = device["device"]
    entry = catalog_gpu(name) if name != "cpu" else None
    gpu: dict[str, float] = {}
    if entry:  # datasheet peaks stay; what was sustained becomes the efficiencies
        spec = catalog.get_gpu(entry)
        peak = spec.peak_flops("bf16")
        gpu = {"gemm_efficiency": min(1.0, device["gemm_best_flops"] / peak),
               "attention_efficiency": min(1.0, device["attention_flops"] / peak),
               "hbm_efficiency": min(1.0, device["memory_bytes_per_s"] / spec.hbm_bytes_per_s)}
    else:  # no datasheet: the measured rates are the peaks
        rate = device["gemm_best_flops"]
        gpu = {"bf16_flops": rate, "fp16_flops": rate, "fp32_flops": rate,
               "hbm_bytes_per_s": device["memory_bytes_per_s"], "gemm_efficiency": 1.0,
               "attention_efficiency": min(1.0, device["attention_flops"] / rate), "hbm_efficiency": 1.0}
    doc: dict[str, Any] = {
        "gpu_name": name if name != "cpu" else "cpu (no GPU: rates of this host's CPU)",
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "host_torch_adam_params_per_s": device["host_torch_adam_params_per_s"],
        "raw": {"catalog_gpu": entry, **{k: v for k, v in device.items() if k != "device"}},
    }
    if "pcie_bytes_per_s" in device:
        doc["pcie_bytes_per_s"] = device["pcie_bytes_per_s"]
    if collectives:
        doc["intra"] = {"bus_bytes_per_s": collectives["bus_bytes_per_s"], "latency_s": collectives["latency_s"]}
        doc["raw"]["collectives"] = {k: collectives[k] for k in ("world", "backend", "per_kind", "seconds")}
    return doc


def calibrate(gpus: int = 1, out: Path | str | None = None, model: str = "llama-2-7b",
              quick: bool = False) -> tuple[Path, dict[str, Any]]:
    """Measure, validate the profile and write it (default: the user's cache directory)."""
    from shardwise.specs.profile import HardwareProfile, default_profile_path

    device = measure_device(model, quick=quick)
    collectives = measure_collectives(gpus, quick=quick) if gpus > 1 else None
    doc = build_profile(device, collectives)
    HardwareProfile.model_validate(doc)  # what we write, the planner can read
    path = Path(out) if out is not None else default_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path, doc


if __name__ == "__main__":  # a rank of the collective measurement
    if len(sys.argv) >= 3 and sys.argv[1] == "--collectives-rank":
        _collectives_rank(sys.argv[2], quick="--quick" in sys.argv)
    else:
        raise SystemExit("usage: shardwise calibrate (this module's __main__ is a measurement rank)")
