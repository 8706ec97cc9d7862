"""Per-GPU and per-host memory of one strategy: pure functions, no torch.

Three accountings of model states:
- "engine" (default): what the installed engines allocate (DeepSpeed 0.19 stage_1_and_2.py /
  stage3.py, torch FSDP2 `_fully_shard`, DDP), incl. buffers; checked against a per-rank
  census in tests/accuracy/test_measured_memory.py.
- "paper": the ZeRO paper's 2Ψ + 2Ψ + KΨ (K = 12) with its sharding rules, no buffers;
- "deepspeed": DeepSpeed's own estimators (estimate_zero{2,3}_model_states_mem_needs);
  both in plan/memory_estimators.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from shardwise.catalog import memory_model
from shardwise.errors import ShardwiseError
from shardwise.plan import experts
from shardwise.plan.activations import mask_bytes, offload_kept, rank_saved, recompute_bytes
from shardwise.plan.breakdown import HostBreakdown, MemoryBreakdown
from shardwise.plan.context import backward_buffers, local_train, saved_extra
from shardwise.plan.context import refusal as context_refusal
from shardwise.plan.fp8 import all_gather_refusal, gathered_linear_bytes_saved, linear_share, recipe_refusal
from shardwise.plan.grad_sync import GradSync, applies, as_set
from shardwise.plan.load import load_phase
from shardwise.plan.loss import logits_bytes, loss_held_bytes
from shardwise.plan.memory_estimators import deepspeed_estimator, paper_model_states
from shardwise.plan.memory_lora import lora_states
from shardwise.plan.optimizer import optimizer_bytes, optimizer_temp, paged_states
from shardwise.plan.pipeline import PipelineRank, rank_actions, stage_in_flight
from shardwise.plan.preference import reference_forward, reference_params
from shardwise.plan.stage import (
    Replica,
    fsdp_gathered_at_loss,
    fsdp_gathered_linears,
    fsdp_gathered_params,
    fsdp_units,
    fullest_rank,
    loss_parallel,
    persistent_params,
    rank_params,
    replica_params,
    replica_partition,
    strategy_ranks,
    tp_train,
    vocab_shards,
    whole_model,
    zero3_gathered,
)
from shardwise.specs.hardware import HardwareSpec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec

Accounting = Literal["engine", "paper", "deepspeed"]


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    strategy: Strategy
    layout: ParallelLayout
    gpu: MemoryBreakdown
    host: HostBreakdown
    capacity_bytes: float  # GPU memory
    margin: float
    host_capacity_bytes: float
    # What the engines run when it is not `strategy`: FSDP2 with a one-rank shard group runs
    # as DDP (FSDPKnobs.single_rank); comm and time are planned for this one.
    runs_as: Strategy | None = None
    # Under pipeline parallelism each pipeline rank's GPU, rank 0 first (`gpu` is the one whose
    # requirement is the largest, `rank` its share); one entry at pp 1.
    pipeline: tuple[MemoryBreakdown, ...] = ()
    rank: PipelineRank | None = None
    # FSDP2 under accumulation: whether the unsharded grads are held between micro-batches,
    # and why (plan/grad_sync.py; `strategy` keeps the knob as given, "auto" included)
    grad_sync: GradSync | None = None

    @property
    def engine_strategy(self) -> Strategy:
        """What the engines run: `runs_as`, else `strategy` with its gradient sync resolved."""
        return self.runs_as or (self.grad_sync.strategy if self.grad_sync else self.strategy)

    @property
    def usable_bytes(self) -> float:
        return self.capacity_bytes * (1 - self.margin)

    @property
    def fits(self) -> bool:
        """What the GPU's peak really needs (`MemoryBreakdown.required`: allocated, the allocator's
        unreclaimable slack, CUDA context and NCCL; not the reclaimable cache in `total`) within
        its usable bytes, and the host's (the load phase or the offloaded training states,
        whichever is larger) within the node's memory."""
        return self.gpu.required <= self.usable_bytes and self.host.peak <= self.host_capacity_bytes


