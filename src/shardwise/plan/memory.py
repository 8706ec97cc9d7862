"""Per-GPU and per-host memory of one strategy: pure functions, no torch.

Three accountings of model states:
- "engine" (default): what the installed engines allocate (DeepSpeed 0.19 stage_1_and_2.py /
  stage3.py, torch FSDP2 `_fully_shard`, DDP), incl. buffers; checked against a per-rank
  census in tests/test_measured_memory.py.
- "paper": the ZeRO paper's 2Ψ + 2Ψ + KΨ (K = 12) with its sharding rules, no buffers.
- "deepspeed": DeepSpeed's own estimators (estimate_zero{2,3}_model_states_mem_needs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from shardwise.plan.activations import activation_bytes, recompute_bytes
from shardwise.plan.loss import logits_bytes
from shardwise.plan.breakdown import HostBreakdown, MemoryBreakdown
from shardwise.specs.hardware import GIB, HardwareSpec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec

Accounting = Literal["engine", "paper", "deepspeed"]

CUDA_CONTEXT = 0.75 * GIB  # docs/reference.md "Runtime overheads": 0.3–1 GB per process
NCCL_PER_GROUP = 0.5 * GIB  # NVIDIA/nccl #864: ~0.5 GB per communicator
FRAGMENTATION = 0.05  # caching-allocator slack on top of live bytes (expandable_segments assumed)
DEFAULT_MARGIN = 0.05  # head room kept free when deciding "fits"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    strategy: Strategy
    layout: ParallelLayout
    gpu: MemoryBreakdown
    host: HostBreakdown
    capacity_bytes: float  # GPU memory
    margin: float
    host_capacity_bytes: float

    @property
    def usable_bytes(self) -> float:
        return self.capacity_bytes * (1 - self.margin)

    @property
    def fits(self) -> bool:
        return self.gpu.total <= self.usable_bytes and self.host.total <= self.host_capacity_bytes


def stage_params(model: ModelSpec, tp: int, pp: int) -> float:
    """Parameters held by one GPU's model replica: a pipeline stage's layers (worst stage: one
    with the embedding or the lm_head) split over TP ranks (norms are replicated; negligible)."""
    root = model.params - model.params_per_layer * model.num_layers
    if pp > 1:
        embed = model.vocab_size * model.hidden_size
        root = max(embed, root - embed) if not model.tie_embeddings else embed
    return (-(-model.num_layers // pp) * model.params_per_layer + root) / tp


def _persistent_params(model: ModelSpec, threshold: int, tp: int) -> float:
    """ZeRO-3 keeps parameters with fewer than `stage3_param_persistence_threshold` elements
    whole on every rank (partition_parameters.py: `ds_persist`)."""
    return sum(n * k for n, k in model.tensor_sizes() if n / tp < threshold) / tp


@lru_cache(maxsize=4096)
def partition_holding(model: ModelSpec, n: int, tp: int = 1, pp: int = 1) -> float:
    """Elements of the gradient partition on DeepSpeed ZeRO-1/2's fullest rank: every tensor
    that overlaps the rank's 1/N slice of the flat buffer is held whole
    (stage_1_and_2.py: params_in_partition; measured +2.4% on a tiny Llama)."""
    if n <= 1:
        return stage_params(model, tp, pp)
    if tp > 1 or pp > 1:  # per-rank tensor order under TP/PP is engine-specific: use the ideal
        return stage_params(model, tp, pp) / n
    sizes = model.hf_order
    part = -(-sum(sizes) // n)
    held = [0] * n
    start = 0
    for size in sizes:
        end = start + size
        for r in range(start // part, min(n - 1, (end - 1) // part) + 1):
            held[r] += size
        start = end
    return max(held)


def _optimizer_bytes(train: TrainSpec) -> float:
    """Optimizer state bytes per parameter."""
    pure = train.precision == "bf16-pure"
    return {
        "adamw": 4 if pure else 8,  # exp_avg + exp_avg_sq
        "sgd": 2 if pure else 4,  # momentum buffer
        "adam8bit": 2,  # bitsandbytes: two uint8 states (block absmax is ~1.6% extra, ignored)
    }[train.optimizer]


def model_states(
    model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
    accounting: Accounting = "engine", gpus_per_node: int = 8,
) -> tuple[MemoryBreakdown, HostBreakdown]:
    """Model states (params, grads, master, optimizer) and engine buffers on GPU and host."""
    psi = stage_params(model, layout.tp, layout.pp)
    n = layout.dp_shard
    per_node = max(1, min(layout.world_size, gpus_per_node))  # GPUs sharing one host
    if accounting == "paper":
        return paper_model_states(psi, n, strategy), HostBreakdown()
    if accounting == "deepspeed":
        return _deepspeed_estimator(model, psi, n, strategy, layout, per_node)
    return _engine(model, train, strategy, layout, psi, n, per_node)


def paper_model_states(psi: float, n: int, s: Strategy) -> MemoryBreakdown:
    """ZeRO paper §5: 2Ψ fp16 params + 2Ψ fp16 grads + KΨ (K = 12: fp32 params 4, Adam 8)."""
    stage = s.facts.zero_equivalent
    opt_on_gpu = 0 if s.offload_optimizer else 1
    return MemoryBreakdown(
        params=2 * psi / (n if stage >= 3 else 1) * (0 if s.offload_params else 1),
        grads=2 * psi / (n if stage >= 2 else 1),
        master_params=4 * psi / (n if stage >= 1 else 1) * opt_on_gpu,
        optimizer_states=8 * psi / (n if stage >= 1 else 1) * opt_on_gpu,
    )


def _deepspeed_estimator(model, psi, n, s: Strategy, layout, per_node) -> tuple[MemoryBreakdown, HostBreakdown]:
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs (zero_init=True), bucketed into parts.
    ZeRO-2: 2Ψ + 18Ψ/N, "18 = 2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 Adam"
    (stage_1_and_2.py). ZeRO-3: 4·largest_layer + 18Ψ/N (stage3.py); its 18 is not itemised:
    we book 2 fp16 params + 2 fp16 grads + 4 fp32 params + 8 Adam and the 2 left as step buffers.
    Host figures include the estimator's additional_buffer_factor 1.5."""
    nodes = max(1, layout.world_size // per_node)
    if s.zero_stage == 3:
        live = 4 * model.largest_module / layout.tp
        if s.offload_params:
            return MemoryBreakdown(engine_buffers=live), HostBreakdown(optimizer_states=psi * 18 / nodes * 1.5)
        if s.offload_optimizer:
            return (MemoryBreakdown(params=2 * psi / n, engine_buffers=live),
                    HostBreakdown(optimizer_states=psi * 16 / nodes * 1.5))
        return MemoryBreakdown(
            params=2 * psi / n, grads=2 * psi / n, master_params=4 * psi / n,
            optimizer_states=8 * psi / n, step_buffers=2 * psi / n, engine_buffers=live,
        ), HostBreakdown()
    if s.offload_optimizer:
        return MemoryBreakdown(params=2 * psi), HostBreakdown(optimizer_states=psi * max(4 * n, 16) * 1.5)
    return MemoryBreakdown(
        params=2 * psi, grads=2 * psi / n, step_buffers=4 * psi / n, master_params=4 * psi / n,
        optimizer_states=8 * psi / n,
    ), HostBreakdown()


def _engine(model, train: TrainSpec, s: Strategy, layout, psi, n, per_node) -> tuple[MemoryBreakdown, HostBreakdown]:
    c = train.compute_bytes
    os_ = _optimizer_bytes(train)
    mixed = train.precision in ("bf16-mixed", "fp16-mixed")
    layer = model.params_per_layer / layout.tp
    if train.lora_rank:
        return _lora(model, train, s, layout, psi, n)
    if s.engine == "deepspeed":
        return _deepspeed(model, train, s, layout, psi, n, per_node, c, os_, layer)
    if s.engine == "fsdp2":
        return _fsdp2(model, train, s, layout, psi, n, per_node, c, os_, layer, mixed)
    # DDP: the module stays fp32 under autocast (fp32 params, grads, optimizer; autocast's
    # cached weight casts are saved for backward, so `autocast_cache` books them with the
    # activations); with gradient_as_bucket_view the reducer's buckets *are* the grads, else
    # one more copy.
    w = 2 if train.precision == "bf16-pure" else 4
    return MemoryBreakdown(
        params=w * psi, grads=w * psi, optimizer_states=os_ * psi,
        step_buffers=_foreach_temp(train, psi),
        engine_buffers=0 if s.ddp.gradient_as_bucket_view else w * psi,
    ), HostBreakdown()


def autocast_cache(model: ModelSpec, train: TrainSpec, layout: ParallelLayout) -> tuple[float, float]:
    """torch.autocast casts each linear weight to the compute dtype once per forward and the
    linear saves the cast for backward (the input embedding is a lookup, never cast).
    Checkpointed layers run their forward without grad, so nothing is cached for them: only
    lm_head's cast stays, and backward re-casts one layer at a time while lm_head's cast is
    already freed. Returns (bytes saved by forward, change during recompute); measured exactly
    on tiny Llama/Qwen2 (benchmarks/results/measured_activations.json, bf16-autocast)."""
    c = train.compute_bytes
    lm_head = model.vocab_size * model.hidden_size / layout.tp
    layers = model.params_per_layer * -(-model.num_layers // layout.pp) / layout.tp
    if train.checkpointing == "full":
        return c * lm_head, c * (model.params_per_layer / layout.tp - lm_head)
    return c * (layers + lm_head), 0.0


def _foreach_temp(train: TrainSpec, n_params: float) -> float:
    """torch's foreach AdamW (the CUDA default) allocates fp32 temporaries the size of the
    parameters it updates (`exp_avg_sq_sqrt` in torch/optim/adam.py _multi_tensor_adam)."""
    return 4 * n_params if train.optimizer != "sgd" else 0


def _deepspeed(model, train, s: Strategy, layout, psi, n, per_node, c, os_, layer):
    """DeepSpeed keeps the module in the compute dtype (w bytes) and an fp32 master partition,
    even for an fp32 model (measured: docs/reference.md "What the engines allocate"); grads are partitioned in the compute dtype
    and copied to an fp32 partition inside step() (stage_1_and_2.py `single_partition_of_fp32_groups`)."""
    w = c
    stage = s.zero_stage
    ds = s.ds
    buckets = ds.reduce_bucket_size * w * (2 if ds.overlap(stage) else 1) if ds.contiguous_gradients else 0
    host = HostBreakdown()
    if stage == 0:
        # Stage 0: bf16/fp16 → FP16_Optimizer-style full fp32 master + grads copy at step;
        # fp32 → the plain torch optimizer, no master (engine._do_optimizer_sanity_check).
        master = 4 * psi if w != 4 else 0
        return MemoryBreakdown(
            params=w * psi, grads=w * psi, master_params=master, optimizer_states=os_ * psi,
            step_buffers=4 * psi if w != 4 else _foreach_temp(train, psi),
        ), host
    if stage in (1, 2):
        # ZeRO-1 under accumulation keeps full grads until the boundary; ZeRO-2 reduces each
        # micro-batch into the partition (docs/reference.md "What the engines allocate").
        grads = w * psi if (stage == 1 and train.grad_accum > 1) else w * partition_holding(model, n, layout.tp, layout.pp)
        # the reduce buckets are set up at the first backward hook and released after it
        # (stage_1_and_2.py setup_buckets; measured ~0 after backward)
        mem = MemoryBreakdown(
            params=w * psi, grads=grads, master_params=4 * psi / n, optimizer_states=os_ * psi / n,
            step_buffers=4 * psi / n, grad_buffers=buckets,
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
    # Stage 3: params partitioned except small persistent ones; the working set is the layer in
    # flight plus the prefetch bucket (bounded by max_live_parameters); grads reduce through
    # the ipg bucket.
    # Persistent params are held whole *and* keep their 1/N `ds_tensor` partition (measured:
    # benchmarks/results/measured_model_states.json, zero3 vs zero3-nopersist).
    persist = _persistent_params(model, ds.param_persistence_threshold, layout.tp)
    live = min(ds.max_live_parameters, layer + min(ds.prefetch_bucket_size, layer))
    params = w * (persist + psi / n)
    # Stage 3 keeps one reduce bucket allocated across steps (measured: 1× reduce_bucket_size
    # elements, also with its default overlap_comm=True).
    buckets = ds.reduce_bucket_size * w
    mem = MemoryBreakdown(
        params=params, grads=w * psi / n, master_params=4 * psi / n, optimizer_states=os_ * psi / n,
        step_buffers=4 * psi / n, engine_buffers=w * live + buckets,
    )
    if s.offload_optimizer:
        host = HostBreakdown(
            grads=4 * psi / n * per_node, master_params=4 * psi / n * per_node,
            optimizer_states=os_ * psi / n * per_node,
        )
        mem = MemoryBreakdown(params=0 if s.offload_params else params, engine_buffers=w * live + buckets)
        if s.offload_params:
            host = HostBreakdown(params=w * psi / n * per_node, **{
                k: getattr(host, k) for k in ("grads", "master_params", "optimizer_states")})
    return mem, host


def _fsdp2(model, train, s: Strategy, layout, psi, n, per_node, c, os_, layer, mixed):
    """FSDP2 (`fully_shard` per decoder layer + root): sharded fp32 params and grads (mixed
    precision casts to `param_dtype` when it all-gathers), optimizer on the shards. Buffers:
    the unsharded c-byte params of the layer in flight and the prefetched one, and the layer's
    unsharded grads plus their `reduce_dtype` (fp32) copy for reduce-scatter
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). The root group (embeddings,
    final norm, lm_head) is not resharded after forward (root `reshard_after_forward` = False)."""
    w = 2 if train.precision == "bf16-pure" else 4
    root = psi - model.params_per_layer * -(-model.num_layers // layout.pp) / layout.tp
    reduce = s.fsdp.reduce_bytes(c) if mixed else w
    if s.reshard_after_forward:
        unsharded = c * (2 * layer + root)
    else:  # grad-op: every layer stays unsharded from its forward to its backward
        unsharded = c * psi
    # During backward, while the activations are still alive: a layer's unsharded grads and
    # their reduce_dtype copy for reduce-scatter, and lm_head's unsharded grad (its group, the
    # root, reduce-scatters only at the very end). With accumulation, sync is off on the other
    # micro-batches and every unsharded grad is held between them.
    lm_head = model.vocab_size * model.hidden_size / layout.tp
    rs = (c + reduce) * layer + c * lm_head
    held = c * psi if train.grad_accum > 1 else 0.0
    # The root's own reduce-scatter (embeddings, lm_head: often the largest group) runs at the
    # end of backward, when the activations are gone: a step-time transient, like the
    # optimizer's temporaries (it finishes before the step starts).
    root_rs = (c + reduce) * root
    mem = MemoryBreakdown(
        params=w * psi / n, grads=w * psi / n, optimizer_states=os_ * psi / n,
        step_buffers=max(_foreach_temp(train, psi / n), root_rs), engine_buffers=unsharded + held,
        grad_buffers=rs,
    )
    host = HostBreakdown()
    if s.offload_params:  # CPUOffloadPolicy: sharded params, grads and optimizer step on the CPU
        host = HostBreakdown(
            params=w * psi / n * per_node, grads=w * psi / n * per_node,
            optimizer_states=os_ * psi / n * per_node,
        )
        mem = MemoryBreakdown(engine_buffers=unsharded + held, grad_buffers=rs)
    return mem, host


def _lora(model, train, s: Strategy, layout, psi, n):
    """LoRA: frozen base weights in the compute dtype (sharded only by ZeRO-3/FSDP), trainable
    adapters r·(d_in + d_out) per targeted matrix with fp32 grads, master and Adam."""
    c = train.compute_bytes
    dims = {
        "q_proj": (model.hidden_size, model.q_dim), "k_proj": (model.hidden_size, model.kv_dim),
        "v_proj": (model.hidden_size, model.kv_dim), "o_proj": (model.q_dim, model.hidden_size),
        "gate_proj": (model.hidden_size, model.intermediate_size),
        "up_proj": (model.hidden_size, model.intermediate_size),
        "down_proj": (model.intermediate_size, model.hidden_size),
    }
    adapters = sum(train.lora_rank * sum(dims[t]) for t in train.lora_targets if t in dims)
    adapters = adapters * -(-model.num_layers // layout.pp) / layout.tp
    base_shard = n if s.shards_params else 1
    opt_shard = n if s.shards_optimizer else 1
    return MemoryBreakdown(
        params=c * psi / base_shard + 4 * adapters, grads=4 * adapters / opt_shard,
        optimizer_states=_optimizer_bytes(train) * adapters / opt_shard,
        engine_buffers=c * (model.params_per_layer / layout.tp) * 2 if s.shards_params else 0,
    ), HostBreakdown()


def runtime_overhead(layout: ParallelLayout, live_bytes: float) -> float:
    """CUDA context + one NCCL communicator per process group this rank is in + fragmentation."""
    groups = sum(d > 1 for d in (layout.dp_shard, layout.dp_replicate, layout.tp, layout.pp))
    return CUDA_CONTEXT + NCCL_PER_GROUP * groups + FRAGMENTATION * live_bytes


def plan_memory(
    model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
    accounting: Accounting = "engine", margin: float = DEFAULT_MARGIN,
) -> MemoryPlan:
    """Per-GPU (and per-host) memory of `strategy`, at the step's peak."""
    layout = ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
    layout.check_model(model)
    states, host = model_states(model, train, strategy, layout, accounting, hw.gpus_per_node)
    autocast = strategy.engine == "ddp" and train.precision in ("bf16-mixed", "fp16-mixed")
    acts = activation_bytes(model, train, layout.tp, layout.pp, autocast)
    recompute = recompute_bytes(model, train, layout.tp, autocast)
    if autocast:
        cached, recast = autocast_cache(model, train, layout)
        acts += cached
        recompute = max(0.0, recompute + recast)
    logits = logits_bytes(model, train, layout.tp)
    draft = replace(states, activations=acts, recompute=recompute, logits=logits,
                    grads_held=train.grad_accum > 1)
    gpu = replace(draft, runtime_overhead=runtime_overhead(layout, draft.total))
    return MemoryPlan(
        strategy=strategy, layout=layout, gpu=gpu, host=host, capacity_bytes=hw.gpu.memory_bytes,
        margin=margin, host_capacity_bytes=hw.host_memory_bytes,
    )
