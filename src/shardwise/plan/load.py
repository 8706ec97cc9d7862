"""Host memory while a rank reads the checkpoint (the load phase): pure functions, no torch.

The trainer's paths (shardwise.train.model.weights):
- "sharded" (safetensors; DDP, ZeRO-0/1/2, FSDP2): the model is built on the meta device and
  each rank's part is read straight into the device it trains on. What stays on the host is that
  part only where the host is where it lives (a CPU run; FSDP2's CPUOffloadPolicy). In flight:
  the pages of one safetensors file the rank reads (the reader maps a file and reads every
  tensor it needs from it before the next; an FSDP2 rank reads its 1/N rows of each tensor).
- "zero3" (safetensors; DeepSpeed ZeRO-3): partitions built inside `deepspeed.zero.Init`, filled
  by chunks gathered on every rank (train.weights.ZERO3_CHUNK_BYTES, overrun by at most one
  tensor), rank 0 copying one tensor at a time from the files into the chunk: the chunk is on the
  host on a CPU run; rank 0 holds one tensor read and its mapped pages.
- "broadcast" (`.bin`; DDP, ZeRO-0/1/2, FSDP2): as "sharded", but rank 0 reads each tensor (one
  file mapped at a time) and broadcasts it; every rank keeps its part.
- "whole" (`model.random_init`, catalog models): `from_config` builds the whole model in fp32 on
  every rank's host, then the engine moves it.

Every rank also holds the interpreter and its libraries (`process_bytes`): less of them when it
was forked from its launcher (`forked_ranks`).
"""

from __future__ import annotations

from typing import Literal

from shardwise.catalog import memory_model
from shardwise.plan.breakdown import LoadBreakdown
from shardwise.plan.lora import trainable_params
from shardwise.plan.stage import stage_params, vocab_shards
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec

LoadPath = Literal["sharded", "broadcast", "zero3", "whole"]


def process_bytes(device: str, engine: str, forked: bool = False) -> float:
    """A rank's interpreter and libraries on `device` ("cpu" | "cuda") for `engine` (the
    strategy's: "deepspeed", "fsdp2", "ddp", ...), `forked` from its launcher or exec'd: the
    memory model's figures (catalog/memory.yaml: measured on CPU; what CUDA adds, assumed)."""
    mm = memory_model()
    base = mm.process_bytes("fork" if forked else "exec", "deepspeed" if engine == "deepspeed" else "torch")
    return base + (mm.cuda_runtime_bytes if device != "cpu" else 0.0)


def forked_ranks(device: str, ranks_per_node: int) -> bool:
    """Whether `shardwise train` forks the ranks of a node from its launcher: on CPU, when it
    starts more than one (shardwise.train.launch.fork, which also says when it falls back to exec)."""
    return device == "cpu" and ranks_per_node > 1


ZERO3_CHUNK_BYTES = float(1 << 28)  # the trainer's chunk (shardwise.train.model.weights reads it from here)


def load_path(strategy: Strategy, weights: str | None = "safetensors") -> LoadPath:
    """The trainer's path for `weights` ("safetensors", "bin", or None: built from the config)."""
    if weights is None:
        return "whole"
    if strategy.engine == "deepspeed" and (strategy.zero_stage or 0) == 3:
        return "zero3"
    return "sharded" if weights == "safetensors" else "broadcast"


def model_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1, pp: int = 1,
                vocab_tp: int | None = None, virtual: int = 1) -> tuple[float, float]:
    """(trainable, frozen) bytes of the model as the trainer builds it before the engine casts
    (the fullest pipeline rank's part): trainable parameters in fp32, a LoRA base in the compute
    dtype."""
    psi = stage_params(model, tp, pp, vocab_tp, virtual)
    if not train.lora_rank:
        return 4 * psi, 0.0
    adapters = trainable_params(model, train, tp, pp, virtual)
    return 4 * adapters, train.compute_bytes * psi


def load_phase(model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
               ranks_per_node: int, device: str = "cuda", path: LoadPath | None = None,
               max_file_bytes: float | None = None, forked: bool | None = None) -> LoadBreakdown:
    """The load phase of one rank (the fullest: rank 0 under ZeRO-3) for `path` (default: the
    safetensors path `strategy` takes). `max_file_bytes`: the checkpoint's largest file (None:
    the memory model's `default_file_bytes`, a Hub checkpoint's shard). `forked`: the ranks are forked from their launcher (None: as `shardwise train` starts them,
    `forked_ranks`)."""
    path = path or load_path(strategy)
    vocab_tp = vocab_shards(strategy, layout.tp)
    virtual = strategy.pp_virtual_stages if layout.pp > 1 else 1
    trainable, frozen = model_bytes(model, train, layout.tp, layout.pp, vocab_tp, virtual)
    n = layout.dp_shard if strategy.shards_params else 1
    on_host = device == "cpu" or strategy.offload_params
    largest = max((size for size, _ in model.tensor_sizes()), default=0) / layout.tp
    mm = memory_model()
    if max_file_bytes is None:
        max_file_bytes = mm.default_file_bytes
    stored = mm.checkpoint_element_bytes  # bytes per element in the files
    forked = forked_ranks(device, ranks_per_node) if forked is None else forked
    process = process_bytes(device, strategy.engine, forked)
    if path == "whole":
        # the whole model in fp32 on the host, a LoRA base too (on every device: the engine moves
        # it afterwards)
        whole = 4 * stage_params(model, layout.tp, layout.pp, vocab_tp, virtual)
        return LoadBreakdown("whole", resident=whole, read=max_file_bytes, process=process,
                             ranks_per_node=ranks_per_node)
    if path == "zero3":
        ds_bytes = train.compute_bytes  # zero.Init builds in DeepSpeed's dtype
        part = ds_bytes * stage_params(model, layout.tp, layout.pp, vocab_tp, virtual) / layout.dp_shard
        chunk = ZERO3_CHUNK_BYTES + ds_bytes * largest  # the chunk may overrun by one tensor
        # rank 0 reads one tensor at a time into the gathered chunk: its copy and its mapped pages
        read = 2 * stored * largest
        return LoadBreakdown("zero3", resident=(part + chunk) if on_host else 0.0, read=read, process=process,
                             ranks_per_node=ranks_per_node)
    resident = (trainable + frozen) / n if on_host else 0.0
    if path == "broadcast":
        # rank 0 maps one .bin file (its pages, as tensors are read) and holds one tensor read; every
        # rank receives each full tensor before it keeps its part (on the host on a CPU run)
        read = max_file_bytes + stored * largest + (4 * largest if on_host else 0.0)
        return LoadBreakdown("broadcast", resident=resident, read=read, process=process, ranks_per_node=ranks_per_node)
    # one file's pages this rank touches (its rows of each tensor), and one tensor slice read
    read = max_file_bytes / n + stored * largest / n
    return LoadBreakdown("sharded", resident=resident, read=read, process=process, ranks_per_node=ranks_per_node)

