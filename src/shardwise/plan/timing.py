"""Step time: compute at an achievable fraction of peak, collectives by ring bus-bandwidth
formulas with latency, what each engine overlaps, offload transfers, CPU optimizer, pipeline
bubble. Pure functions; FLOPs from plan/flops.py (the trainer's MFU uses the same function)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardwise.plan.comm import CommBreakdown
from shardwise.plan.flops import flops_per_token, model_flops_per_token
from shardwise.specs.hardware import HardwareSpec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec

# Fraction of dense peak a well-tuned LLM step sustains on its matmuls (bf16 Llama training
# reports 50–60% MFU on A100/H100: Megatron-LM, torchtitan); fp32 non-tensor-core lower.
ACHIEVABLE = {"bf16": 0.55, "fp16": 0.55, "fp32": 0.45}
# How much of backward compute can hide bucketed reduction / prefetched gathers (streams
# contend for SMs and HBM; NCCL kernels take ~10–20% of SMs).
OVERLAP_EFFICIENCY = 0.8


@dataclass(frozen=True, slots=True)
class TimeBreakdown:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    bubble_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self) | {"exposed_comm_fraction": self.exposed_fraction}


def ring_time(volume: float, n: int, bus_bytes_per_s: float, latency_s: float, calls: int) -> float:
    """nccl-tests bus bandwidth: an all-gather/reduce-scatter of S bytes over n ranks takes
    S·(n−1)/n / B + (n−1)·latency per call; `volume` already counts an all-reduce twice."""
    if n <= 1 or volume <= 0:
        return 0.0
    return volume * (n - 1) / n / bus_bytes_per_s + (n - 1) * latency_s * max(calls, 1)


def comm_time(comm: CommBreakdown, hw: HardwareSpec, layout: ParallelLayout) -> float:
    n_intra = min(layout.world_size, hw.gpus_per_node)
    t = ring_time(comm.intra, n_intra, hw.intra.bus_bytes_per_s, hw.intra.latency_s, comm.calls)
    if comm.inter:
        t += ring_time(comm.inter, max(2, hw.nodes), hw.inter.bus_bytes_per_s, hw.inter.latency_s, comm.calls)
    return t


def step_time(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
              layout: ParallelLayout, comm: CommBreakdown) -> TimeBreakdown:
    tokens = train.micro_batch * train.seq_len * train.grad_accum  # per DP replica per step
    dtype = train.compute_dtype
    peak = hw.gpu.peak_flops(dtype)
    share = layout.tp * layout.pp  # the replica's work is split over its TP × PP GPUs
    flops = flops_per_token(model, train.seq_len, train.checkpointing) * tokens / share
    compute = flops / (peak * ACHIEVABLE[dtype])
    # backward is 2/3 of the model FLOPs, plus the recomputed forward with checkpointing
    fwd = compute * (1 / 4 if train.checkpointing == "full" else 1 / 3)
    bwd = compute - fwd
    comm_s = comm_time(comm, hw, layout)
    exposed = min(comm_s, _exposed(strategy, train, comm_s, fwd, bwd, comm))
    # TP all-reduces (inside the node) and PP sends sit on the critical path
    blocking = 0.0
    if comm.blocking:
        blocking = comm.blocking * (layout.tp - 1) / max(layout.tp, 1) / hw.intra.bus_bytes_per_s
        if layout.pp > 1 and hw.nodes > 1:
            blocking = max(blocking, comm.blocking / hw.inter.bus_bytes_per_s)
        blocking += comm.calls * hw.intra.latency_s
    comm_s += blocking
    exposed += blocking
    offload = _offload_time(model, hw, strategy, layout, comm)
    bubble = 0.0
    if layout.pp > 1:  # 1F1B bubble (p−1)/(m+p−1) of the pipeline's time
        frac = (layout.pp - 1) / (train.grad_accum + layout.pp - 1)
        bubble = compute * frac / (1 - frac)
    step = compute + exposed + offload + bubble
    tps = tokens / share / step
    mfu = model_flops_per_token(model, train.seq_len) * tps / peak
    return TimeBreakdown(compute, comm_s, exposed, offload, bubble, step, tps, mfu)


def _exposed(s: Strategy, train: TrainSpec, comm_s: float, fwd: float, bwd: float,
             comm: CommBreakdown) -> float:
    """What compute cannot hide. DDP/ZeRO-0/1/2 reduce gradient buckets during backward (the
    last bucket is exposed) and ZeRO-1/2 all-gather the updated params after the step
    (exposed). ZeRO-3/FSDP prefetch the next unit's all-gather during forward and backward and
    reduce-scatter during backward; the first gather of each pass is exposed."""
    if comm_s == 0:
        return 0.0
    total = (comm.total - comm.blocking) or 1.0
    hide = OVERLAP_EFFICIENCY
    if s.shards_params:
        ag_share = comm.all_gather / total
        fwd_comm = comm_s * ag_share / (2 if s.facts.zero_equivalent == 3 else 1)
        bwd_comm = comm_s - fwd_comm
        units = 32  # first unit of each pass cannot be prefetched
        return max(0.0, fwd_comm - hide * fwd) + max(0.0, bwd_comm - hide * bwd) + comm_s / units
    ag_after_step = comm_s * (comm.all_gather / total)
    reduce = comm_s - ag_after_step
    # with accumulation DDP/ZeRO-1 only reduce in the last micro-batch's backward
    window = bwd / train.grad_accum if not s.shards_grads else bwd
    return max(0.0, reduce - hide * window) + reduce * 0.05 + ag_after_step


def _offload_time(model, hw, s: Strategy, layout, comm: CommBreakdown) -> float:
    """PCIe transfers (grads down, params up; full offload streams params every pass) plus the
    CPU optimizer over this node's partitions (DeepSpeed CPU Adam throughput per node)."""
    if not (s.offload_optimizer or s.offload_params):
        return 0.0
    per_node = min(layout.world_size, hw.gpus_per_node)
    pcie = comm.pcie / hw.pcie_bytes_per_s
    params_on_node = model.params / layout.tp / layout.pp / max(layout.dp_shard, 1) * per_node
    cpu_adam = params_on_node / hw.host_adam_params_per_s
    return pcie + cpu_adam