def model_states(
    model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
    accounting: Accounting = "engine", gpus_per_node: int = 8, rank: PipelineRank | None = None,
) -> tuple[MemoryBreakdown, HostBreakdown]:
    """Model states (params, grads, master, optimizer) and engine buffers on GPU and host, of one
    GPU of pipeline rank `rank` (default: the fullest, `stage.fullest_rank`)."""
    rank = rank or fullest_rank(model, strategy, layout)
    psi = rank_params(model, layout.tp, rank, vocab_shards(strategy, layout.tp))
    n = layout.dp_shard
    if strategy.ep > 1:  # num_experts/ep experts held (over etp), their states over the expert-data-parallel ranks
        model = experts.rank_model(model, strategy)
        held = rank_params(model, layout.tp, rank, vocab_shards(strategy, layout.tp))
        psi, n = held, experts.state_shards(n, psi, held)
    per_node = max(1, min(layout.world_size, gpus_per_node))  # GPUs sharing one host
    if accounting == "paper":
        return paper_model_states(psi, n, strategy), HostBreakdown()
    if accounting == "deepspeed":
        return deepspeed_estimator(model, psi, n, strategy, layout, per_node)
    return _engine(Replica(model, train, strategy, layout, psi, n, per_node, rank))


def _engine(r: Replica) -> tuple[MemoryBreakdown, HostBreakdown]:
    if r.train.lora_rank:
        return lora_states(r)
    if r.strategy.engine == "deepspeed":
        return _deepspeed(r)
    if r.strategy.engine == "fsdp2":
        return _fsdp2(r)
    model, train, s, layout, psi = r.model, r.train, r.strategy, r.layout, r.psi
    os_ = optimizer_bytes(train)
    # DDP: the module stays fp32 under autocast (fp32 params, grads, optimizer; autocast's
    # cached weight casts are saved for backward, so `autocast_cache` books them with the
    # activations). With gradient_as_bucket_view the reducer's buckets *are* the grads and stay
    # allocated across steps (zero_grad only drops the views: census after_step, 1.00 P);
    # without it the buckets are one more resident copy and the grads come and go. One replica
    # runs unwrapped (DDPKnobs.wrap_one_rank): no buckets, the grads come and go.
    w = train.master_bytes
    wrapped = s.ddp.wrapped(layout.dp_replicate)
    view = wrapped and s.ddp.gradient_as_bucket_view
    if train.optimizer_in_backward and not wrapped:
        # one replica, unwrapped: each parameter steps as its gradient is accumulated and the
        # gradient is freed at once (a wrapped replica's buckets would hold them all: the trainer
        # refuses that); one tensor's gradient and optimizer temporaries at a time
        largest = model.largest_module / layout.tp
        return MemoryBreakdown(params=w * psi, grads=w * largest, optimizer_states=os_ * psi,
                               step_buffers=optimizer_temp(train, largest, largest)), HostBreakdown()
    return MemoryBreakdown(
        params=w * psi, grads=w * psi, optimizer_states=os_ * psi,
        step_buffers=optimizer_temp(train, psi, model.largest_module / layout.tp),
        engine_buffers=w * psi if wrapped and not view else 0, grads_persist=view or train.grad_accum > 1,
    ), HostBreakdown()


def autocast_cache(model: ModelSpec, train: TrainSpec, tp: int, layers: Sequence[int],
                   head: bool) -> tuple[float, float]:
    """torch.autocast casts each linear weight to the compute dtype once per forward and the
    linear saves the cast for backward (the input embedding is a lookup, never cast): one
    micro-batch's forward through decoder `layers` and, with the `head`, lm_head (a pipeline
    stage's; the whole model at pp 1). Checkpointed layers run their forward without grad, so
    nothing is cached for them: only lm_head's cast stays, and backward re-casts one layer at a
    time while lm_head's cast is already freed. Returns (bytes saved by forward, change during
    recompute); measured exactly on tiny Llama/Qwen2
    (benchmarks/results/measured_activations.json, bf16-autocast)."""
    c = train.compute_bytes
    lm_head = model.lm_head_params / tp if head else 0.0
    # routed experts are fused 3-D parameters, not nn.Linear: autocast does not cast them
    moe = model.moe_layers
    experts_per_layer = model.expert_params / sum(moe) if any(moe) else 0.0
    sizes = model.layer_sizes
    cast = sum(sizes[i] - (experts_per_layer if moe[i] else 0.0) for i in layers) / tp
    if train.checkpointing == "full":
        return c * lm_head, c * ((model.params_per_layer - experts_per_layer) / tp - lm_head)
    return c * (cast + lm_head), 0.0


