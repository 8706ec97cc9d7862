"""What will hurt a multi-GPU run on this machine (`machine_findings`), each in numbers from the
readings and with the public report it comes from where there is one."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from shardwise.doctor.derive import catalog_gpu, nvlinked
from shardwise.doctor.probe import Machine
from shardwise.specs.machine import MachineHardware

GIB = 2**30
LOW_DISK = 100 * 2**30  # below this, a 7B run's keep_last checkpoints and export do not fit


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning", "note"]
    code: str  # stable name (tests, --json)
    message: str

    def as_dict(self) -> dict:
        return {"level": self.level, "code": self.code, "message": self.message}


# torch's reference loops against fp32 on one AVX2 core (AMD EPYC, torch 2.13.0 CPU build, a 64x2048 by
# 2048x5632 product): fp32 25-53 GFLOP/s, bf16 7.6 for x @ W^T and 0.2 for g @ W, fp16 alike
REFERENCE_LOOPS = "measured 4-260x slower than fp32 (a linear's input gradient at 0.2 GFLOP/s on an AVX2 core)"


def flags_have_half_matmul(flags: tuple[str, ...]) -> bool:
    """Whether torch's oneDNN has bf16/fp16 matrix kernels for an x86 CPU with these flags: its
    avx512_core (AVX-512 F, BW, VL, DQ) or AVX2-VNNI-2 (`avx_ne_convert`), which is what
    torch's mkldnn_bf16_device_check asks of ideep (ATen/native/mkldnn/Utils.h)."""
    have = set(flags)
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have or "avx_ne_convert" in have


