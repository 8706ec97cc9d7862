"""The readings of one machine, parsed (`read_machine(reader)` -> `Machine`): GPUs, the GPU
topology matrix, InfiniBand/RoCE ports, network interfaces, NCCL's environment, host memory,
disk, CPUs and library versions. Parsers take the tools' own output formats (`nvidia-smi
--query-gpu ... --format=csv,noheader,nounits`, `nvidia-smi topo -m`, `ibv_devinfo`, sysfs)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shardwise.doctor.readers import GPU_QUERY, IBV_DEVINFO, NVIDIA_SMI_GPUS, NVIDIA_SMI_TOPO, Reader

MIB = 2**20
IB_SYS = "/sys/class/infiniband"
NET_SYS = "/sys/class/net"
# NCCL's settings that change which transport (and so which bandwidth) a job gets
NCCL_KEYS = ("NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA",
             "NCCL_NET_GDR_LEVEL", "NCCL_P2P_LEVEL", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NET", "NCCL_DEBUG")


class _Reading(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GPU(_Reading):
    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str = ""


class Port(_Reading):
    device: str  # mlx5_0
    port: int
    state: str  # ACTIVE, DOWN, INIT, ...
    link_layer: Literal["InfiniBand", "Ethernet", "unknown"]
    rate_gbps: float | None = None  # sysfs ports/N/rate

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


class Interface(_Reading):
    name: str
    up: bool
    speed_mbps: int | None


class Machine(_Reading):
    gpus: tuple[GPU, ...] = ()
    gpu_source: Literal["nvml", "nvidia-smi", "none"] = "none"
    driver: str | None = None
    topology: tuple[tuple[str, ...], ...] = ()  # GPU x GPU, nvidia-smi topo -m's words (X, NV18, PIX, SYS...)
    topology_source: Literal["nvidia-smi", "nvml", "none"] = "none"
    ports: tuple[Port, ...] = ()
    ports_source: Literal["ibv_devinfo", "sysfs", "none"] = "none"
    interfaces: tuple[Interface, ...] = ()
    nccl_env: dict[str, str] = Field(default_factory=dict)
    host_memory_bytes: int | None = None
    disk_path: str = "."
    disk_total_bytes: int | None = None
    disk_free_bytes: int | None = None
    cpus: int = 1
    cpu_flags: tuple[str, ...] = ()  # the first processor's `flags` in /proc/cpuinfo (x86; empty elsewhere)
    versions: dict[str, str | None] = Field(default_factory=dict)


def parse_gpu_csv(text: str) -> tuple[list[GPU], str | None]:
    """`nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id,driver_version,uuid
    --format=csv,noheader,nounits` (memory in MiB)."""
    gpus, driver = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < len(GPU_QUERY) or not cells[0].isdigit():
            continue
        row = dict(zip(GPU_QUERY, cells, strict=False))
        try:
            mib = float(row["memory.total"])
        except ValueError:
            continue
        gpus.append(GPU(index=int(row["index"]), name=row["name"], memory_bytes=int(mib * MIB),
                        pci_bus_id=row["pci.bus_id"]))
        driver = row["driver_version"] or driver
    return gpus, driver


def parse_topology(text: str) -> tuple[tuple[str, ...], ...]:
    """The GPU x GPU block of `nvidia-smi topo -m` (NIC columns and affinities dropped)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # the header lists the columns (GPU0 GPU1 ... NIC0 ... CPU Affinity); row GPU0 starts "GPU0 X"
    header = next((ln for ln in lines if ln.split()[0] == "GPU0" and ln.split()[1:2] != ["X"]), None)
    if header is None:
        return ()
    n = sum(1 for tok in header.split() if re.fullmatch(r"GPU\d+", tok))
    rows = []
    for ln in lines:
        tokens = ln.split()
        if ln is not header and re.fullmatch(r"GPU\d+", tokens[0]) and len(tokens) > n:
            rows.append(tuple(tokens[1 : n + 1]))
    return tuple(rows) if len(rows) == n else ()


def parse_ibv_devinfo(text: str) -> list[tuple[str, int, str, str]]:
    """(device, port, state, link_layer) per port of `ibv_devinfo`."""
    out, device, port, state = [], None, None, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("hca_id:"):
            device, port = s.split(":", 1)[1].strip(), None
        elif s.startswith("port:") and device:
            port, state = int(s.split(":", 1)[1].strip()), None
        elif s.startswith("state:") and port is not None:
            state = s.split(":", 1)[1].split()[0].removeprefix("PORT_")
        elif s.startswith("link_layer:") and port is not None and state is not None:
            out.append((device, port, state, s.split(":", 1)[1].strip()))
    return out