def _deepspeed(r: Replica) -> tuple[MemoryBreakdown, HostBreakdown]:
    """DeepSpeed keeps the module in the compute dtype (w bytes) and an fp32 master partition,
    even for an fp32 model (measured: docs/reference.md "What the engines allocate"); grads are partitioned in the compute dtype
    and copied to an fp32 partition inside step() (stage_1_and_2.py `single_partition_of_fp32_groups`).
    The optimizer runs on flat partitions, so a for-loop step's temporaries are partition-sized."""
    model, train, s, layout, psi, n, per_node = r.model, r.train, r.strategy, r.layout, r.psi, r.n, r.per_node
    c, os_ = train.compute_bytes, optimizer_bytes(train)
    w = c
    stage = s.zero_stage
    ds = s.ds
    buckets = ds.reduce_bucket_size * w * (2 if ds.overlap(stage) else 1) if ds.contiguous_gradients else 0
    host = HostBreakdown()
    if stage == 0:
        # Stage 0: bf16/fp16 → FP16_Optimizer-style full fp32 master + grads copy at step;
        # fp32 → the plain torch optimizer, no master (engine._do_optimizer_sanity_check).
        master = 4 * psi if w != 4 else 0
        temp = optimizer_temp(train, psi, psi if w != 4 else model.largest_module / layout.tp)
        return MemoryBreakdown(
            params=w * psi, grads=w * psi, master_params=master, optimizer_states=os_ * psi,
            step_buffers=(4 * psi if w != 4 else 0) + temp, grads_persist=train.grad_accum > 1,
        ), host
    if stage == 1 and s.zero_impl == "megatron":
        return _megatron_distributed_optimizer(r), host
    if stage in (1, 2):
        # ZeRO-1 under accumulation keeps full grads until the boundary; ZeRO-2 reduces each
        # micro-batch into the partition (docs/reference.md "What the engines allocate").
        grads = w * psi if (stage == 1 and train.grad_accum > 1) else w * replica_partition(r)
        # the reduce buckets are set up at the first backward hook and released after it
        # (stage_1_and_2.py setup_buckets; measured ~0 after backward)
        mem = MemoryBreakdown(
            params=w * psi, grads=grads, master_params=4 * psi / n, optimizer_states=os_ * psi / n,
            step_buffers=4 * psi / n + optimizer_temp(train, psi / n, psi / n), grad_buffers=buckets,
            grads_persist=train.grad_accum > 1,
        )
        if s.offload_optimizer:
            # fp32 master, fp32 grad partition and Adam live in pinned host memory; the GPU keeps
            # the 16-bit params, the reduce buckets and a largest-param staging buffer.
            host = HostBreakdown(
                grads=4 * psi / n * per_node, master_params=4 * psi / n * per_node,
                optimizer_states=os_ * psi / n * per_node,
            )
            mem = MemoryBreakdown(params=w * psi, grad_buffers=buckets + w * model.largest_module / layout.tp)
        return mem, host
    # Stage 3: params partitioned except small persistent ones, which are held whole *and* keep
    # their 1/N `ds_tensor` partition (measured: benchmarks/results/measured_model_states.json,
    # zero3 vs zero3-nopersist). The gradient partition is one flat buffer allocated at init
    # (stage3.py `grad_partitions_flat_buffer`): it persists across steps. One reduce bucket
    # stays allocated across steps (measured: 1× reduce_bucket_size elements, also with its
    # default overlap_comm=True). The optimizer steps per sub-group of `sub_group_size` (the
    # memory model's: DeepSpeed's default) with an fp32 copy of that sub-group's gradients.
    persist = persistent_params(model, ds.param_persistence_threshold, layout.tp)
    params = w * (persist + psi / n)
    sub_group = min(psi / n, memory_model().sub_group_size)
    mem = MemoryBreakdown(
        params=params, grads=w * psi / n, master_params=4 * psi / n, optimizer_states=os_ * psi / n,
        step_buffers=4 * sub_group + optimizer_temp(train, sub_group, sub_group),
        engine_buffers=ds.reduce_bucket_size * w, gathered_params=w * zero3_gathered(model, train, ds, layout, r.rank),
        # the module in backward produces its whole gradient before reduce-scatter: fused MoE
        # experts are one module (DeepSeek-V3: 11.3B elements)
        grad_buffers=w * model.largest_module / layout.tp, grads_persist=True,
    )
    if s.offload_optimizer:
        host = HostBreakdown(
            grads=4 * psi / n * per_node, master_params=4 * psi / n * per_node,
            optimizer_states=os_ * psi / n * per_node,
        )
        # offload_param puts every partition on the host, while the persistent tensors stay on
        # the GPU whole (zero.Init keeps a `ds_persist` tensor's data on the device:
        # partition_parameters.py `_partition_param`); their partitions, trainable, move into the
        # flat CPU buffer with the rest (stage3.py `_create_param_groups_fp16_flat_cpu_memory`),
        # deepspeedai/DeepSpeed@edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (LoRA's frozen ones do
        # not: plan/memory_lora.py)
        on_gpu = w * persist if s.offload_params else params
        mem = MemoryBreakdown(params=on_gpu, engine_buffers=mem.engine_buffers, gathered_params=mem.gathered_params)
        if s.offload_params:
            host = HostBreakdown(params=w * psi / n * per_node, **{
                k: getattr(host, k) for k in ("grads", "master_params", "optimizer_states")})
    return mem, host


