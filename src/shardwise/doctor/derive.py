"""Readings -> the catalog's names (`hardware_spec(machine)` -> MachineHardware): which catalog
GPU each model name is, the link the data-parallel traffic crosses inside the node (from the
topology matrix and NCCL_P2P_DISABLE), the network NCCL will use between nodes (the active
InfiniBand/RoCE ports, or the fastest Ethernet interface when NCCL_IB_DISABLE=1 or there are
none) and how many NICs. Every choice that is not a plain match is said in `notes`."""

from __future__ import annotations

import re
from collections import Counter

from shardwise import catalog
from shardwise.doctor.probe import GPU, Machine
from shardwise.specs.machine import MachineHardware

GB = 1e9
# nvidia-smi / NVML product names -> catalog GPU (first match wins; PCIe before SXM for the
# names that differ only by form factor)
GPU_NAMES: tuple[tuple[str, str], ...] = (
    (r"\bH200\b", "h200"),
    (r"\bH100\b.*\b(PCIe|NVL)\b", "h100-pcie"),
    (r"\bH100\b", "h100-sxm"),
    (r"\bH800\b", "h100-sxm"),
    (r"\bA800\b", "a800-80g"),
    (r"\bA100\b.*\b40\s?GB\b", "a100-40g"),
    (r"\bA100\b", "a100-80g"),
    (r"\bV100\b", "v100-32g"),
    (r"\bL40S\b", "l40s"),
    (r"\bRTX 4090\b", "rtx-4090"),
    (r"\bRTX 3090\b", "rtx-3090"),
    (r"\bMI300X\b", "mi300x"),
    (r"\bGB200\b", "gb200"),
    (r"\bB200\b", "b200"),
    (r"\bH20\b", "h20"),
    (r"\bRTX 5090\b", "rtx-5090"),
    (r"\bRTX 4080\b(?!\s*SUPER)", "rtx-4080"),
    (r"\bRTX 4070 Ti\b(?!\s*SUPER)", "rtx-4070-ti"),
    (r"\bL4\b", "l4"),
    (r"\bA10G\b", "a10g"),
    (r"\bMI250X?\b", "mi250x"),
    (r"\bMI325X\b", "mi325x"),
)
PCIE_FORM = re.compile(r"\bPCIe\b", re.I)


def catalog_gpu(name: str) -> str | None:
    for pattern, key in GPU_NAMES:
        if re.search(pattern, name, re.I):
            return key
    return None


def _smallest(gpus: tuple[GPU, ...]) -> GPU:
    """The GPU a job across all of them is bound by: the least memory, then the slowest."""
    def rate(g: GPU) -> float:
        key = catalog_gpu(g.name)
        if key is None:
            return 0.0
        spec = catalog.get_gpu(key)
        return spec.bf16_flops or spec.fp16_flops

    return min(gpus, key=lambda g: (g.memory_bytes, rate(g)))


def nvlinked(topology: tuple[tuple[str, ...], ...]) -> tuple[int, int]:
    """(pairs joined by NVLink, all pairs) of the GPU x GPU matrix."""
    n = len(topology)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    nv = sum(1 for i, j in pairs if topology[i][j].upper().startswith("NV"))
    return nv, len(pairs)


def _intra(machine: Machine, gpu: str, notes: list[str]) -> str:
    own = catalog.gpu_link(gpu)
    pcie = catalog.get_link("pcie", gpu).name
    if len(machine.gpus) < 2:
        return own
    if machine.nccl_env.get("NCCL_P2P_DISABLE", "").strip() in ("1", "true", "True"):
        notes.append(f"intra {pcie}: NCCL_P2P_DISABLE is set, so NCCL stages GPU-to-GPU traffic through host "
                     "memory (no NVLink, no PCIe P2P)")
        return pcie
    if not machine.topology:
        notes.append(f"intra {own}: the GPU's own link (no topology matrix could be read)")
        return own
    nv, pairs = nvlinked(machine.topology)
    if nv == pairs:
        return catalog.gpu_nvlink(gpu) or own
    if nv:
        notes.append(f"intra {pcie}: NVLink joins {nv} of {pairs} GPU pairs; a ring over all GPUs crosses PCIe")
    elif own != pcie:
        notes.append(f"intra {pcie}: no NVLink between the GPUs (the topology matrix shows PCIe paths only)")
    return pcie