def _on(env: dict[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in ("1", "true", "yes")


def machine_findings(m: Machine, spec: MachineHardware) -> list[Finding]:
    out: list[Finding] = []
    env = m.nccl_env
    if not m.gpus:
        torch_cuda = m.versions.get("torch cuda")
        out.append(Finding("note", "no-gpu", (
            "no NVIDIA GPU on this machine: shardwise train runs here on CPU (`run.device: cpu`): "
            "`shardwise train CONFIG --nproc N` starts N local ranks joined by gloo, sharing these "
            f"{m.cpus} CPU core(s) ({m.cpus}//N intra-op threads each), with DS_ACCELERATOR=cpu for DeepSpeed; "
            "NCCL, NVLink and InfiniBand settings do not apply. The torch installed is "
            + (f"a CUDA {torch_cuda} build." if torch_cuda else "a CPU build." if m.versions.get("torch")
               else "not installed.")
            + " `plan --hardware auto` has nothing to plan here: plan the GPUs you will run on with --gpu.")))
        if m.cpu_flags and not flags_have_half_matmul(m.cpu_flags):
            out.append(Finding("warning", "cpu-16-bit-matmul", (
                "this CPU has no AVX-512 (/proc/cpuinfo flags): torch multiplies bf16 and fp16 matrices here in its "
                f"reference loops, not oneDNN's kernels, {REFERENCE_LOOPS}: CPU runs on this machine train faster "
                "at `precision: fp32`, and a large model's 16-bit step can outlast `run.timeout_s`.")))
    names = Counter(g.name for g in m.gpus)
    if len(names) > 1:
        listed = ", ".join(f"{n}× {name}" for name, n in names.items())
        out.append(Finding("warning", "mixed-gpus", (
            f"mixed GPUs: {listed}. Every collective waits for the slowest rank and the smallest memory "
            "bounds what fits; ZeRO-3 on mixed GPUs ran ~100× slower in LLaMA-Factory#3520. Restrict the "
            "job to one model with CUDA_VISIBLE_DEVICES (indices: " + "; ".join(
                f"{name}: {','.join(str(g.index) for g in m.gpus if g.name == name)}" for name in names) + ").")))
    for name in names:
        if catalog_gpu(name) is None:
            out.append(Finding("warning", "unknown-gpu", f"{name!r} is not in shardwise's catalog: plans need --gpu "
                               "with the nearest catalog GPU (and --gpu-memory-gb)"))
    if len(m.gpus) > 1 and m.topology:
        nv, pairs = nvlinked(m.topology)
        sys_pairs = sum(1 for i in range(len(m.topology)) for j in range(i + 1, len(m.topology))
                        if m.topology[i][j].upper() == "SYS")
        if 0 < nv < pairs:
            out.append(Finding("warning", "partial-nvlink", (
                f"NVLink joins {nv} of {pairs} GPU pairs (no NVSwitch): rings over all {len(m.gpus)} GPUs cross "
                f"PCIe, planned as {spec.intra}. Keep tensor-parallel groups inside NVLinked pairs.")))
        elif nv == 0:
            out.append(Finding("note", "pcie-only", f"no NVLink between the {len(m.gpus)} GPUs: data-parallel "
                               f"traffic crosses PCIe ({spec.intra}); ZeRO-3/FSDP's extra all-gather costs more here"))
        if sys_pairs and nv < pairs:
            out.append(Finding("warning", "cross-socket", (
                f"{sys_pairs} GPU pair(s) reach each other only across CPU sockets (SYS in `nvidia-smi topo -m`): "
                "PCIe P2P is off there and traffic goes through host memory and the inter-socket link")))
    ib_active = [p for p in m.ports if p.active and p.link_layer == "InfiniBand"]
    if _on(env, "NCCL_IB_DISABLE") and [p for p in m.ports if p.active]:
        out.append(Finding("error", "nccl-ib-disabled", (
            f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']} with {len([p for p in m.ports if p.active])} active "
            "InfiniBand/RoCE port(s): NCCL falls back to TCP sockets between nodes, planned as "
            f"{spec.inter or 'no network'}; multi-node ZeRO-3 crawled this way in ms-swift#1825. Unset it "
            "(or set NCCL_IB_HCA to the ports to use).")))
    if _on(env, "NCCL_P2P_DISABLE") and len(m.gpus) > 1:
        out.append(Finding("warning", "nccl-p2p-disabled", (
            f"NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']}: GPU-to-GPU traffic inside the node goes through host "
            f"memory" + (" instead of NVLink" if m.topology and nvlinked(m.topology)[0] else "")
            + f", planned as {spec.intra}. Unset it unless a driver bug needs it.")))
    if _on(env, "NCCL_SHM_DISABLE"):
        out.append(Finding("note", "nccl-shm-disabled", "NCCL_SHM_DISABLE=1: where P2P is off too, ranks of one "
                           "node talk over the network stack"))
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname is not None:
        known = {i.name for i in m.interfaces} | {"lo"}
        wanted = [w.strip() for w in ifname.split(",") if w.strip()]
        include = [w for w in wanted if not w.startswith("^")]  # "^eth": every interface but those
        exact = [w.removeprefix("=") for w in include]
        matches = [w for w in include
                   if any(k == w[1:] if w.startswith("=") else k.startswith(w) for k in known)]  # prefix match
        if exact and not matches:
            out.append(Finding("error", "nccl-socket-ifname", (
                f"NCCL_SOCKET_IFNAME={ifname} matches no interface here ({', '.join(sorted(known))}): NCCL's "
                "bootstrap fails or hangs at init")))
        elif exact and all(w in ("lo", "docker0") for w in exact):
            out.append(Finding("warning", "nccl-socket-ifname", (
                f"NCCL_SOCKET_IFNAME={ifname}: a loopback/container bridge cannot reach other nodes")))
    hca = env.get("NCCL_IB_HCA")
    if hca and m.ports:
        devices = {p.device for p in m.ports}
        named = [h.strip().lstrip("=^").split(":")[0] for h in hca.split(",") if h.strip()]
        if not hca.strip().startswith("^") and not any(d.startswith(n) for n in named for d in devices):
            out.append(Finding("error", "nccl-ib-hca", f"NCCL_IB_HCA={hca} names none of {', '.join(sorted(devices))}"))
    down = [p for p in m.ports if not p.active]
    if down:
        out.append(Finding("warning", "ports-down", "not active: " + ", ".join(
            f"{p.device} port {p.port} ({p.link_layer}, {p.state})" for p in down)))
    if ib_active and len(m.gpus) > len(ib_active) and not _on(env, "NCCL_IB_DISABLE"):
        out.append(Finding("note", "nics-shared", (
            f"{len(ib_active)} active InfiniBand port(s) for {len(m.gpus)} GPUs: each GPU gets "
            f"{len(ib_active)}/{len(m.gpus)} of a NIC between nodes (planned with nics_per_node "
            f"{spec.nics_per_node})")))
    gpu_mem = sum(g.memory_bytes for g in m.gpus)
    if m.host_memory_bytes and gpu_mem and m.host_memory_bytes < gpu_mem:
        out.append(Finding("warning", "host-memory", (
            f"host RAM {m.host_memory_bytes / GIB:.0f} GiB is less than the GPUs' {gpu_mem / GIB:.0f} GiB: "
            "loading a model whole per rank or offloading optimizer states can run out of host memory first "
            "(`shardwise plan` shows the load and offload peaks per node)")))
    if m.disk_free_bytes is not None and m.disk_free_bytes < LOW_DISK:
        out.append(Finding("warning", "disk", (
            f"{m.disk_free_bytes / GIB:.0f} GiB free on {m.disk_path}: a 7B full fine-tune checkpoint is ~100 GiB "
            "(fp32 master + Adam moments + bf16 weights)")))
    v = m.versions
    if m.gpus and v.get("torch") and not v.get("torch cuda"):
        out.append(Finding("error", "torch-cpu-build", f"torch {v['torch']} is a CPU build on a machine with "
                           f"{len(m.gpus)} GPU(s): install a CUDA wheel"))
    if m.gpus and not v.get("deepspeed"):
        out.append(Finding("note", "no-deepspeed", "DeepSpeed is not installed: the zero* strategies cannot run"))
    return out