def _megatron_distributed_optimizer(r: Replica) -> MemoryBreakdown:
    """Megatron-Core's distributed optimizer (`--use-distributed-optimizer`, strategy zero1 with
    zero_impl megatron): the module in the compute dtype (Float16Module), and one gradient buffer
    the size of the model, allocated when its DistributedDataParallel wraps the module and kept
    across steps (megatron/core/distributed/param_and_grad_buffer.py), in fp32 for a bf16 run
    (megatron/training/arguments.py: "bfloat16 requires gradient accumulation and all-reduce to
    be done in fp32", main_grads_dtype fp32 by default). Each data-parallel rank keeps the fp32
    main params and Adam states of its shard; the reduce-scatter writes into the gradient buffer
    and the step reads its shard there, and the updated params are all-gathered into the module's
    own buffer: no gradient partition copy and no reduce buckets beside them (NVIDIA/Megatron-LM
    @d98e8a64). Its fused Adam (Transformer Engine's or apex's) allocates no temporaries.
    `grad_reduce_in_bf16` makes the gradient buffer bf16 (Strategy.main_grad_bytes). With fp8
    linears and `fp8_all_gather` (`--fp8-param-gather`) the module keeps the decoder linears'
    weights as Transformer Engine fp8 tensors (one byte an element) and the optimizer casts its
    updated fp32 shard into them (megatron/core/optimizer/distrib_optimizer.py
    `_copy_main_params_to_model_params` → `quantize_param_shard`): no bf16 copy of them exists."""
    train, psi, n = r.train, r.psi, r.n
    c = train.compute_bytes
    grad = r.strategy.main_grad_bytes(train.compute_dtype, c)
    params = c * psi - gathered_linear_bytes_saved(c, train) * linear_share(r.model, r.rank, r.layout.tp)[0]
    return MemoryBreakdown(params=params, grads=grad * psi, master_params=4 * psi / n if c != 4 else 0.0,
                           optimizer_states=optimizer_bytes(train) * psi / n, grads_persist=True)


