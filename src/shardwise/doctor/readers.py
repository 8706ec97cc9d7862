"""What `shardwise doctor` reads from the machine, behind one small interface (`Reader`), so
tests replay captured outputs (`FakeReader`) and nothing else touches the system.

`SystemReader` runs the vendor tools (`nvidia-smi`, `ibv_devinfo`) with a timeout and reads
`/proc`, `/sys` and the environment; NVML through pynvml when it can be imported (no CUDA
context is created, no torch is imported). Every reading is text or plain data: parsing is
`shardwise.doctor.probe`'s, the same for real and fake readings.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# What the doctor asks nvidia-smi for (`--query-gpu=... --format=csv,noheader,nounits`)
GPU_QUERY = ("index", "name", "memory.total", "pci.bus_id", "driver_version", "uuid")
NVIDIA_SMI_GPUS = ("nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits")
NVIDIA_SMI_TOPO = ("nvidia-smi", "topo", "-m")
IBV_DEVINFO = ("ibv_devinfo",)
TIMEOUT_S = 20


class Reader(Protocol):
    """The machine as the doctor sees it."""

    def command(self, argv: tuple[str, ...]) -> str | None:
        """A tool's stdout, or None when the tool is absent or fails."""

    def file(self, path: str) -> str | None:
        """A text file, or None when it cannot be read."""

    def listdir(self, path: str) -> list[str]:
        """A directory's entries (sorted), [] when absent."""

    def environ(self) -> Mapping[str, str]: ...

    def disk(self, path: str) -> tuple[int, int] | None:
        """(total, free) bytes of the filesystem holding `path`."""

    def cpus(self) -> int: ...

    def nvml(self) -> list[dict[str, Any]] | None:
        """Per GPU (NVML order): name, memory_bytes, pci_bus_id, nvlinks (active NVLink count) and
        topology (NVML's common-ancestor level to each other GPU: nv, pix, pxb, phb, node, sys);
        None without pynvml or an NVML driver."""

    def versions(self) -> dict[str, str | None]:
        """Installed versions (shardwise.versions, torch-free) and torch's CUDA build."""


class SystemReader:
    """This machine."""

    def command(self, argv: tuple[str, ...]) -> str | None:
        if shutil.which(argv[0]) is None:
            return None
        try:
            r = subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    def file(self, path: str) -> str | None:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read(1 << 20)
        except OSError:
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    def environ(self) -> Mapping[str, str]:
        return dict(os.environ)

    def disk(self, path: str) -> tuple[int, int] | None:
        try:
            u = shutil.disk_usage(path)
        except OSError:
            return None
        return u.total, u.free

    def cpus(self) -> int:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def nvml(self) -> list[dict[str, Any]] | None:
        try:
            import pynvml  # nvidia-ml-py: the driver's own library, no CUDA context
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except Exception:  # NVMLError subclasses: no driver, no GPU
            return None
        try:
            return _nvml_readings(pynvml)
        except Exception:  # a partial NVML: fall back to nvidia-smi
            return None
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass

    def versions(self) -> dict[str, str | None]:
        return installed_versions()


_NVML_LEVELS = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"}
# NVML's common-ancestor levels as nvidia-smi topo -m names them
_LEVEL_TO_TOPO = {"internal": "X", "single": "PIX", "multiple": "PXB", "hostbridge": "PHB", "node": "NODE",
                  "system": "SYS"}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_readings(pynvml: Any) -> list[dict[str, Any]]:
    """Each GPU's reading; a pair is NV when one's active NVLink ends at the other's PCI bus, or
    both have links ending at something that is not a GPU (an NVSwitch): what `nvidia-smi topo
    -m` calls NV#. Other pairs: NVML's common ancestor (PIX ... SYS)."""
    n = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    buses = [_text(pynvml.nvmlDeviceGetPciInfo(h).busId).upper() for h in handles]
    remotes: list[set[str]] = []
    links: list[int] = []
    for h in handles:
        ends, active = set(), 0
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                active += 1
                ends.add(_text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).upper())
            except Exception:  # NVMLError: no such link / not supported
                break
        remotes.append(ends)
        links.append(active)
    switched = [bool(ends - set(buses)) for ends in remotes]
    out = []
    for i, h in enumerate(handles):
        topo = []
        for j, other in enumerate(handles):
            if i == j:
                topo.append("X")
            elif buses[j] in remotes[i] or buses[i] in remotes[j] or (switched[i] and switched[j]):
                topo.append("NV")
            else:
                level = int(pynvml.nvmlDeviceGetTopologyCommonAncestor(h, other))
                topo.append(_LEVEL_TO_TOPO[_NVML_LEVELS.get(level, "system")])
        out.append({"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)),
                    "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total), "pci_bus_id": buses[i],
                    "nvlinks": links[i], "topology": topo})
    return out


def installed_versions() -> dict[str, str | None]:
    """shardwise.versions' packages from their metadata, Python, NCCL's wheel, and torch's CUDA
    build read from torch/version.py as text (importing torch takes seconds and is not needed)."""
    import platform
    from importlib.util import find_spec

    from shardwise.versions import LIBRARIES, package_versions

    out: dict[str, str | None] = {"python": platform.python_version()} | package_versions(LIBRARIES)
    nccl = package_versions(("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11"))
    out["nccl"] = next((v for v in nccl.values() if v), None)
    out["torch cuda"] = None
    try:
        spec = find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        text = SystemReader().file(os.path.join(os.path.dirname(spec.origin), "version.py")) or ""
        for line in text.splitlines():
            if line.startswith("cuda"):
                value = line.partition("=")[2].strip().strip("'\"")
                out["torch cuda"] = None if value in ("", "None") else value
    return out


@dataclass
class FakeReader:
    """Captured readings (tests): commands by argv, files and directories by path."""

    commands: dict[tuple[str, ...], str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    dirs: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    disk_bytes: tuple[int, int] | None = None
    cpu_count: int = 16
    nvml_readings: list[dict[str, Any]] | None = None
    installed: dict[str, str | None] = field(default_factory=dict)

    def command(self, argv: tuple[str, ...]) -> str | None:
        return self.commands.get(tuple(argv))

    def file(self, path: str) -> str | None:
        return self.files.get(path)

    def listdir(self, path: str) -> list[str]:
        return sorted(self.dirs.get(path, []))

    def environ(self) -> Mapping[str, str]:
        return self.env

    def disk(self, path: str) -> tuple[int, int] | None:
        return self.disk_bytes

    def cpus(self) -> int:
        return self.cpu_count

    def nvml(self) -> list[dict[str, Any]] | None:
        return self.nvml_readings

    def versions(self) -> dict[str, str | None]:
        return self.installed