def _rate(text: str | None) -> float | None:
    """sysfs `rate`: '400 Gb/sec (4X NDR)' -> 400.0."""
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def _link_layer(value: str | None) -> Literal["InfiniBand", "Ethernet", "unknown"]:
    v = (value or "").strip().lower()
    return "InfiniBand" if v == "infiniband" else "Ethernet" if v == "ethernet" else "unknown"


def read_ports(reader: Reader) -> tuple[list[Port], str]:
    text = reader.command(IBV_DEVINFO)
    ports = []
    if text:
        for device, port, state, layer in parse_ibv_devinfo(text):
            rate = _rate(reader.file(f"{IB_SYS}/{device}/ports/{port}/rate"))
            ports.append(Port(device=device, port=port, state=state, link_layer=_link_layer(layer), rate_gbps=rate))
        return ports, "ibv_devinfo"
    for device in reader.listdir(IB_SYS):
        for p in reader.listdir(f"{IB_SYS}/{device}/ports"):
            if not p.isdigit():
                continue
            base = f"{IB_SYS}/{device}/ports/{p}"
            state = (reader.file(f"{base}/state") or "").split(":")[-1].strip() or "unknown"
            ports.append(Port(device=device, port=int(p), state=state.upper(),
                              link_layer=_link_layer(reader.file(f"{base}/link_layer")),
                              rate_gbps=_rate(reader.file(f"{base}/rate"))))
    return ports, "sysfs" if ports else "none"


def read_interfaces(reader: Reader) -> list[Interface]:
    out = []
    for name in reader.listdir(NET_SYS):
        if name == "lo":
            continue
        speed = (reader.file(f"{NET_SYS}/{name}/speed") or "").strip()
        up = (reader.file(f"{NET_SYS}/{name}/operstate") or "").strip() == "up"
        out.append(Interface(name=name, up=up, speed_mbps=int(speed) if speed.lstrip("-").isdigit()
                             and int(speed) > 0 else None))
    return out


def host_memory(reader: Reader) -> int | None:
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", reader.file("/proc/meminfo") or "", re.M)
    return int(m.group(1)) * 1024 if m else None


def cpu_flags(reader: Reader) -> tuple[str, ...]:
    m = re.search(r"^flags\s*:\s*(.*)$", reader.file("/proc/cpuinfo") or "", re.M)
    return tuple(m.group(1).split()) if m else ()


def read_machine(reader: Reader, disk_path: str = ".") -> Machine:
    nvml = reader.nvml()
    gpus, driver, source = [], None, "none"
    csv = reader.command(NVIDIA_SMI_GPUS)
    if csv:
        gpus, driver = parse_gpu_csv(csv)
        source = "nvidia-smi" if gpus else "none"
    if nvml:  # NVML is the driver's own reading: it wins where both answer
        gpus = [GPU(index=g["index"], name=g["name"], memory_bytes=g["memory_bytes"],
                    pci_bus_id=g.get("pci_bus_id", "")) for g in nvml]
        source = "nvml"
    topo_text = reader.command(NVIDIA_SMI_TOPO) if gpus else None
    topology, topo_source = (parse_topology(topo_text), "nvidia-smi") if topo_text else ((), "none")
    if not topology and nvml:
        topology = tuple(tuple(g["topology"]) for g in nvml)
        topo_source = "nvml"
    if len(topology) != len(gpus):
        topology, topo_source = (), "none"
    ports, port_source = read_ports(reader)
    env = reader.environ()
    disk = reader.disk(disk_path)
    return Machine(
        gpus=tuple(gpus), gpu_source=source, driver=driver, topology=topology, topology_source=topo_source,
        ports=tuple(ports), ports_source=port_source, interfaces=tuple(read_interfaces(reader)),
        nccl_env={k: env[k] for k in NCCL_KEYS if k in env}, host_memory_bytes=host_memory(reader),
        disk_path=disk_path, disk_total_bytes=disk[0] if disk else None, disk_free_bytes=disk[1] if disk else None,
        cpus=reader.cpus(), cpu_flags=cpu_flags(reader), versions=reader.versions())