def _fsdp2(r: Replica) -> tuple[MemoryBreakdown, HostBreakdown]:
    """FSDP2 (`fully_shard` per decoder layer + root): sharded fp32 params and grads (mixed
    precision casts to `param_dtype` when it all-gathers), optimizer on the shards. Gathered:
    the unsharded c-byte params of the layer in flight and the prefetched one, and the root
    group (embeddings, final norm, lm_head), held from forward through backward (resharded
    between the two only under "all", and gathered again as backward starts); grad-op (resharding "none") keeps every layer unsharded
    from forward to backward (fsdp_gathered_params). Backward buffers: a layer's unsharded grads plus their `reduce_dtype` copy for
    reduce-scatter, and lm_head's unsharded grad (the root reduce-scatters at the very end)
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)."""
    model, train, s, layout, psi, n, per_node, layer = r.model, r.train, r.strategy, r.layout, r.psi, r.n, r.per_node, r.layer
    c, os_ = train.compute_bytes, optimizer_bytes(train)
    w = train.master_bytes
    units = fsdp_units(model, s, layout, r.rank, psi, r.layers, layer)
    reduce = s.fsdp.reduce_bytes(c) if train.mixed_precision else w
    gathered = fsdp_gathered_params(s, c, psi, units)
    at_loss = fsdp_gathered_at_loss(s, train, c, psi, units)
    if train.fp8_all_gather:  # the gathered decoder linears are fp8 (plan/fp8.py)
        held_lin, held_lin_at_loss = fsdp_gathered_linears(s, *linear_share(model, r.rank, layout.tp))
        gathered -= gathered_linear_bytes_saved(c, train) * held_lin
        at_loss -= gathered_linear_bytes_saved(c, train) * held_lin_at_loss
    # lm_head's unsharded grad waits for the root's reduce-scatter at the end of backward; a head
    # unit of its own (fsdp.wrap_embeddings) reduce-scatters it as its backward ends, a transient
    # like a layer's
    lm_head = 0.0 if units.head else model.lm_head_params / layout.tp
    rs = (c + reduce) * max(layer, units.head) + c * lm_head
    # Accumulation. The trainer turns gradient sync off on non-final micro-batches: FSDP2 then
    # keeps every unsharded grad, upcast to reduce_dtype (`to_accumulated_grad_if_needed`,
    # _fsdp_param.py), until the last micro-batch reduce-scatters the sum. Stock FSDP2
    # (`reduce_every_micro_batch`) reduce-scatters every micro-batch into the sharded grads,
    # which then live through the following micro-batches. memory_as_run resolves "auto"
    # (plan/evaluate.py fsdp_grad_sync) before it gets here.
    accumulating = train.grad_accum > 1
    unsharded_held = accumulating and s.fsdp.reduce_every_micro_batch is False
    held = reduce * psi if unsharded_held else 0.0
    # The root's own reduce-scatter (embeddings, lm_head: often the largest group), or the
    # embedding unit's, runs at the end of backward, when the activations are gone: a step-phase
    # transient, like the optimizer's temporaries (it finishes before the step starts).
    root_rs = (c + reduce) * max(units.root, units.embedding)
    # What backward gathers is not all gathered while the loss runs (fsdp_gathered_at_loss)
    free = max(0.0, gathered - at_loss)
    mem = MemoryBreakdown(
        params=w * psi / n, grads=w * psi / n, optimizer_states=os_ * psi / n,
        step_buffers=max(optimizer_temp(train, psi / n, model.largest_module / layout.tp / n), root_rs),
        gathered_params=gathered, held_grads=held, grad_buffers=rs,
        grads_persist=accumulating and not unsharded_held,
        grads_pending=0.0 if accumulating else w * (layer + units.root + units.embedding) / n,
        gathered_free_at_loss=free,
    )
    if train.optimizer_in_backward:
        # Each parameter steps in the hook FSDP2 runs after its group's reduce-scatter, and its
        # sharded grad is freed there: one group's shards at a time (a layer, or the root at the
        # end), and one parameter's optimizer temporaries (trainer: _torch_common.InBackwardAdamW).
        largest = model.largest_module / layout.tp / n
        mem = replace(mem, grads=w * max(units.largest_outside_root, units.root) / n, grads_persist=False,
                      grads_pending=0.0,
                      step_buffers=max(optimizer_temp(train, largest, largest), root_rs))
    host = HostBreakdown()
    if s.offload_params:  # CPUOffloadPolicy: sharded params, grads and optimizer step on the CPU
        host = HostBreakdown(
            params=w * psi / n * per_node, grads=w * psi / n * per_node,
            optimizer_states=os_ * psi / n * per_node,
        )
        mem = MemoryBreakdown(gathered_params=gathered, held_grads=held, grad_buffers=rs, gathered_free_at_loss=free)
    return mem, host