def _inter(machine: Machine, notes: list[str]) -> tuple[str | None, int | None]:
    ib_off = machine.nccl_env.get("NCCL_IB_DISABLE", "").strip() in ("1", "true", "True")
    active = [p for p in machine.ports if p.active]
    if active and not ib_off:
        ib = [p for p in active if p.link_layer == "InfiniBand"]
        use = ib or [p for p in active if p.link_layer == "Ethernet"]
        rate = min((p.rate_gbps for p in use if p.rate_gbps), default=None)
        if ib:
            link = "ib-400" if rate and rate >= 400 else "ib-200"
            if rate is None or rate < 200:
                notes.append(f"inter ib-200: InfiniBand at {rate or 'an unread rate'} Gb/s; the catalog's slowest "
                             "InfiniBand is HDR 200, so the plan is optimistic")
            elif rate not in (200, 400):
                notes.append(f"inter {link}: InfiniBand at {rate:g} Gb/s priced as the catalog's {link}")
        else:
            link = "roce-100"
            if rate and rate != 100:
                notes.append(f"inter roce-100: RoCE at {rate:g} Gb/s priced as the catalog's only RoCE entry "
                             "(100 Gb/s)")
        return link, len(use)
    up = [i for i in machine.interfaces if i.up and i.speed_mbps]
    if not up:
        if ib_off and active:
            notes.append("inter: NCCL_IB_DISABLE=1 and no Ethernet interface speed could be read")
        return None, None
    fastest = max(up, key=lambda i: i.speed_mbps or 0)
    gbps = (fastest.speed_mbps or 0) / 1000
    link = "eth-100" if gbps >= 100 else "eth-25" if gbps >= 25 else "eth-10"
    why = "NCCL_IB_DISABLE=1: NCCL uses TCP sockets" if ib_off and active else "no InfiniBand/RoCE port is active"
    notes.append(f"inter {link}: {why}, over the fastest interface up, {fastest.name} at {gbps:g} Gb/s")
    return link, 1


def hardware_spec(machine: Machine) -> MachineHardware:
    """The catalog's view of this node, and how each reading was mapped."""
    notes: list[str] = []
    read = {"gpus": dict(Counter(g.name for g in machine.gpus)), "gpu_source": machine.gpu_source,
            "topology_source": machine.topology_source,
            "ports": [f"{p.device}/{p.port} {p.link_layer} {p.state} {p.rate_gbps or '?'} Gb/s"
                      for p in machine.ports],
            "nccl_env": dict(machine.nccl_env)}
    host_gb = machine.host_memory_bytes / GB if machine.host_memory_bytes else None
    if not machine.gpus:
        notes.append("no NVIDIA GPU was found (no NVML, nvidia-smi absent or listing none)")
        return MachineHardware(gpu=None, gpus_per_node=1, host_memory_gb=host_gb, read=read, notes=tuple(notes))
    bound = _smallest(machine.gpus)
    gpu = catalog_gpu(bound.name)
    if len({g.name for g in machine.gpus}) > 1:
        notes.append(f"mixed GPUs: planned as {len(machine.gpus)}× {bound.name}, the smallest and slowest, which "
                     "every rank waits for")
    if gpu is None:
        notes.append(f"{bound.name!r} is not in the catalog (catalog/hardware.yaml): name the nearest with --gpu")
        return MachineHardware(gpu=None, gpus_per_node=len(machine.gpus), host_memory_gb=host_gb, read=read,
                               notes=tuple(notes))
    inter, nics = _inter(machine, notes)
    return MachineHardware(
        gpu=gpu, gpu_memory_gb=bound.memory_bytes / GB, gpus_per_node=len(machine.gpus),
        intra=_intra(machine, gpu, notes), inter=inter, nics_per_node=min(nics, len(machine.gpus)) if nics else None,
        host_memory_gb=host_gb, read=read, notes=tuple(notes))
