"""Host memory while a rank reads the checkpoint (the load phase): pure functions, no torch.

The trainer's paths (shardwise.train.weights):
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

from shardwise.plan.breakdown import LoadBreakdown
from shardwise.plan.lora import trainable_params
from shardwise.plan.stage import stage_params, vocab_shards
from shardwise.specs.hardware import GIB
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec

LoadPath = Literal["sharded", "broadcast", "zero3", "whole"]

# Host RSS of one rank before it builds anything, by how it started and its engine:
# - exec'd (CUDA ranks; CPU ranks under torchrun or SHARDWISE_RANK_START=exec): measured, VmRSS
#   of a fresh interpreter once it imported what a rank imports (torch 2.13.0 CPU build,
#   transformers, peft, shardwise's trainer; deepspeed 0.19.8 besides for the DeepSpeed engine):
#   479 MB and 602 MB (benchmarks/results/host_memory.json "baseline", this project's 2-core CI
#   machine);
# - forked (CPU ranks of `shardwise train`: shardwise.train.rank_fork): measured, VmRSS of a rank
#   forked from a launcher that imported the same, right after the fork: 376 MB and 462 MB
#   (host_memory.json "baseline" "forked"). Its anonymous pages, shared with the launcher until
#   written, count in its RSS; the libraries' file pages only as it touches them;
# - cuda: assumed, not measured here: the CUDA runtime, cuBLAS/cuDNN and NCCL mapped into the
#   process add about 1 GiB of host memory to the CPU figure (set hardware.host_memory_gb with margin).
PROCESS_BYTES = {("exec", "torch"): 479_137_792.0, ("exec", "deepspeed"): 602_476_544.0,
                 ("fork", "torch"): 376_410_112.0, ("fork", "deepspeed"): 461_766_656.0}
CUDA_RUNTIME_BYTES = 1.0 * GIB
# The launcher (`shardwise train`: it checks the run, starts the ranks and watches them), one per
# node: its peak RSS while its 2 ranks trained, the largest over benchmarks/host_memory.py's cases
# (612 MB: a LoRA run under DeepSpeed, whose launcher imported peft and DeepSpeed for the ranks it
# forks; 410 MB for the demo under FSDP2; host_memory.json "launcher_peak_rss").
LAUNCHER_BYTES = 611_577_856.0


def process_bytes(device: str, engine: str, forked: bool = False) -> float:
    """A rank's interpreter and libraries on `device` ("cpu" | "cuda") for `engine` (the
    strategy's: "deepspeed", "fsdp2", "ddp", ...), `forked` from its launcher or exec'd."""
    base = PROCESS_BYTES[("fork" if forked else "exec", "deepspeed" if engine == "deepspeed" else "torch")]
    return base + (CUDA_RUNTIME_BYTES if device != "cpu" else 0.0)


def forked_ranks(device: str, ranks_per_node: int) -> bool:
    """Whether `shardwise train` forks the ranks of a node from its launcher: on CPU, when it
    starts more than one (shardwise.train.rank_fork, which also says when it falls back to exec)."""
    return device == "cpu" and ranks_per_node > 1


# The safetensors file size the planner assumes when it has no checkpoint to read sizes from:
# Hugging Face's `save_pretrained(max_shard_size="5GB")`, the size of most Hub checkpoints'
# shards (transformers' default in the 4.x releases that wrote them).
DEFAULT_FILE_BYTES = 5e9
ZERO3_CHUNK_BYTES = float(1 << 28)  # the trainer's chunk (shardwise.train.weights reads it from here)


def load_path(strategy: Strategy, weights: str | None = "safetensors") -> LoadPath:
    """The trainer's path for `weights` ("safetensors", "bin", or None: built from the config)."""
    if weights is None:
        return "whole"
    if strategy.engine == "deepspeed" and (strategy.zero_stage or 0) == 3:
        return "zero3"
    return "sharded" if weights == "safetensors" else "broadcast"


def model_bytes(model: ModelSpec, train: TrainSpec, tp: int = 1, pp: int = 1,
                vocab_tp: int | None = None) -> tuple[float, float]:
    """(trainable, frozen) bytes of the model as the trainer builds it before the engine casts:
    trainable parameters in fp32, a LoRA base in the compute dtype."""
    psi = stage_params(model, tp, pp, vocab_tp)
    if not train.lora_rank:
        return 4 * psi, 0.0
    adapters = trainable_params(model, train, tp, pp)
    return 4 * adapters, train.compute_bytes * psi


def load_phase(model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
               ranks_per_node: int, device: str = "cuda", path: LoadPath | None = None,
               max_file_bytes: float = DEFAULT_FILE_BYTES, forked: bool | None = None) -> LoadBreakdown:
    """The load phase of one rank (the fullest: rank 0 under ZeRO-3) for `path` (default: the
    safetensors path `strategy` takes). `max_file_bytes`: the checkpoint's largest file.
    `forked`: the ranks are forked from their launcher (None: as `shardwise train` starts them,
    `forked_ranks`)."""
    path = path or load_path(strategy)
    vocab_tp = vocab_shards(strategy, layout.tp)
    trainable, frozen = model_bytes(model, train, layout.tp, layout.pp, vocab_tp)
    n = layout.dp_shard if strategy.shards_params else 1
    on_host = device == "cpu" or strategy.offload_params
    largest = max((size for size, _ in model.tensor_sizes()), default=0) / layout.tp
    stored = 2.0  # bytes per element in the files: bf16/fp16 checkpoints (an fp32 one doubles `read`)
    forked = forked_ranks(device, ranks_per_node) if forked is None else forked
    process = process_bytes(device, strategy.engine, forked)
    if path == "whole":
        # the whole model in fp32 on the host, a LoRA base too (on every device: the engine moves
        # it afterwards)
        whole = 4 * stage_params(model, layout.tp, layout.pp, vocab_tp)
        return LoadBreakdown("whole", resident=whole, read=max_file_bytes, process=process,
                             ranks_per_node=ranks_per_node)
    if path == "zero3":
        ds_bytes = train.compute_bytes  # zero.Init builds in DeepSpeed's dtype
        part = ds_bytes * stage_params(model, layout.tp, layout.pp, vocab_tp) / layout.dp_shard
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