def runtime_overhead(layout: ParallelLayout, gpu: MemoryBreakdown, expandable: bool = False) -> dict[str, float]:
    """Memory outside the allocator's live bytes: the CUDA context, one NCCL communicator per
    process group this rank is in, and the caching allocator's slack (reserved − allocated).

    The slack: the blocks that forward frees (activations, logits: many sizes) are rarely the
    shapes the end of backward and the step ask for (gradient shards, reduce copies), so the
    default allocator reserves new segments for both phases' transients (min(forward, step)
    on top of the larger one), plus `allocator_slack` of the larger for splitting/rounding.
    On one H200 this puts nvidia-smi's peak within the residuals in docs/accuracy.md. The CUDA
    context, a communicator and the slack fraction are the memory model's (catalog/memory.yaml).

    Of the slack, the phase overlap is segments one phase's transients filled and freed whole:
    the allocator releases those and retries before it raises out-of-memory. The splitting share
    (`allocator_slack`) is taken as free blocks inside segments that still hold live ones, which
    a flush cannot return (assumed: the fit does not separate the two; CUDACachingAllocator's
    `release_cached_blocks` frees only unsplit blocks). Expandable segments unmap freed pages
    whatever their segment: nothing stays unreclaimable."""
    mm = memory_model()
    groups = sum(d > 1 for d in (layout.dp_shard, layout.dp_replicate, layout.tp, layout.cp, layout.pp))
    groups += (layout.ep > 1) + (layout.ep > 1 and layout.expert_dp > 1)  # EP, expert-data-parallel
    resident = gpu.resident + (gpu.grads if gpu.grads_persist else 0.0)
    phases = gpu.phases  # the end of backward reuses blocks of both: the fit is over these two
    fwd, step = (max(0.0, phases[k] - resident) for k in ("forward", "step"))
    # expandable segments map freed pages back into one growing segment: the phases share
    # memory and only rounding remains (not measured here: the fraction is the default's)
    overlap = 0.0 if expandable else min(fwd, step)
    splitting = mm.allocator_slack * max(fwd, step)
    return {"cuda_context": mm.cuda_context_bytes, "nccl": mm.nccl_per_group_bytes * groups,
            "allocator_slack": overlap + splitting, "allocator_unreclaimable": 0.0 if expandable else splitting}


def saved_for_backward(model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
                       rank: PipelineRank | None = None) -> tuple[float, float]:
    """(saved-for-backward bytes at their peak, the recomputed layer's) per GPU of pipeline rank
    `rank` (default: the whole model, pp 1), before any offloading: the end of forward at pp 1,
    the micro-batches in flight in the schedule's order under pipeline parallelism
    (plan.activations.rank_saved). `train` as tp_train gives it."""
    rank = whole_model(model, layout, rank)
    # DDP runs an fp32 module under torch.autocast; a LoRA base is already in the compute dtype
    autocast = train.autocasts(strategy.engine)
    etp = strategy.expert_tp  # routed copies a rank holds (plan.activations.moe_saved)
    recompute = recompute_bytes(model, train, layout.tp, autocast, etp)
    cached: dict[int, float] = {}
    if autocast:  # each micro-batch's forward caches its own casts (one per stage)
        for stage, layers in zip(rank.stages, rank.stage_layers, strict=True):
            cached[stage], recast = autocast_cache(model, train, layout.tp, layers, stage == rank.last_stage)
        recompute = max(0.0, recompute + recast)
    # DTensor's column-parallel linears save their gathered input, Megatron-SP's their sharded one
    # (plan.activations.gathered_inputs); AutoTP has no sequence parallelism (`tp_train`)
    acts = rank_saved(model, train, layout.tp, rank, layout.pp, strategy.pp_schedule, strategy.pp_virtual_stages,
                      autocast, gathered=strategy.tp_scheme.saves_gathered_input, extra=cached, etp=etp)
    return acts, recompute


