"""`shardwise calibrate`: measure what this machine's devices sustain and write a hardware profile
(`shardwise.specs.profile`) that `shardwise plan --profile` and the trainer's
`hardware.profile` use instead of the catalog's figures.

Measured, on CUDA when there is a GPU, else on the CPU (and then said so in the profile):

- GEMM throughput at the shapes of the configured model's linears (the planner's `plan/kernels.py` `layer_gemms`
  widths, a few thousand tokens), in the compute dtype (bf16 on CUDA, fp32 on CPU);
- causal SDPA forward + backward throughput in model FLOPs (6·s·h per token, as the planner counts);
- memory bandwidth of a large copy (read + write);
- the AdamW step rate of the kernel the trainer uses on this device (fused on CUDA, torch's
  for-loop on CPU) over tensors shaped like the model's, params/s: the planner's optimizer step;
- torch AdamW on CPU tensors (the host step of FSDP2's CPU offload), params/s;
- host→device copies from pinned memory (CUDA only);
- the time model's host costs (specs/timing_model.py, the profile's `timing`): the gap per eager op
  when ops are too short to hide the launch (`launch_s`), and FSDP2's hook cost per unit, pass and
  hook on a one-rank group (`fsdp2_hook_s`; not when launched: rank 0 cannot make a group alone).
  ZeRO's hooks, DeepSpeed's step and its CPU Adam are not measured here yet: the catalog's values
  (measured on the H200 host, docs/accuracy.md) stay;
- all-reduce / all-gather / reduce-scatter bus bandwidth per message size (NCCL on CUDA, gloo on
  CPU) and the latency of the smallest message: over `--gpus` local ranks, or, launched by
  torchrun / srun over several nodes, inside each node (`intra`: the node's ranks, all nodes at
  once) and across nodes (`inter`: the ranks of one local rank across the nodes — one rail per
  NIC — all rails at once); nodes are LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE consecutive ranks.

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
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shardwise import strict_json
from shardwise.bench.calibrate_host import fsdp2_hook_s, launch_gap, timed
from shardwise.run.bridge import launcher_ranks_per_node

SIZES_CPU = (1 << 12, 1 << 16, 1 << 20, 1 << 23)  # bytes per collective message
SIZES_CUDA = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28)
# torch.cuda.get_device_name substrings → catalog GPU (first match wins)
GPU_NAMES = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100-SXM4-40GB", "a100-40g"),
             ("A100-PCIE-40GB", "a100-40g"), ("A100", "a100-80g"), ("L40S", "l40s"), ("4090", "rtx-4090"),
             ("3090", "rtx-3090"), ("V100", "v100-32g"), ("MI300X", "mi300x"), ("GB200", "gb200"), ("B200", "b200"),
             ("H20", "h20"), ("5090", "rtx-5090"), ("4070 Ti SUPER", None), ("4080 SUPER", None),
             ("4070 Ti", "rtx-4070-ti"), ("4080", "rtx-4080"), ("A10G", "a10g"),
             ("L40", None), ("L4", "l4"), ("MI250", "mi250x"), ("MI325X", "mi325x"))


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
        t = timed(lambda a=a, b=b: a @ b, repeat, sync)
        gemm[f"{tokens}x{h}x{n}"] = 2 * tokens * h * n / t
    out["gemm_flops"] = gemm
    out["gemm_best_flops"] = max(gemm.values())

    heads, d = max(1, model.num_heads // scale), model.head_dim
    seq = (4096 if cuda else 512) // (2 if quick else 1)
    q, k, v = (torch.randn(1, heads, seq, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))

    def attention():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.sum().backward()

    t = timed(attention, repeat, sync)
    out["attention_flops"] = 6 * seq * seq * heads * d / t  # the planner's causal model FLOPs

    numel = (1 << 28 if cuda else 1 << 25) // (2 if quick else 1)
    src = torch.empty(numel, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), repeat, sync)
    out["memory_bytes_per_s"] = 2 * 4 * numel / t

    # the trainer's AdamW on this device, over the model's layer shapes (per-tensor costs count)
    shapes = [(h, w) for w in widths] + [(w, h) for w in widths] + [(h,), (h,)]
    rate, impl = _adamw_rate(torch, dev, shapes, (1 << 24 if cuda else 1 << 21) // (2 if quick else 1), repeat, sync)
    out["adamw_params_per_s"], out["adamw_impl"] = rate, impl

    # torch AdamW on CPU tensors: the host step FSDP2's CPUOffloadPolicy runs
    n_params = (1 << 22) // (2 if quick else 1)
    p = torch.nn.Parameter(torch.randn(n_params))
    p.grad = torch.randn(n_params)
    opt = torch.optim.AdamW([p], lr=1e-4)
    t = timed(opt.step, repeat, lambda: None)
    out["host_torch_adam_params_per_s"] = n_params / t

    if cuda:
        host = torch.empty(numel, dtype=torch.float32).pin_memory()
        t = timed(lambda: src.copy_(host, non_blocking=True), repeat, sync)
        out["pcie_bytes_per_s"] = 4 * numel / t

    # the host's costs the time model carries (specs/timing_model.py): launch gaps, FSDP2's hooks
    out["launch_s"] = launch_gap(torch, dev, sync, quick)
    hook = fsdp2_hook_s(torch, dev, sync, quick)
    if hook is not None:
        out["fsdp2_hook_s"] = hook
    return out


def _adamw_rate(torch: Any, dev: Any, shapes: Sequence[tuple[int, ...]], target: int, repeat: int,
                sync: Any) -> tuple[float, str]:
    """Params/s of one AdamW step with the kernel the trainer builds on `dev`
    (train/engines/_torch_common.py `build_adamw`, run/bridge.py `optimizer_impl`): fused on CUDA,
    the for-loop reference on CPU; fp32 params over copies of `shapes` up to about `target`."""
    per = sum(int(torch.Size(sh).numel()) for sh in shapes)
    params = [torch.nn.Parameter(torch.randn(sh, device=dev)) for _ in range(max(1, target // per)) for sh in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    impl = "fused" if dev.type == "cuda" else "forloop"
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if impl == "fused" else {"foreach": False}))
    t = timed(opt.step, repeat, sync)
    return sum(p.numel() for p in params) / t, impl


# ----------------------------------------------------------------------------- collectives


def node_groups(world: int, local: int) -> dict[str, list[list[int]]]:
    """The groups measured at each link level, nodes being `local` consecutive ranks: `intra`,
    each node's ranks (when a node has more than one); `inter`, each local rank's peers on the
    other nodes (when there is more than one node)."""
    from shardwise.errors import ShardwiseError

    if local < 1 or world % local:
        raise ShardwiseError(f"calibrate: {world} ranks do not split into nodes of {local} (LOCAL_WORLD_SIZE); "
                             "every node must run the same number of ranks")
    nodes = world // local
    out: dict[str, list[list[int]]] = {}
    if local > 1:
        out["intra"] = [list(range(n * local, (n + 1) * local)) for n in range(nodes)]
    if nodes > 1:
        out["inter"] = [[n * local + i for n in range(nodes)] for i in range(local)]
    return out


def _collectives_rank(out_path: str, quick: bool) -> None:
    """One rank of the collective measurement (spawned by `measure_collectives`, or the calling
    process itself under an outer launcher): every level's groups at once, one message size at
    a time (a global barrier between); rank 0 writes its groups' times."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    levels = node_groups(world, launcher_ranks_per_node(world))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda" if cuda else "cpu")
    repeat = 3 if quick else 10
    sizes = SIZES_CUDA if cuda else SIZES_CPU
    # torch ≥ 2.13 names the flat-tensor collectives *_single (the *_tensor names are deprecated)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    report: dict[str, Any] = {}
    for level, groups in levels.items():
        handles = [dist.new_group(g) for g in groups]  # every rank creates every group, in order
        group = next(h for g, h in zip(groups, handles, strict=True) if rank in g)
        n = len(groups[0])
        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()

        results: dict[str, dict[str, float]] = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}
        for size in sizes:
            k = max(n, size // 4 // n * n)
            full = torch.ones(k, device=dev)
            shard = torch.ones(k // n, device=dev)
            results["all_reduce"][str(4 * k)] = timed(lambda f=full, g=group: dist.all_reduce(f, group=g), repeat, sync)
            results["all_gather"][str(4 * k)] = timed(
                lambda f=full, sh=shard, g=group: all_gather(f, sh, group=g), repeat, sync)
            results["reduce_scatter"][str(4 * k)] = timed(
                lambda f=full, sh=shard, g=group: reduce_scatter(sh, f, group=g), repeat, sync)
        report[level] = {"group_size": n, "groups": len(groups), "seconds": results}
    if rank == 0:
        Path(out_path).write_text(strict_json.dumps({"world": world, "local_world": launcher_ranks_per_node(world),
                                              "backend": dist.get_backend(), "levels": report}))
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


def _summarise(raw: dict[str, Any]) -> dict[str, Any]:
    levels = {lv: {**d, **bus_bandwidth(d["seconds"], d["group_size"])} for lv, d in raw["levels"].items()}
    return {"world": raw["world"], "local_world": raw["local_world"], "backend": raw["backend"], "levels": levels}


def measure_collectives(world: int, quick: bool = False, timeout_s: float = 120,
                        local_world: int | None = None) -> dict[str, Any]:
    """Spawn `world` local ranks and measure; `local_world` below `world` makes them measure as
    if nodes were that many ranks (the intra/inter split, testable on one machine)."""
    from shardwise.errors import ShardwiseError
    from shardwise.train.launch.spawn import spawn

    node_groups(world, local_world or world)  # refuse a bad layout before starting anything
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        argv = ["-m", "shardwise.bench.calibrate", "--collectives-rank", str(out)] + (["--quick"] if quick else [])
        extra = {"LOCAL_WORLD_SIZE": str(local_world)} if local_world else None
        code = spawn(argv, world, timeout_s=timeout_s, threads_per_rank=1, extra_env=extra)
        if code != 0 or not out.exists():
            raise ShardwiseError(f"calibrate: the {world}-rank collective measurement failed (exit {code})")
        raw = json.loads(out.read_text())
    return _summarise(raw)


def collectives_here(quick: bool = False) -> dict[str, Any] | None:
    """Under an outer launcher: this process is a rank of the measurement; rank 0 gets the result."""
    from shardwise.train.launch.rank import detect_env

    found = detect_env() or {"rank": 0, "world_size": 1, "local_rank": 0}
    for key, value in (("RANK", found["rank"]), ("WORLD_SIZE", found["world_size"]),
                       ("LOCAL_RANK", found["local_rank"])):
        os.environ.setdefault(key, str(value))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        _collectives_rank(str(out), quick)
        return _summarise(json.loads(out.read_text())) if int(found["rank"]) == 0 else None


# ----------------------------------------------------------------------------- the profile


def build_profile(device: dict[str, Any], collectives: dict[str, Any] | None) -> dict[str, Any]:
    """The hardware-profile document (specs/profile.py's schema) from the measurements."""
    from shardwise import catalog

    name = device["device"]
    entry = catalog_gpu(name) if name != "cpu" else None
    gpu: dict[str, Any] = {}
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
    if device.get("adamw_params_per_s"):  # the planner's optimizer step (plan/timing.py optimizer_time)
        gpu |= {"adamw_params_per_s": device["adamw_params_per_s"], "adamw_impl": device["adamw_impl"]}
    doc: dict[str, Any] = {
        "gpu_name": name if name != "cpu" else "cpu (no GPU: rates of this host's CPU)",
        "device": "cpu" if name == "cpu" else "cuda",
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "host_torch_adam_params_per_s": device["host_torch_adam_params_per_s"],
        # the time model's host constants measured here (the rest keep the catalog's, with its provenance)
        "timing": {k: device[k] for k in ("launch_s", "fsdp2_hook_s") if k in device},
        "raw": {"catalog_gpu": entry, **{k: v for k, v in device.items() if k != "device"}},
    }
    if "pcie_bytes_per_s" in device:
        doc["pcie_bytes_per_s"] = device["pcie_bytes_per_s"]
    if collectives:
        for level, d in collectives["levels"].items():
            doc[level] = {"bus_bytes_per_s": d["bus_bytes_per_s"], "latency_s": d["latency_s"]}
        doc["raw"]["collectives"] = {
            "world": collectives["world"], "local_world": collectives["local_world"],
            "backend": collectives["backend"],
            "levels": {lv: {k: d[k] for k in ("group_size", "groups", "per_kind", "seconds")}
                       for lv, d in collectives["levels"].items()}}
    return doc


def calibrate(gpus: int = 1, out: Path | str | None = None, model: str = "llama-2-7b",
              quick: bool = False) -> tuple[Path | None, dict[str, Any] | None]:
    """Measure, validate the profile and write it (default: the user's cache directory). Under
    torchrun / deepspeed / srun this process is one rank (`gpus` does not apply): rank 0
    measures its device and writes; every rank takes part in the collectives; the other ranks
    return (None, None)."""
    from shardwise.specs.profile import HardwareProfile, default_profile_path
    from shardwise.train.launch.rank import detect_env

    launched = detect_env()
    rank = int(launched["rank"]) if launched else 0
    device = measure_device(model, quick=quick) if rank == 0 else None
    if launched:
        collectives = collectives_here(quick) if int(launched["world_size"]) > 1 else None
    else:
        collectives = measure_collectives(gpus, quick=quick) if gpus > 1 else None
    if device is None:
        return None, None
    doc = build_profile(device, collectives)
    HardwareProfile.model_validate(doc)  # what we write, the planner can read
    path = Path(out) if out is not None else default_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(strict_json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path, doc


if __name__ == "__main__":  # a rank of the collective measurement
    if len(sys.argv) >= 3 and sys.argv[1] == "--collectives-rank":
        _collectives_rank(sys.argv[2], quick="--quick" in sys.argv)
    else:
        raise SystemExit("usage: shardwise calibrate (this module's __main__ is a measurement rank)")
