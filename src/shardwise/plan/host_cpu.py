"""Host memory of a CPU run, per rank and per node: pure functions, no torch.

On CPU the tensors a GPU plan books (shardwise.plan.memory: model states, gathered parameters,
activations, the step's buffers) live in the rank's own memory, beside the interpreter and its
libraries. A rank's resident set at its peak is therefore

    process (the interpreter, torch and the engine's libraries: measured per engine, and per
             start: a rank forked from its launcher holds less of them than an exec'd one)
  + the step's allocated peak (the GPU plan's `allocated`, the same terms by phase)
  + heap slack (glibc keeps freed blocks below the mmap threshold in its heap)

or, before the first step, the load phase (shardwise.plan.load), whichever is larger. A node
also holds the launcher (`shardwise train`, which spawns and watches the ranks). The process,
heap and launcher figures are the memory model's (catalog/memory.yaml, with their provenance).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.catalog import memory_model
from shardwise.plan.breakdown import LoadBreakdown
from shardwise.plan.load import load_path, load_phase
from shardwise.plan.recompute import RecomputeChoice
from shardwise.specs.hardware import GIB, HardwareSpec
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec


@dataclass(frozen=True, slots=True)
class CpuRankMemory:
    """Bytes of one rank of a CPU run, by term; `peak` is its resident set at its peak."""

    process: float
    allocated: float  # the step's allocated peak (MemoryBreakdown.allocated)
    heap_slack: float
    load: LoadBreakdown
    launcher: float  # the launcher's RSS, one per node
    ranks_per_node: int = 1

    @property
    def training(self) -> float:
        return self.process + self.allocated + self.heap_slack

    @property
    def peak(self) -> float:
        return max(self.training, self.load.per_rank)

    @property
    def phase(self) -> str:
        return "training" if self.training >= self.load.per_rank else "loading the weights"

    @property
    def per_node(self) -> float:
        """Every rank of the node at its peak (they peak together: they run in lockstep), and the
        launcher."""
        return self.peak * self.ranks_per_node + self.launcher

    def as_dict(self) -> dict[str, float | str | dict]:
        return {"process": self.process, "allocated": self.allocated, "heap_slack": self.heap_slack,
                "training": self.training, "load": self.load.as_dict(), "peak": self.peak, "phase": self.phase, "ranks_per_node": self.ranks_per_node,
                "launcher": self.launcher, "per_node": self.per_node}


def cpu_rank_memory(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
                    weights: str | None = None, max_file_bytes: float = 0.0,
                    forked: bool | None = None) -> CpuRankMemory:
    """One rank of a CPU run of `strategy`: the engine it runs as (shardwise.plan.evaluate
    memory_as_run) and its load phase from a checkpoint of `weights` ("safetensors", "bin", or
    None: built from the config) whose largest file is `max_file_bytes`. `forked`: the rank was
    forked from its launcher (None: as `shardwise train` starts it, shardwise.plan.load.forked_ranks)."""
    from shardwise.plan.evaluate import memory_as_run

    plan = memory_as_run(model, hw, train, strategy)
    runs = plan.engine_strategy
    per_node = max(1, min(hw.world_size, hw.gpus_per_node))
    load = load_phase(model, train, runs, plan.layout, per_node, device="cpu", path=load_path(runs, weights),
                      max_file_bytes=max_file_bytes, forked=forked)
    # activation offloading on CPU ranks copies the saved tensors into the same memory: they stay
    moved = plan.host.activations / per_node
    return CpuRankMemory(process=load.process, allocated=plan.gpu.allocated + moved,
                         heap_slack=heap_slack(model, train, plan, moved),
                         load=load, launcher=memory_model().launcher_bytes, ranks_per_node=per_node)


def heap_slack(model: ModelSpec, train: TrainSpec, plan, offloaded: float = 0.0) -> float:
    """The heap's floor, and the activations saved for backward where a layer's hidden states
    (one micro-batch's tokens × hidden × the compute dtype) are below the mmap threshold the
    trainer holds: they were allocated from the heap and stay in it, free, after backward.
    autocast's copies of the weights (DDP's fp32 module) are weight-sized and mapped: not heap.
    `offloaded`: the saved bytes activation offloading copied out of `plan.gpu.activations` (on a
    CPU rank, into the same heap). Floor and threshold: the memory model's `heap_floor_bytes`,
    `mmap_threshold_bytes`."""
    from shardwise.plan.memory import autocast_cache
    from shardwise.plan.stage import whole_model

    mm = memory_model()
    train = train.as_sequences()  # a forward's batch: 2 sequences per example for the paired objectives
    row = train.seq_len * train.micro_batch * model.hidden_size / plan.layout.tp * train.compute_bytes
    if row >= mm.mmap_threshold_bytes:
        return mm.heap_floor_bytes
    acts = plan.gpu.activations + offloaded
    # one micro-batch's casts; under pipeline parallelism the other micro-batches in flight hold
    # theirs too, left in here (an overestimate of the heap: autocast runs there only with TP alone)
    if train.autocasts(plan.engine_strategy.engine):
        rank = plan.rank or whole_model(model, plan.layout, None)
        acts -= autocast_cache(model, train, plan.layout.tp, rank.layers, rank.head)[0]
    return mm.heap_floor_bytes + max(0.0, acts)


def cpu_checkpointing_choice(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
                             available: float | None, forked: bool | None = None) -> RecomputeChoice | None:
    """What `checkpointing: auto` runs on CPU ranks (plan/recompute.py): none where the node's
    ranks training without recomputation (`CpuRankMemory.training` × ranks + the launcher; the
    load phase does not depend on it) fit in `available` bytes of host memory, else full; none
    where the node's memory is unknown. None where `train` sets it."""
    if train.checkpointing != "auto":
        return None
    bare = cpu_rank_memory(model, hw, train.model_copy(update={"checkpointing": "none"}), strategy, forked=forked)
    need = bare.training * bare.ranks_per_node + bare.launcher
    if available is None:
        return RecomputeChoice("none", strategy.name, f"{need / GIB:.2f}", "an unknown amount of host memory per node")
    return RecomputeChoice("none" if need <= available else "full", strategy.name, f"{need / GIB:.2f}",
                           f"{available / GIB:.2f} per node (host memory)")