def offloaded_activations(model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
                          acts: float | None = None, rank: PipelineRank | None = None) -> float:
    """Bytes per GPU that activation offloading (`activation_offload`) moves to the host in each
    micro-batch's forward and back in its backward: the saved set (`acts`, where the caller has
    it: saved_for_backward's; else pipeline rank `rank`'s, by default the fullest) but the layer
    in flight (plan.activations.offload_kept) and a dense mask (one tensor every layer saves)."""
    if not train.activation_offload:
        return 0.0
    if acts is None:
        rank = rank or (fullest_rank(model, strategy, layout) if layout.pp > 1 else None)
        acts = saved_for_backward(model, train, strategy, layout, rank)[0]
    kept = offload_kept(model, train, layout.tp, train.autocasts(strategy.engine), strategy.expert_tp)
    kept += mask_bytes(train)
    return max(0.0, acts - kept)


def plan_memory(
    model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
    accounting: Accounting = "engine", margin: float | None = None, runs_as: Strategy | None = None,
) -> MemoryPlan:
    """Per-GPU (and per-host) memory of `strategy`, at the step's peak.

    `margin`: the fraction of GPU memory kept free when deciding "fits" (None: the memory
    model's `default_margin`). `runs_as`: the strategy the engines run instead, planned in its
    place and named in the plan (FSDP2 with a one-rank shard group running as DDP; whether it
    does is decided from memory and time together: plan.evaluate.memory_as_run)."""
    if margin is None:
        margin = memory_model().default_margin
    train = train.for_engine((runs_as or strategy).engine)
    if runs_as is not None:
        return replace(plan_memory(model, hw, train, runs_as, accounting, margin), strategy=strategy, runs_as=runs_as)
    if train.checkpointing == "auto":
        raise ValueError("checkpointing 'auto' is decided before memory is planned (plan.evaluate.checkpointing_choice)")
    if applies(strategy, train) and strategy.fsdp.reduce_every_micro_batch == "auto":
        raise ValueError(f"{strategy.name}: reduce_every_micro_batch 'auto' is decided before memory is planned "
                         "(plan.evaluate.memory_as_run / fsdp_grad_sync)")
    layout = ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
    layout.check_model(model)
    if why := recipe_refusal(hw.gpu, train) or all_gather_refusal(strategy, train):
        raise ShardwiseError(why)
    if strategy.ep_overlap and train.checkpointing == "full":
        raise ShardwiseError(f"{strategy.name} with ep_overlap and full checkpointing: Megatron-Core refuses full "
                             "recomputation with its EP all-to-all overlap (transformer_config.py); plan "
                             "--checkpointing none or selective")
    if strategy.zero_impl == "megatron" and train.lora_rank:
        raise ShardwiseError(f"{strategy.name} with zero_impl megatron: Megatron-Core's distributed optimizer is "
                             "planned for full fine-tuning (no LoRA)")
    train = tp_train(train, strategy)  # without sequence parallelism where its TP has none
    if why := context_refusal(model, train, layout.cp, strategy.cp_scheme, layout.tp, strategy.cp_load_balance):
        raise ShardwiseError(f"cp {layout.cp} ({strategy.cp_scheme}) with {strategy.name}: {why}")
    train = local_train(train, layout.cp)  # context parallelism: a rank's seq/cp tokens (plan/context.py)
    # one GPU of each pipeline rank (one rank at pp 1); the plan's GPU is the one that needs most
    ranks = strategy_ranks(model, strategy, layout)
    each = [_rank_memory(model, hw, train, strategy, layout, accounting, rank) for rank in ranks]
    worst = max(range(len(ranks)), key=lambda i: each[i][0].required)
    gpu, host = each[worst]
    return MemoryPlan(
        strategy=strategy, layout=layout, gpu=gpu, host=host, capacity_bytes=hw.gpu.memory_bytes,
        margin=margin, host_capacity_bytes=hw.host_memory_bytes, pipeline=tuple(g for g, _ in each),
        rank=ranks[worst], grad_sync=as_set(strategy, train, gpu.held_grads),
    )


