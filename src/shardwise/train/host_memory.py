"""Host memory before any rank starts: what this node's ranks will hold (on CPU their whole peak;
on CUDA the load phase and offloaded states), against what the node has
(`hardware.host_memory_gb`, else MemAvailable of /proc/meminfo on the launching node:
shardwise.run.host). Torch-free."""

from __future__ import annotations

from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec
from shardwise.run.host import node_memory
from shardwise.specs.hardware import GIB


def host_available(run: RunSpec) -> tuple[float, str] | None:
    """(bytes, where the figure comes from), or None when nothing says."""
    return node_memory(run.config.hardware.host_memory_gb, f"{run.config.source}: hardware.host_memory_gb")


def planned_cpu(run: RunSpec):
    """The planner's host memory of one rank of this CPU run (shardwise.plan.host_cpu), its load
    phase read off the checkpoint's own files."""
    from shardwise.plan.host_cpu import cpu_rank_memory
    from shardwise.train.launch.fork import planned_forked
    from shardwise.train.model.weights import run_weights

    return cpu_rank_memory(run.model, run.hardware, run.train, run.strategy, *run_weights(run),
                           forked=planned_forked())


def check_host_memory(run: RunSpec, force: bool = False) -> None:
    """Refuse, with the numbers, a run whose ranks on this node cannot hold what they will: on CPU
    each rank's whole peak (shardwise.plan.host_cpu: the process, the step's tensors, the load);
    on CUDA the weights while they load (shardwise.plan.load) or the states offloaded to the host."""
    have = host_available(run)
    if have is None or force:
        return
    available, source = have
    what = _cpu_shortfall(run, available) if run.device == "cpu" else _cuda_shortfall(run, available)
    if what is None:
        return
    raise ShardwiseError(
        f"{run.config.source}: predicted to run out of host memory: strategy {run.strategy.name!r}: {what}, against "
        f"{available / GIB:.2f} GiB ({source}). Use a strategy that shards the parameters (fsdp, zero3), fewer ranks "
        "per node, a checkpoint in safetensors, or set hardware.host_memory_gb if the figure is wrong; --force runs anyway.")


def _cpu_shortfall(run: RunSpec, available: float) -> str | None:
    p = planned_cpu(run)
    if p.per_node <= available:
        return None
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    if p.phase == "training":
        part = f"process {g(p.process)}, the step's tensors {g(p.allocated)}, heap slack {g(p.heap_slack)}"
    else:
        load = p.load
        part = (f"{load.path} read: the rank's part {g(load.resident)}, reads in flight {g(load.read)}, "
                f"process {g(load.process)}")
    return (f"each rank peaks at {g(p.peak)} GiB {'training' if p.phase == 'training' else 'while loading the weights'}"
            f" ({part}) × {p.ranks_per_node} ranks + the launcher {g(p.launcher)} = {g(p.per_node)} GiB")


def _cuda_shortfall(run: RunSpec, available: float) -> str | None:
    from shardwise.plan.evaluate import memory_as_run
    from shardwise.train.model.weights import planned_load

    load = planned_load(run)
    offload = memory_as_run(run.model, run.hardware, run.train, run.strategy).host.total
    training = offload + load.process * load.ranks_per_node
    if max(load.per_node, training) <= available:
        return None
    if load.per_node >= training:
        return (f"loading the weights ({load.path} read) needs {load.per_rank / GIB:.2f} GiB per rank × "
                f"{load.ranks_per_node} ranks = {load.per_node / GIB:.2f} GiB (the rank's part "
                f"{load.resident / GIB:.2f}, reads in flight {load.read / GIB:.2f}, process {load.process / GIB:.2f})")
    return f"the offloaded training states need {training / GIB:.2f} GiB per node"
