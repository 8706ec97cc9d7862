"""The host memory of the node a run starts on: `hardware.host_memory_gb` (`plan --host-memory-gb`)
where given, else MemAvailable of /proc/meminfo. The trainer's host-memory check
(shardwise.train.host_memory), `checkpointing: auto` on CPU (shardwise.run.bridge) and
`plan --device cpu` read it here. Torch-free."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def read_meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """/proc/meminfo as bytes per field (empty where the file is missing: not Linux)."""
    out: dict[str, int] = {}
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name.strip()] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return out


def node_memory(gb: float | None, given_by: str) -> tuple[float, str] | None:
    """`gb` GB where given (`given_by` names where), else MemAvailable of /proc/meminfo, else None."""
    if gb is not None:
        return gb * 1e9, given_by
    info = read_meminfo()
    if "MemAvailable" in info:
        return float(info["MemAvailable"]), f"MemAvailable in {MEMINFO}"
    return None
