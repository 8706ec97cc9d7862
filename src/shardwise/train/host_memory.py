"""Host memory before any rank starts: the load phase (and offloaded states) this node's ranks
will hold, against what the node has (`hardware.host_memory_gb`, else MemAvailable of
/proc/meminfo on the launching node). Torch-free."""

from __future__ import annotations

from pathlib import Path

from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec
from shardwise.specs.hardware import GIB

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


def host_available(run: RunSpec) -> tuple[float, str] | None:
    """(bytes, where the figure comes from), or None when nothing says."""
    gb = run.config.hardware.host_memory_gb
    if gb is not None:
        return gb * 1e9, f"{run.config.source}: hardware.host_memory_gb"
    info = read_meminfo()
    if "MemAvailable" in info:
        return float(info["MemAvailable"]), f"MemAvailable in {MEMINFO}"
    return None


def check_host_memory(run: RunSpec, force: bool = False) -> None:
    """Refuse, with the numbers, a run whose ranks on this node cannot hold the weights while they
    load (shardwise.plan.load) or the states a CUDA run offloads to the host while it trains."""
    from shardwise.train.weights import planned_load

    have = host_available(run)
    if have is None or force:
        return
    available, source = have
    load = planned_load(run)
    offload = 0.0
    if run.device == "cuda":
        from shardwise.plan.evaluate import memory_as_run

        offload = memory_as_run(run.model, run.hardware, run.train, run.strategy).host.total
    training = offload + load.process * load.ranks_per_node
    need = max(load.per_node, training)
    if need <= available:
        return
    cfg = run.config
    if load.per_node >= training:
        what = (f"loading the weights ({load.path} read) needs {load.per_rank / GIB:.2f} GiB per rank × "
                f"{load.ranks_per_node} ranks = {load.per_node / GIB:.2f} GiB (the rank's part "
                f"{load.resident / GIB:.2f}, reads in flight {load.read / GIB:.2f}, process {load.process / GIB:.2f})")
    else:
        what = f"the offloaded training states need {training / GIB:.2f} GiB per node"
    raise ShardwiseError(
        f"{cfg.source}: predicted to run out of host memory: strategy {run.strategy.name!r}: {what}, against "
        f"{available / GIB:.2f} GiB ({source}). Use a strategy that shards the parameters (fsdp, zero3), fewer ranks "
        "per node, a checkpoint in safetensors, or set hardware.host_memory_gb if the figure is wrong; --force runs anyway.")
