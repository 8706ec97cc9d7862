"""Step time, priced op by op: GEMMs by a roofline at the GPU's sustained efficiency, attention
kernels, memory-bound work (norms, elementwise, the loss over the vocabulary, the optimizer
step, the engines' copies) by HBM bandwidth, the host's launch and hook costs per engine,
collectives per link level with latency, what each engine overlaps, offload transfers and
the CPU optimizer, the pipeline bubble. Pure functions; FLOPs for MFU from plan/flops.py (the
trainer's MFU uses the same function).

What the specs cannot say (how slow eager elementwise code is, what a launch or a hook costs,
how much compute hides communication) is `hw.timing` (specs/timing_model.py), each constant with
its provenance, and the GPUs' `*_efficiency`; `benchmarks/fit_timing.py` fits those that enough
cases inform and reports every figure held out (docs/accuracy.md). A hardware profile measured
on the user's machine replaces what it measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardwise.errors import ShardwiseError
from shardwise.plan import experts
from shardwise.plan.activations import attention_kind
from shardwise.plan.comm import CommBreakdown, fsdp_regathered
from shardwise.plan.context import hidden_share, imbalance, key_len, local_train
from shardwise.plan.flops import (
    attention_flops_per_token,
    forward_only_flops_per_token,
    run_flops_per_token,
    selective_recompute_params,
)
from shardwise.plan.fp8 import FP8_BYTES, cast_bytes, gathered_linear_bytes_saved, linear_share
from shardwise.plan.grad_sync import applies
from shardwise.plan.kernels import (
    DENSE_SQUARE,
    OPTIMIZER_BYTES,
    ce_chunks,
    elementwise_bytes,
    gemm_time,
    head_gemm_time,
    layer_gemms,
    loss_bytes_per_token,
    packing_bytes,
    update_bytes,
)
from shardwise.plan.lora import adapter_params, adapters, linear_weight_params
from shardwise.plan.memory import offloaded_activations
from shardwise.plan.memory_lora import NF4_BYTES
from shardwise.plan.network import comm_time, inter_bus
from shardwise.plan.optimizer import optimizer_bytes, paged_states
from shardwise.plan.pipeline import pipeline_idle
from shardwise.plan.stage import (
    FsdpUnits,
    busiest_layers,
    fsdp_units,
    fullest_rank,
    rank_layer_params,
    replica_params,
    strategy_ranks,
    tp_train,
    vocab_shards,
)
from shardwise.specs.hardware import HardwareSpec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.timing_model import TimingModel
from shardwise.specs.train import TrainSpec

# Byte counts of fixed algorithms (derived, not tunable): global-norm clipping reads the grads
# for the norm (4 B fp32) and scales them in place (read + write, 8 B).
CLIP_BYTES = 12
# Every other constant of the time model is data carried by the hardware spec (`hw.timing`, a
# shardwise.specs.timing_model.TimingModel; the bundled values and their provenance are
# catalog/timing.yaml, docs/accuracy.md).


@dataclass(frozen=True, slots=True)
class TimeBreakdown:
    compute_s: float  # GPU work of the step without communication (the parts below)
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    bubble_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    gemm_s: float = 0.0
    attention_s: float = 0.0
    memory_bound_s: float = 0.0  # norms, activations, residuals, RoPE, loss, engine copies
    optimizer_s: float = 0.0
    host_s: float = 0.0  # what the host adds to the GPU's work: launch gaps, hooks, bookkeeping

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s else 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self) | {"exposed_comm_fraction": self.exposed_fraction}


# ----------------------------------------------------------------------------- compute


def grad_pass_bytes(train: TrainSpec) -> float:
    """Bytes per parameter of the pass over every gradient before the step (`train.grad_pass`):
    clipping's CLIP_BYTES, torchtune's in-place scaling (read and write each gradient, in the
    gradients' dtype), nothing with the optimizer step in backward (`TrainSpec.grad_pass_run`)."""
    return {"clip": CLIP_BYTES, "scale": 2 * train.master_bytes, "none": 0.0}[train.grad_pass_run]


def _optimizer_bytes(train: TrainSpec, strategy: Strategy) -> float:
    """Bytes per parameter (of this GPU's shard) that the optimizer step moves, with the pass over
    the gradients before it."""
    b = update_bytes(train) + grad_pass_bytes(train)
    if strategy.engine == "deepspeed":  # grads to the fp32 partition, master back to 16-bit
        b += 2 * (train.compute_bytes + 4)
    return b


def optimizer_time(shard: float, train: TrainSpec, strategy: Strategy, hw: HardwareSpec) -> float:
    """The optimizer step over `shard` parameters on one GPU: its bytes at `hbm_efficiency` × HBM
    bandwidth, or, when a hardware profile measured an AdamW step rate (`gpu.adamw_params_per_s`
    with kernel `gpu.adamw_impl`), the update at that kernel's measured bandwidth (rate ×
    OPTIMIZER_BYTES of the kernel measured, so another kernel or precision scales by its bytes)
    and the rest (clipping, DeepSpeed's copies) by bytes as before."""
    gpu = hw.gpu
    bytes_s = gpu.hbm_bytes_per_s * gpu.hbm_efficiency
    if gpu.adamw_params_per_s is None or gpu.adamw_impl is None:
        return shard * _optimizer_bytes(train, strategy) / bytes_s
    update_bw = gpu.adamw_params_per_s * OPTIMIZER_BYTES[gpu.adamw_impl]
    rest = _optimizer_bytes(train, strategy) - update_bytes(train)
    return shard * (update_bytes(train) / update_bw + rest / bytes_s)


def optimizer_shard(model: ModelSpec, train: TrainSpec, s: Strategy, layout: ParallelLayout, psi: float) -> float:
    """Parameters whose optimizer state one GPU steps: the trainable ones (LoRA: the adapters) of
    its replica (the fullest pipeline rank's), over the data-parallel shard where the strategy
    shards the optimizer."""
    trainable = adapter_params(model, train, layout.tp, rank=fullest_rank(model, s, layout)) if train.lora_rank else psi
    n = layout.dp_shard
    if s.ep > 1 and not train.lora_rank:  # `psi` holds num_experts/ep experts, sharded over dp_shard/ep
        n = experts.state_shards(n, replica_params(model, s, layout), psi)
    return trainable / (n if s.shards_optimizer else 1)


def forward_share(train: TrainSpec) -> float:
    """The forward's share of a step's work: a third (backward is about twice the forward), a
    quarter with full recompute (the forward runs again inside backward)."""
    return 1 / 4 if train.checkpointing == "full" else 1 / 3


def pipeline_bubble(model: ModelSpec, train: TrainSpec, s: Strategy, layout: ParallelLayout) -> float:
    """The pipeline's idle time per unit of the busiest rank's work (0 at pp 1): the schedule's
    order simulated (plan.pipeline.pipeline_idle) with each stage's forward as long as its decoder
    layers and backward (1 − f)/f times that, f the forward's share (`forward_share`). Equal stages
    give (p − 1)/(m + p − 1) of the step for GPipe and 1F1B and (p − 1)/(v·m + p − 1) for
    interleaved 1F1B (Narayanan et al. 2021 §2.2), m = grad_accum. Measured on the trainer's
    pipeline on 2 gloo ranks (tests/accuracy/test_measured_pipeline.py)."""
    if layout.pp == 1:
        return 0.0
    layers = {st: len(held) for r in strategy_ranks(model, s, layout)
              for st, held in zip(r.stages, r.stage_layers, strict=True)}
    work = tuple(float(layers[st]) for st in range(len(layers)))
    f = forward_share(train)
    return pipeline_idle(s.pp_schedule, layout.pp, s.pp_virtual_stages, train.grad_accum, work, (1 - f) / f)


def _engine_copy_bytes(model: ModelSpec, train: TrainSpec, s: Strategy, layout: ParallelLayout,
                       psi: float) -> float:
    """Bytes per optimizer step the engine copies around its collectives (also at world size
    1: the all-gather and reduce-scatter buffers are filled and drained by copy kernels).
    FSDP2: copy-in (cast to param dtype) and copy-out of every gather, chunk_cat of the grads
    into the reduce dtype (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py);
    ZeRO: gathers into new buffers, grads through the reduce bucket into the partition;
    DDP under autocast: the weights cast per forward and the fp32 grad accumulation."""
    c, k, n = train.compute_bytes, train.grad_accum, max(layout.dp_shard, 1)
    rank = fullest_rank(model, s, layout)
    layers = rank_layer_params(model, rank) / layout.tp
    if s.engine == "fsdp2":
        reduce = s.fsdp.reduce_bytes(c) if train.mixed_precision else c
        gathered = psi + fsdp_regathered(s, rank, fsdp_units(model, s, layout, rank, psi, layers,
                                                             model.params_per_layer / layout.tp))
        reductions = k if (s.fsdp.reduce_every_micro_batch or k == 1) else 1
        accumulate = (k - reductions) * (c + 2 * reduce + c)  # upcast + add while sync is off
        return k * gathered * ((4 + c) / n + 2 * c) + psi * (reductions * (c + reduce + 8 / n) + accumulate)
    if s.zero_impl == "megatron":
        # wgrads accumulate into the gradient buffer (gradient-accumulation fusion); after the step
        # each rank casts its updated fp32 shard into the module's buffer (fp8 linears' weights
        # under --fp8-param-gather: one byte written)
        return (psi * (4 + c) - gathered_linear_bytes_saved(c, train) * linear_share(model, rank, layout.tp)[0]) / n
    if s.engine == "deepspeed":
        if s.zero_stage == 3:
            passes = train.layer_passes
            return k * psi * (passes * (c + c / n) + 2 * c + 2 * c / n)
        reductions = k if s.zero_stage == 2 else 1
        return psi * (reductions * (2 * c + 2 * c / n) + c + c / n)
    # LoRA's frozen base is stored in the compute dtype: autocast has nothing to cast
    autocast = train.autocasts(s.engine)
    passes = train.layer_passes - 1  # the forward, and its recompute under full checkpointing
    cast = k * psi * (passes * (4 + c) + (c + 8)) if autocast else 0.0
    bucket = 0.0 if s.ddp.gradient_as_bucket_view or not s.ddp.wrapped(layout.dp_replicate) else 2 * 4 * psi
    return cast + bucket


@dataclass(frozen=True, slots=True)
class ComputeTime:
    gemm_s: float
    attention_s: float
    memory_bound_s: float
    optimizer_s: float
    launch_s: float  # GPU idle between short kernels
    hooks_s: float  # the engine's Python hooks: the CPU runs ahead of the GPU through them
    serial_s: float  # host work the GPU always waits for (DeepSpeed's step bookkeeping)

    @property
    def gpu_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_bound_s + self.optimizer_s

    @property
    def wall_s(self) -> float:
        """A step is GPU-bound or hook-bound, whichever is longer, plus the serial host work."""
        return max(self.gpu_s + self.launch_s, self.hooks_s) + self.serial_s


def compute_time(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, s: Strategy,
                 layout: ParallelLayout, psi: float, forward_only: float = 0.0) -> ComputeTime:
    """GPU time of one optimizer step on one GPU (its TP shard and PP stage), without
    communication, and the host time the GPU waits for (launch gaps, hooks). `train` is the
    batch as one forward sees it (TrainSpec.as_sequences); `forward_only`: sequences run forward
    without gradients per trained sequence (a preference objective's reference:
    TrainSpec.forward_only_share), priced as one more forward pass of each part over them."""
    gpu, tm = hw.gpu, hw.timing
    c = train.compute_bytes
    flops_s = gpu.peak_flops(train.compute_dtype) * gpu.gemm_efficiency
    bytes_s = gpu.hbm_bytes_per_s * gpu.hbm_efficiency
    tp, pp, k = layout.tp, layout.pp, train.grad_accum
    vocab_tp = vocab_shards(s, tp)  # lm_head and the loss: whole on every TP rank under AutoTP
    tokens = train.micro_batch * train.seq_len
    layers = busiest_layers(model, s, layout)  # the pipeline rank with the most decoder layers
    # replayed in backward: full checkpointing replays the whole forward; torchtitan's per-op
    # selective policy keeps SDPA's output and every other matmul's, replaying the rest
    recompute = {"full": 1.0, "selective": 1.0, "none": 0.0}[train.checkpointing]

    # GEMMs: forward, input-gradient and weight-gradient (+ the recomputed forward)
    ep, etp = s.ep, s.expert_tp
    shapes = layer_gemms(model, tp, ep, etp)
    # fp8 linears (plan/fp8.py): the layers' GEMMs at the FP8 peak, on 1-byte operands
    linear_flops_s, linear_c = ((gpu.peak_flops("fp8") * gpu.gemm_efficiency, FP8_BYTES) if train.fp8 != "none"
                                else (flops_s, c))
    layer_t = sum(gemm_time(tokens * share, kk, nn, linear_flops_s, bytes_s, linear_c) for kk, nn, share in shapes)
    approx = sum(kk * nn * share for kk, nn, share in shapes)
    if ep > 1:  # the busiest expert-parallel rank runs ep_load_imbalance × the balanced routed tokens
        layer_t += (s.ep_load_imbalance - 1) * sum(
            gemm_time(tokens * share, kk, nn, linear_flops_s, bytes_s, linear_c)
            for kk, nn, share in experts.expert_gemms(model, tp, ep, etp))
    exact = _matmul_params_per_layer(model) / tp
    layer_t *= exact / approx if approx else 1.0
    replay_mm = recompute
    if train.checkpointing == "selective":
        replay_mm = selective_recompute_params(model) / tp / exact if exact else 0.0
    # LoRA: the base is frozen, so no weight-gradient GEMMs (forward + input-gradient only);
    # the adapters' own GEMMs are r-wide, bandwidth-bound on the activations they read
    passes = 2 if train.lora_rank else 3
    gemm = k * ((passes + replay_mm) * layer_t * layers + head_gemm_time(model, train, vocab_tp, flops_s, bytes_s) / pp)
    # the no-grad forwards: one pass of the layers' GEMMs, lm_head's forward GEMM alone
    gemm += k * forward_only * (layer_t * layers + gemm_time(tokens, model.hidden_size, model.vocab_size / vocab_tp,
                                                             flops_s, bytes_s, c) / pp)
    if train.lora_rank:
        for d_in, d_out in _lora_dims(model, train, tp):
            gemm += k * layers * (3 + replay_mm) * (
                gemm_time(tokens, d_in, train.lora_rank, flops_s, bytes_s, c)
                + gemm_time(tokens, train.lora_rank, d_out, flops_s, bytes_s, c))

    # attention kernels (causal, flash/SDPA): the model FLOPs of scores and values (flops.py);
    # under context parallelism a rank's queries attend over the whole sequence (plan/context.py)
    # (the busiest rank's, where consecutive chunks leave the last rank the most)
    attn_flops = attention_flops_per_token(model, key_len(train, layout.cp)) / model.num_layers / tp * tokens * layers
    attn_flops *= imbalance(layout.cp, s.cp_scheme, s.cp_load_balance)
    attn_eff = gpu.attention_efficiency_of(train.attention)
    replay_attn = 1.0 if train.checkpointing == "full" else 0.0
    attention = k * attn_flops * (1 + replay_attn / 3 + forward_only / 3) / (gpu.peak_flops(train.compute_dtype) * attn_eff)
    eager = attention_kind(model, train) == "eager"
    attention *= DENSE_SQUARE if train.packed_attention == "dense" and not eager else 1.0
    mem = k * layers * packing_bytes(model, train, tp, eager, replay_attn)  # the dense mask's reads, or varlen's copy
    if train.attention == "eager":  # scores materialised: softmax in fp32, its backward, casts
        scores = model.num_heads / tp * tokens * train.seq_len * layers
        mem += k * scores * (3 * c + 24) * (1 + replay_attn / 3)

    autocast = train.autocasts(s.engine)
    factor = tm.fused_elementwise_factor if train.fused_kernels else tm.elementwise_factor
    per_token = elementwise_bytes(model, train, autocast, tp) * (3 + recompute + forward_only) * factor
    mem += k * tokens * (per_token * layers + loss_bytes_per_token(model, train, vocab_tp) * factor / pp)
    fp8_params = s.zero_impl == "megatron" and train.fp8_all_gather  # --fp8-param-gather (plan/memory.py)
    sharded_cast = s.engine == "fsdp2" or fp8_params
    mem += cast_bytes(model, train, tp, layers, layout.dp_shard if sharded_cast else 1, s.ep, s.expert_tp,
                      fp8_params=fp8_params) * factor
    copies = _engine_copy_bytes(model, train, s, layout, psi)
    if train.lora_rank:  # frozen base: gathered as stored (no cast), only adapter grads reduced
        copies *= tm.lora_copy_share
    mem += copies * (tm.fsdp2_copy_exposed if s.engine == "fsdp2" else 1.0)
    if train.base_quant == "nf4":  # QLoRA: each 4-bit weight is dequantised to c bytes in every pass
        passes_q = train.layer_passes
        mem += k * passes_q * linear_weight_params(model, tp, pp, s.pp_virtual_stages if pp > 1 else 1) * (NF4_BYTES + c)
    memory_bound = mem / bytes_s

    shard = optimizer_shard(model, train, s, layout, psi)
    optimizer = 0.0 if s.offload_optimizer else optimizer_time(shard, train, s, hw)

    # host: launch gaps, and the engines' Python hooks (they wait on their collectives' streams)
    kernels = k * layers * tm.kernels_per_layer * (1 + (recompute + forward_only) / 3) * (
        tm.fused_kernel_share if train.fused_kernels else 1)
    kernels += k * (tm.step_kernels + tm.ce_kernels_per_chunk * ce_chunks(train))
    if train.grad_pass_run == "scale":  # torchtune's scale_grads: one mul_ a tensor
        kernels += len(model.hf_order) / pp
    if train.optimizer_impl == "forloop":
        kernels += tm.forloop_kernels_per_tensor * len(model.hf_order) / pp
    elif train.optimizer_in_backward:  # one optimizer per tensor (the trainer's InBackwardAdamW): the fused
        # kernel launched per tensor, the foreach ops once per tensor each, instead of once over all tensors
        per_tensor = 1 if train.optimizer_impl == "fused" else tm.forloop_kernels_per_tensor
        kernels += per_tensor * len(model.hf_order) / pp
    launch = kernels * tm.launch_s
    passes = 2 + recompute + forward_only  # the reference's forward runs its own engine's hooks
    hooks = serial = 0.0
    if s.engine == "fsdp2":  # each unit's hooks wait on its all-gather / reduce-scatter streams
        serial = k * _fsdp_rank_units(model, s, layout, psi).count(layers, 1) * passes * 2 * tm.fsdp2_hook_s
    elif s.engine == "deepspeed" and s.zero_impl == "deepspeed":
        # (Megatron's distributed optimizer: its per-parameter grad hooks only mark buckets ready,
        # not priced, assumed)
        serial = tm.deepspeed_step_s
        if s.zero_stage in (1, 2):
            serial += k * len(model.hf_order) / pp * tm.zero12_hook_s  # grad hooks copy on the main stream
        if s.zero_stage == 3:
            hooks = k * passes * zero3_hook_s(model, s.ds, tp, tm)
    return ComputeTime(gemm, attention, memory_bound, optimizer, launch, hooks, serial)


# Modules of an HF decoder-only model that hold no parameter tensor of the spec but are modules
# all the same (ZeRO-3 hooks every module): per layer the decoder layer, its attention and MLP
# containers and the MLP's activation; around the layers the CausalLM, its inner model, the layer
# list and the rotary embedding. Counted on HF Llama/Qwen2/Mistral (transformers 5); the running
# engine's count is checked against this in tests/run/test_run_bridge.py.
CONTAINERS_PER_LAYER = 4
CONTAINERS_OUTSIDE_LAYERS = 4


def _fsdp_rank_units(model: ModelSpec, s: Strategy, layout: ParallelLayout, psi: float) -> FsdpUnits:
    """The FSDP2 units of the pipeline rank with the most parameters (the embedding and head
    units `fsdp.wrap_embeddings` carves add hooks and gathers; other engines carve nothing)."""
    rank = fullest_rank(model, s, layout)
    return fsdp_units(model, s, layout, rank, psi, rank_layer_params(model, rank) / layout.tp,
                      model.params_per_layer / layout.tp)


def zero3_hooked_modules(model: ModelSpec, ds, tp: int) -> int:
    """Modules DeepSpeed ZeRO-3 installs fetch/release hooks on: every module of the model (its
    parameter-holding modules from the spec's tensors, plus the containers above), or only the
    layer itself when layers are leaves (DeepSpeedKnobs.fetch_unit)."""
    layer_mods = sum(t.count for t in model.tensors if t.count >= model.num_layers) / model.num_layers
    outside = sum(1 for t in model.tensors if t.count < model.num_layers)
    if model.tie_embeddings and not any(t.name == "lm_head" for t in model.tensors):
        outside += 1  # a tied lm_head is still a module
    per_layer = 1 if ds.zero3_unit(model.params_per_layer / tp) == "layer" else round(layer_mods) + CONTAINERS_PER_LAYER
    return model.num_layers * per_layer + outside + CONTAINERS_OUTSIDE_LAYERS


def zero3_hook_s(model: ModelSpec, ds, tp: int, tm: TimingModel) -> float:
    """Host time of ZeRO-3's hooks in one pass over the model: per hooked module and per
    parameter tensor fetched (the same under either fetch unit)."""
    return (zero3_hooked_modules(model, ds, tp) + tm.zero3_tensor_share * len(model.hf_order)) * tm.zero3_hook_s


def _lora_dims(model: ModelSpec, train: TrainSpec, tp: int) -> list[tuple[float, float]]:
    """(d_in, d_out) of each adapter GEMM pair of one layer, as PEFT places them (plan/lora.py);
    an expert adapter counts once per expert (each sees its share of tokens: priced as one)."""
    out = []
    for a in adapters(model, train.lora_targets, model.is_moe):
        out += [(a.d_in / tp, a.d_out / tp)] * a.rank
    return out


def _matmul_params_per_layer(model: ModelSpec) -> float:
    """Parameters of one decoder layer that a token multiplies through (MoE: its top-k
    experts, the router, shared experts), i.e. FLOPs/(2 tokens); norms excluded."""
    matmul = model.active_params - model.embedding_params  # lm_head is priced apart
    norms = 2 * model.hidden_size * model.num_layers + model.hidden_size
    return max(0.0, (matmul - norms) / model.num_layers)


# ----------------------------------------------------------------------------- communication


def _above_peak(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, tps: float,
                mfu: float) -> ShardwiseError:
    """MFU above 100% cannot happen: the step is priced at most at the GPU's peak. It would mean
    the inputs disagree (a rate above the peak it is a fraction of, a FLOP count that is not
    the one the step is priced with): refused, naming them, instead of printing it."""
    gpu, dtype = hw.gpu, train.compute_dtype
    kinds = {k: p.kind for k, p in gpu.efficiency_provenance.items()}
    effs = ", ".join(f"{k} {getattr(gpu, k):.3g} ({kinds.get(k, 'catalog')})"
                     for k in ("gemm_efficiency", "attention_efficiency", "hbm_efficiency"))
    return ShardwiseError(
        f"{strategy.name} on {gpu.name}: the planned step runs at MFU {mfu:.0%}, above 100% "
        f"({run_flops_per_token(model, train):.3g} model FLOPs per token × {tps:.4g} tokens/s per GPU against a "
        f"{dtype} peak of {gpu.peak_flops(dtype):.3g} FLOP/s): the inputs are inconsistent: the GPU's {dtype} peak "
        f"({dtype}_flops), its efficiencies ({effs}) and the model's FLOP count ({model.name}) cannot all be "
        "right; check a hardware profile's rates against the peak they are relative to")


def step_time(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
              layout: ParallelLayout, comm: CommBreakdown) -> TimeBreakdown:
    if train.checkpointing == "auto":
        raise ValueError("checkpointing 'auto' is decided first (plan.evaluate.checkpointing_choice)")
    if applies(strategy, train.for_engine(strategy.engine)) and strategy.fsdp.reduce_every_micro_batch == "auto":
        raise ValueError(f"{strategy.name}: reduce_every_micro_batch 'auto' is decided first (plan.evaluate.resolved)")
    # as its engine runs it; without sequence parallelism where its TP has none
    train = tp_train(train.for_engine(strategy.engine), strategy)
    forward_only = train.forward_only_share  # a preference objective's no-grad forwards (plan/preference.py)
    extra_flops = forward_only_flops_per_token(model, train)
    whole = train.as_sequences()  # a forward's batch: 2 sequences per example for the paired objectives
    train = local_train(whole, layout.cp)  # context parallelism: a rank's seq/cp tokens (plan/context.py)
    tokens = train.micro_batch * train.seq_len * train.grad_accum  # per DP replica (cp rank) per step
    psi = replica_params(experts.rank_model(model, strategy), strategy, layout)  # experts held
    ct = compute_time(model, hw, train, strategy, layout, psi, forward_only)
    compute = ct.gpu_s
    work = ct.wall_s  # GPU-bound or hook-bound: the window collectives can hide in
    # forward is about a third of the work (a quarter with full recompute)
    fwd = work * forward_share(train)
    bwd = work - fwd
    comm_s = comm_time(comm, hw, layout)
    # one per decoder layer and each stage's root group, on the pipeline rank with the most layers
    units = _fsdp_rank_units(model, strategy, layout, psi).count(
        busiest_layers(model, strategy, layout), strategy.pp_virtual_stages if layout.pp > 1 else 1)
    exposed = min(comm_s, _exposed(strategy, train, comm_s, fwd, bwd, comm, hw.timing, units))
    # TP all-reduces stay inside the node (TP ranks are packed on NVLink); PP sends cross
    # nodes when the stages do. Both sit on the critical path.
    blocking = blocking_exposed = 0.0
    if comm.blocking:
        tp_bytes = comm.blocking - comm.p2p - comm.all_to_all
        tp_s = 0.0
        if layout.tp > 1:
            tp_s = tp_bytes * (layout.tp - 1) / layout.tp / hw.intra.bus_bytes_per_s
        p2p_s = 0.0
        if comm.p2p:
            stages_span_nodes = layout.tp * layout.pp > hw.gpus_per_node and hw.nodes > 1
            link = hw.inter if stages_span_nodes else hw.intra
            p2p_s = comm.p2p / link.bus_bytes_per_s
        latency = comm.blocking_calls * hw.intra.latency_s  # the DP calls' latency is in comm_time
        # expert parallelism's dispatch/combine all-to-alls, on the link their group spans (plan/experts.py)
        a2a_s = experts.a2a_time(comm.all_to_all, strategy.ep, hw, strategy.expert_tp)
        blocking = tp_s + p2p_s + a2a_s + latency
        # overlapped TP collectives (Megatron's --tp-comm-overlap, async TP) hide behind the GEMMs
        # they feed, as well as compute hides any collective (overlap_efficiency)
        hidden = min(tp_s, hw.timing.overlap_efficiency * ct.gemm_s) if train.tp_comm_overlap else 0.0
        if strategy.ep_overlap:  # experts.a2a_hidden: behind another micro-batch's compute
            hidden += experts.a2a_hidden(a2a_s, hw.timing.overlap_efficiency * ct.wall_s - hidden, train.grad_accum)
        blocking_exposed = blocking - hidden
    comm_s += blocking
    exposed += blocking_exposed
    if comm.context:  # context parallelism's K/V exchange, against the attention it overlaps
        cp_s = _context_time(comm, hw, layout)
        comm_s += cp_s
        exposed += cp_s - min(cp_s, hw.timing.overlap_efficiency * ct.attention_s
                              * hidden_share(model, train, layout.cp, strategy.cp_scheme))
    offload = _offload_time(model, hw, strategy, layout, comm, train) + _saver_copies(model, hw, train, strategy, layout, psi, work, bwd)
    bubble = work * pipeline_bubble(model, train, strategy, layout)
    step = work + exposed + offload + bubble
    share = layout.tp * layout.pp  # the replica's work is split over its TP × PP GPUs
    tps = tokens / share / step
    # MFU counts the no-grad forwards' model FLOPs too: the GPU runs them in the step
    # (of the compute dtype's peak, as torchtitan and Megatron-LM report fp8 runs: their fp8
    # GEMMs can pass it, but not the FP8 peak)
    mfu = (run_flops_per_token(model, whole) + extra_flops) * tps / hw.gpu.peak_flops(train.compute_dtype)
    ceiling = hw.gpu.peak_flops("fp8") / hw.gpu.peak_flops(train.compute_dtype) if train.fp8 != "none" else 1.0
    if mfu > ceiling:
        raise _above_peak(model, hw, train, strategy, tps, mfu)
    return TimeBreakdown(compute, comm_s, exposed, offload, bubble, step, tps, mfu,
                         ct.gemm_s, ct.attention_s, ct.memory_bound_s, ct.optimizer_s,
                         work - compute)


def _context_time(comm: CommBreakdown, hw: HardwareSpec, layout: ParallelLayout) -> float:
    """The K/V exchange of a cp group: on NVLink while cp × tp GPUs fit a node (torchtitan's mesh
    puts cp inside dp_shard, next to tp), else at one GPU's share of the NICs."""
    inside = layout.cp * layout.tp <= hw.gpus_per_node or hw.nodes == 1
    bus = hw.intra.bus_bytes_per_s if inside else inter_bus(hw, 1)
    latency = hw.intra.latency_s if inside else hw.inter.latency_s
    return comm.context / bus + comm.context_calls * latency


def _exposed(s: Strategy, train: TrainSpec, comm_s: float, fwd: float, bwd: float,
             comm: CommBreakdown, tm: TimingModel, units: int) -> float:
    """What compute cannot hide. DDP/ZeRO-0/1/2 reduce gradient buckets during backward (the
    last bucket is exposed) and ZeRO-1/2 all-gather the updated params after the step
    (exposed). ZeRO-3/FSDP prefetch the next unit's all-gather during forward and backward and
    reduce-scatter during backward; the first of the `units` gathers of each pass is exposed.

    DeepSpeed ZeRO-1/2/3 overlap only with `overlap_comm` (DeepSpeed's default: stage 3 only).
    Without it ZeRO-2 reduces each bucket in the backward hooks on the compute stream
    (stage_1_and_2.py `average_tensor` / `allreduce_and_copy`: `current_stream()` instead of
    `reduction_stream`), ZeRO-1 reduces at the boundary after backward (`process_gradients`
    reduces in the hooks only with partition_gradients or overlap_comm; the engine then calls
    `reduce_gradients`, which walks every gradient), and ZeRO-3 runs both its reduce-scatters and
    its parameter all-gathers on the default stream (stage3.py `reduce_and_partition_stream`,
    parameter_offload.py `__allgather_stream`); deepspeedai/DeepSpeed@edaa722. Nothing hides then:
    every collective is on the critical path. Stage 0 (no ZeRO) never overlaps: the engine
    all-reduces every gradient bucket after backward returns, at the accumulation boundary
    (engine.py `backward` → `allreduce_gradients` → `buffered_allreduce_fallback`), whatever
    overlap_comm says. Megatron-Core's distributed optimizer (zero_impl megatron) overlaps as
    `ds.overlap_comm` says, read as `--overlap-grad-reduce --overlap-param-gather`: its
    reduce-scatter with the last micro-batch's backward, its param all-gather with the next step's
    first forward (exposed without them, its default)."""
    if comm_s == 0:
        return 0.0
    if s.engine == "deepspeed" and (s.zero_stage == 0 or not s.ds.overlap(s.zero_stage)):
        return comm_s
    total = (comm.total - comm.blocking - comm.context) or 1.0
    hide = tm.overlap_efficiency
    if s.shards_params:
        ag_share = comm.all_gather / total
        fwd_comm = comm_s * ag_share / (2 if s.zero_equivalent == 3 else 1)
        bwd_comm = comm_s - fwd_comm
        return max(0.0, fwd_comm - hide * fwd) + max(0.0, bwd_comm - hide * bwd) + comm_s / units
    ag_after_step = comm_s * (comm.all_gather / total)
    reduce = comm_s - ag_after_step
    # with accumulation DDP/ZeRO-1 only reduce in the last micro-batch's backward
    window = bwd / train.grad_accum if not s.shards_grads else bwd
    if s.zero_impl == "megatron":
        # --overlap-param-gather: each bucket's all-gather runs ahead of the next step's forward
        # of its layers (the first micro-batch's), the first bucket exposed as the first unit is
        ag_after_step = max(0.0, ag_after_step - hide * fwd / train.grad_accum) + ag_after_step / units
    return max(0.0, reduce - hide * window) + reduce * tm.exposed_reduce_share + ag_after_step


def _saver_copies(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, s: Strategy, layout: ParallelLayout,
                  psi: float, work: float, bwd: float) -> float:
    """What the memory savers' host copies add to the step. Activation offloading copies each
    micro-batch's offloaded tensors to the host in forward and back in backward on a side stream
    beside the compute (torchtune's OffloadActivations): the PCIe time exposed only past what the
    step's work hides, but the copies' HBM side (each byte read once going out, written once coming
    back) taken from the compute's own bandwidth, never hidden (torchtune's ladder measured −0.11%
    tokens/s for it on one A100: README, 'Optimization flags'). bitsandbytes' paged states are
    taken as paged out and back in every step (an upper bound: the GPU's free memory keeps some
    resident); with the step in backward the paging overlaps backward, else it follows it."""
    tm = hw.timing
    out = 0.0
    if train.activation_offload:
        moved = offloaded_activations(model, train, s, layout) * train.grad_accum
        out += max(0.0, 2 * moved / hw.pcie_bytes_per_s - tm.overlap_efficiency * work)
        out += 2 * moved / (hw.gpu.hbm_bytes_per_s * hw.gpu.hbm_efficiency)
    if paged_states(train):
        paging = 2 * optimizer_bytes(train) * optimizer_shard(model, train, s, layout, psi) / hw.pcie_bytes_per_s
        out += max(0.0, paging - tm.overlap_efficiency * (bwd if train.optimizer_in_backward else 0.0))
    return out


def _offload_time(model, hw, s: Strategy, layout, comm: CommBreakdown, train: TrainSpec) -> float:
    """PCIe transfers (grads down, params up; full offload streams params every pass) plus the
    optimizer step on the host over this node's partitions: DeepSpeed's CPU Adam for ZeRO
    offload, torch's AdamW on CPU tensors for FSDP2's CPUOffloadPolicy."""
    if not (s.offload_optimizer or s.offload_params):
        return 0.0
    per_node = min(layout.world_size, hw.gpus_per_node)
    pcie = comm.pcie / hw.pcie_bytes_per_s
    trainable = adapter_params(model, train, layout.tp, rank=fullest_rank(model, s, layout)) if train.lora_rank \
        else replica_params(model, s, layout)
    params_on_node = trainable / max(layout.dp_shard, 1) * per_node
    rate = hw.timing.host_adam_params_per_s if s.engine == "deepspeed" else hw.timing.host_torch_adam_params_per_s
    return pcie + params_on_node / rate