def _rank_memory(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
                 accounting: Accounting, rank: PipelineRank) -> tuple[MemoryBreakdown, HostBreakdown]:
    """GPU and host memory of one GPU of pipeline rank `rank` (`train` as tp_train gives it)."""
    seq = train.as_sequences()  # a forward's batch: 2 sequences per example for the paired objectives
    states, host = model_states(model, train, strategy, layout, accounting, hw.gpus_per_node, rank)
    acts, recompute = saved_for_backward(model, seq, strategy, layout, rank)
    per_node = max(1, min(layout.world_size, hw.gpus_per_node))  # ranks sharing one host
    if train.activation_offload:  # the saved tensors wait in pinned host memory, but a layer's
        moved = offloaded_activations(model, seq, strategy, layout, acts)
        host = replace(host, activations=moved * per_node)
        acts -= moved
    if paged_states(train) and states.optimizer_states:  # CUDA unified memory, outside torch's allocator
        host = replace(host, optimizer_states=host.optimizer_states + states.optimizer_states * per_node)
        states = replace(states, optimizer_states=0.0)
    vocab_tp = vocab_shards(strategy, layout.tp)
    logits = 0.0
    if rank.head:  # the loss is the last stage's: the one computing, and those waiting for their backward
        logits = logits_bytes(model, seq, vocab_tp, loss_parallel(strategy, layout.tp))
        if layout.pp > 1:
            actions = rank_actions(strategy.pp_schedule, layout.pp, strategy.pp_virtual_stages, train.grad_accum,
                                   rank.index)
            waiting = stage_in_flight(actions, rank.last_stage) - 1
            logits += waiting * loss_held_bytes(model, seq, vocab_tp)
    # a preference objective's reference model (plan/preference.py); an offloaded reference's
    # shards sit in host memory with the policy's parameters. Under PP each rank holds its stages'
    # share and its transient is counted on every rank (an upper bound: the trainer runs SFT only)
    psi = replica_params(model, strategy, layout, rank)
    ref_gpu, ref_host = reference_params(model, train, strategy, layout, psi)
    if ref_host:
        host = replace(host, params=host.params + ref_host * per_node)
    draft = replace(states, activations=acts, recompute=recompute, logits=logits, ref_params=ref_gpu,
                    ref_forward=reference_forward(model, train, strategy, layout, psi, vocab_tp))
    if layout.cp > 1:  # one layer's K/V exchange buffers in its attention backward, and what its
        # attention saves beyond the local K/V: each layer's, or the recomputed layer's (plan/context.py)
        extra = saved_extra(model, seq, layout.cp, strategy.cp_scheme, layout.tp)
        kept = len(rank.layers) if train.checkpointing == "none" else 0
        draft = replace(draft, activations=draft.activations + kept * extra,
                        grad_buffers=draft.grad_buffers + (extra if not kept else 0.0)
                        + backward_buffers(model, seq, layout.cp, strategy.cp_scheme, layout.tp))
    gpu = replace(draft, **runtime_overhead(layout, draft, train.expandable_segments))
    if accounting == "engine":  # the trainer's load phase (safetensors, on GPUs): plan/load.py
        host = replace(host, load=load_phase(model, train, strategy, layout, per_node))
    return gpu, host
