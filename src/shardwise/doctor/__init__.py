"""`shardwise doctor`: read this machine, name what will hurt a multi-GPU run, and write the
hardware spec `plan --hardware` and the trainer's preflight (`hardware.machine`) use.

readers.py  the one reading interface (SystemReader; FakeReader replays captured outputs)
probe.py    readings parsed into a Machine (GPUs, topology, IB/RoCE ports, NICs, NCCL env, host)
derive.py   Machine -> MachineHardware (specs/machine.py): the catalog's GPU and link names
checks.py   what will hurt, in numbers (mixed GPUs, topology, NCCL settings, host, versions)
setup.py    known silent failures of a training setup (FSDP2/ZeRO-3 + QLoRA storage, ZeRO++ hpZ)

Torch-free: versions come from package metadata, GPUs from NVML (pynvml) or nvidia-smi.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardwise.doctor.checks import Finding, machine_findings
from shardwise.doctor.derive import hardware_spec
from shardwise.doctor.probe import Machine, read_machine
from shardwise.doctor.readers import FakeReader, Reader, SystemReader
from shardwise.doctor.setup import Setup, silent_failures
from shardwise.specs.machine import MachineHardware

__all__ = ["FakeReader", "Reader", "Report", "Setup", "SystemReader", "diagnose", "machine_hardware"]
GIB = 2**30


@dataclass(frozen=True)
class Report:
    machine: Machine
    hardware: MachineHardware
    findings: list[Finding]
    setup: Setup | None = None
    setup_findings: list[Finding] = field(default_factory=list)

    @property
    def worst(self) -> str:
        levels = [f.level for f in self.findings + self.setup_findings]
        return "error" if "error" in levels else "warning" if "warning" in levels else "ok"

    def as_dict(self) -> dict[str, Any]:
        m = self.machine
        return {
            "hardware_spec": self.hardware.model_dump(mode="json"),
            "gpus": [g.model_dump() for g in m.gpus], "gpu_source": m.gpu_source, "driver": m.driver,
            "topology": [list(r) for r in m.topology], "topology_source": m.topology_source,
            "ports": [p.model_dump() for p in m.ports], "ports_source": m.ports_source,
            "interfaces": [i.model_dump() for i in m.interfaces], "nccl_env": dict(m.nccl_env),
            "host_memory_bytes": m.host_memory_bytes, "disk": {"path": m.disk_path, "total_bytes": m.disk_total_bytes,
                                                               "free_bytes": m.disk_free_bytes},
            "cpus": m.cpus, "versions": dict(m.versions),
            "warnings": [f.as_dict() for f in self.findings],
            "setup": None if self.setup is None else {"source": self.setup.source, "engine": self.setup.engine,
                                                      "zero_stage": self.setup.zero_stage,
                                                      "four_bit": self.setup.four_bit,
                                                      "quant_storage": self.setup.quant_storage,
                                                      "hpz_partition_size": self.setup.hpz_partition_size,
                                                      "keys_read": list(self.setup.keys_read)},
            "silent_failures": [f.as_dict() for f in self.setup_findings],
            "status": self.worst,
        }

    def text(self) -> str:
        m, h = self.machine, self.hardware
        lines = []
        if m.gpus:
            counts: dict[str, int] = {}
            for g in m.gpus:
                counts[g.name] = counts.get(g.name, 0) + 1
            lines.append("GPUs: " + ", ".join(f"{n}× {name} ({next(g.memory_bytes for g in m.gpus if g.name == name) / GIB:.1f} GiB)"
                                              for name, n in counts.items())
                         + f" [{m.gpu_source}; driver {m.driver or '?'}]")
            if m.topology:
                lines.append(f"Topology ({'nvidia-smi topo -m' if m.topology_source == 'nvidia-smi' else 'NVML'}): "
                             + " | ".join(
                    f"GPU{i}: " + " ".join(r) for i, r in enumerate(m.topology)))
        else:
            lines.append("GPUs: none found")
        ports = ", ".join(f"{p.device}/{p.port} {p.link_layer} {p.state} {p.rate_gbps or '?'} Gb/s" for p in m.ports)
        nets = ", ".join(f"{i.name} {i.speed_mbps / 1000:g} Gb/s" for i in m.interfaces if i.up and i.speed_mbps)
        lines.append(f"Network: {ports or 'no InfiniBand/RoCE port'}; {nets or 'no Ethernet speed read'}")
        lines.append("NCCL: " + (" ".join(f"{k}={v}" for k, v in m.nccl_env.items()) or "no NCCL_* settings"))
        host = f"{m.host_memory_bytes / GIB:.0f} GiB RAM" if m.host_memory_bytes else "RAM unread"
        disk = f", {m.disk_free_bytes / GIB:.0f} GiB free on {m.disk_path}" if m.disk_free_bytes is not None else ""
        lines.append(f"Host: {m.cpus} CPUs, {host}{disk}")
        lines.append("Versions: " + ", ".join(f"{k} {v or 'none'}" for k, v in m.versions.items()))
        spec = (f"gpu {h.gpu}, {h.gpus_per_node} per node, intra {h.intra}, inter {h.inter}, nics {h.nics_per_node}"
                if h.gpu else "no catalog GPU: nothing for plan --hardware")
        lines.append(f"Hardware spec: {spec}")
        lines += [f"  note: {n}" for n in h.notes]
        for f in self.findings:
            lines.append(f"{f.level}: {f.message}")
        if self.setup is not None:
            lines.append(f"Setup ({self.setup.source}; read {', '.join(self.setup.keys_read) or 'nothing'}): "
                         + ("no known silent failure" if not self.setup_findings else ""))
            lines += [f"{f.level}: {f.message}" for f in self.setup_findings]
        return "\n".join(lines)


def diagnose(reader: Reader, setup: Setup | None = None, disk_path: str = ".") -> Report:
    machine = read_machine(reader, disk_path)
    hw = hardware_spec(machine)
    found = machine_findings(machine, hw)
    silent = silent_failures(setup, machine.versions.get("deepspeed")) if setup is not None else []
    return Report(machine, hw, found, setup, silent)


def machine_hardware(reader: Reader | None = None) -> MachineHardware:
    """`plan --hardware auto`: this machine's hardware spec, read now."""
    return hardware_spec(read_machine(reader or SystemReader()))
