"""Communication per GPU per optimizer step: bytes by collective and by link. Pure functions.

Counting unit (shared with the measurement in tests/accuracy/test_measured_comm.py): all_reduce = bytes
of the tensors all-reduced; all_gather = bytes of the gathered output; reduce_scatter = bytes
of the full input; broadcast, p2p (send + recv), all_to_all = bytes sent. `total` is the ring
traffic volume 2·AR + AG + RS + the rest, so that DDP = 2Ψ and ZeRO-3 = 3Ψ elements (ZeRO paper).

Two levels: `ideal_comm` is the ZeRO paper's; `plan_comm` is what the installed engines ask
for (docs/comm-measured.md has the source references and the 2-rank gloo counts).

LoRA (`train.lora_rank > 0`): only the adapters (plan/lora.py) have gradients, so only they
are reduced (and all-gathered after the ZeRO-1/2 step); ZeRO-3 and FSDP still gather the frozen
base weights in forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from shardwise.plan import experts
from shardwise.plan.activations import input_linears
from shardwise.plan.context import exchange_bytes, exchanges_per_layer, local_train
from shardwise.plan.fp8 import gathered_linear_bytes_saved, linear_share
from shardwise.plan.grad_sync import applies
from shardwise.plan.lora import adapter_params, adapter_tensors
from shardwise.plan.memory_lora import nf4_gathered_saving
from shardwise.plan.pipeline import PipelineRank
from shardwise.plan.preference import no_grad_forwards, no_grad_gather_bytes
from shardwise.plan.stage import (
    FsdpUnits,
    busiest_layers,
    fsdp_units,
    fullest_rank,
    persistent_params,
    rank_layer_params,
    replica_params,
    strategy_ranks,
    tp_train,
)
from shardwise.specs.hardware import HardwareSpec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "p2p", "all_to_all")
MOVED = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "intra", "inter")  # the data-parallel volumes


@dataclass(frozen=True, slots=True)
class CommBreakdown:
    all_reduce: float = 0.0
    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    reduce: float = 0.0  # reduce-to-owner (DeepSpeed ZeRO-1/2 without multi-rank bucket all-reduce)
    broadcast: float = 0.0
    p2p: float = 0.0
    all_to_all: float = 0.0
    # ring traffic volume by the link it crosses, and host<->GPU bytes for offload
    intra: float = 0.0
    inter: float = 0.0
    pcie: float = 0.0
    calls: int = 0  # data-parallel collective launches per step (their latency: plan/network.comm_time)
    blocking: float = 0.0  # volume on the critical path (TP all-reduces, PP sends): never overlapped
    blocking_calls: int = 0  # the launches of that volume (their latency is on the critical path too)
    # context parallelism's K/V exchange (plan/context.py): bytes each rank receives, and its
    # launches; priced apart, against the attention it overlaps (timing.step_time)
    context: float = 0.0
    context_calls: int = 0

    @property
    def total(self) -> float:
        return (2 * self.all_reduce + self.all_gather + self.reduce_scatter + self.reduce + self.broadcast
                + self.p2p + self.all_to_all + self.context)

    def as_dict(self) -> dict[str, float]:
        d = {k: getattr(self, k) for k in KINDS}
        d.update(intra=self.intra, inter=self.inter, pcie=self.pcie, blocking=self.blocking, calls=self.calls,
                 blocking_calls=self.blocking_calls, context=self.context, context_calls=self.context_calls,
                 total=self.total)
        return d

    def __add__(self, other: CommBreakdown) -> CommBreakdown:
        return CommBreakdown(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def ideal_comm(psi: float, strategy: Strategy, bytes_per_elem: float = 2) -> CommBreakdown:
    """ZeRO paper §7: DDP, ZeRO-1, ZeRO-2 move 2Ψ per step (reduce-scatter + all-gather), ZeRO-3
    and full-shard FSDP 3Ψ (all-gather in forward and backward + reduce-scatter)."""
    b = bytes_per_elem * psi
    full_shard = strategy.zero_equivalent == 3
    if not strategy.shards_optimizer:  # DDP, ZeRO-0: all-reduce
        return CommBreakdown(all_reduce=b)
    return CommBreakdown(all_gather=2 * b if full_shard else b, reduce_scatter=b)


def _dp_link(hw: HardwareSpec, layout: ParallelLayout, group: int) -> str:
    """A DP group of `group` ranks spans nodes when it needs more GPUs than a node offers
    (TP ranks are packed inside the node first)."""
    per_node_dp = max(1, hw.gpus_per_node // layout.tp)
    return "inter" if group > per_node_dp and hw.nodes > 1 else "intra"


def _on(link: str, volume: float) -> dict:
    return {link: volume}


def plan_comm(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
              layout: ParallelLayout | None = None) -> CommBreakdown:
    """Bytes each GPU asks collectives to move per optimizer step, as the engines do it."""
    if applies(strategy, train.for_engine(strategy.engine)) and strategy.fsdp.reduce_every_micro_batch == "auto":
        raise ValueError(f"{strategy.name}: reduce_every_micro_batch 'auto' is decided first (plan.evaluate.resolved)")
    layout = layout or ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
    train = tp_train(train, strategy)
    rank = fullest_rank(model, strategy, layout)
    # expert parallelism: a rank holds (gathers, reduces) num_experts/ep experts, reduced over the
    # dp/ep expert-data-parallel ranks (plan/experts.py); the rest as before
    dp_model = experts.rank_model(model, strategy)
    psi = replica_params(dp_model, strategy, layout, rank)
    k = train.grad_accum
    c = train.compute_bytes
    out = _dp_comm(dp_model, train, strategy, layout, hw, psi, k, c, rank)
    if (moved := experts.dp_moved_share(model, strategy, layout, rank, psi)) < 1.0:  # dp = ep: experts stay put
        out = CommBreakdown(**{f.name: getattr(out, f.name) * (moved if f.name in MOVED else 1)
                               for f in fields(out)})
    ref = no_grad_gather_bytes(model, train, strategy, layout, psi)
    if ref:  # a preference objective's no-grad forwards through a sharded model (plan/preference.py)
        link = "intra" if strategy.fsdp_sharding == "hybrid" else _dp_link(hw, layout, layout.dp)
        calls = k * no_grad_forwards(train) * (len(rank.layers) + 1)  # a gather per layer and the root's
        out = out + CommBreakdown(all_gather=ref, calls=calls, **_on(link, ref))
    # the TP/PP activations of a forward's batch: 2 sequences per example for the paired objectives;
    # with context parallelism, of the rank's seq/cp tokens, and the K/V its attention exchanges
    seq = local_train(train.as_sequences(), layout.cp)
    out = out + _tp_pp_comm(model, seq, strategy, layout, k, c)
    if layout.cp > 1:
        out = out + _context_comm(model, seq, strategy, layout, k)
    a2a, calls = experts.a2a_step(model, seq, strategy, rank)
    if a2a:  # dispatch and combine: on the critical path, priced apart (timing.step_time)
        out = out + CommBreakdown(all_to_all=a2a, blocking=a2a, blocking_calls=calls)
    return out


def _context_comm(model, train, s: Strategy, layout, k) -> CommBreakdown:
    """The K/V exchange of context parallelism on the pipeline rank with the most layers
    (plan/context.py): the forward's again in a fully recomputed forward."""
    fwd, bwd = exchange_bytes(model, train, layout.cp, s.cp_scheme, layout.tp)
    fwd_calls, bwd_calls = exchanges_per_layer(model, train, layout.cp, s.cp_scheme)
    forwards = 2 if train.checkpointing == "full" else 1
    layers = busiest_layers(model, s, layout) * k
    return CommBreakdown(context=layers * (forwards * fwd + bwd), context_calls=layers * (forwards * fwd_calls + bwd_calls))


def _dp_comm(model, train, s: Strategy, layout, hw, psi, k, c, rank: PipelineRank) -> CommBreakdown:
    """Data-parallel traffic of one GPU of pipeline rank `rank` (the fullest). `psi` is the
    replica's parameters (what ZeRO-3/FSDP gather); with
    LoRA (train.lora_rank > 0) only the adapters are trainable: the engines reduce only their
    gradients (DDP and DeepSpeed bucket only parameters that require grad, FSDP2 reduce-scatters
    only the gradients that exist) and ZeRO-1/2 all-gather only the updated adapters, while
    ZeRO-3/FSDP still gather the frozen base weights in forward and backward."""
    n = layout.dp_shard
    if layout.dp == 1:
        return CommBreakdown()
    link = _dp_link(hw, layout, layout.dp)
    lora = train.lora_rank > 0
    adapters = adapter_params(model, train, layout.tp, rank=rank)
    trained = adapters if lora else psi  # parameters whose gradients are reduced
    if not s.shards_optimizer:
        # DDP reduces fp32 grads once per step (no_sync on the other micro-batches; autocast keeps
        # fp32 grads; PEFT keeps adapters in fp32); DeepSpeed stage 0 all-reduces at the
        # accumulation boundary, in the module's dtype.
        if s.engine == "ddp":
            g = 4 if lora else train.master_bytes
        else:
            g = s.ds.reduce_bytes(c)
        ar = g * trained
        bucket = s.ddp.bucket_cap_mb * 2**20 if s.engine == "ddp" else s.ds.reduce_bucket_size * c
        return CommBreakdown(all_reduce=ar, calls=max(1, int(ar // bucket)), **_on(link, 2 * ar))
    if s.zero_impl == "megatron":
        # Megatron-Core's distributed optimizer: the gradient buffer (fp32 for bf16: plan/memory.py
        # _megatron_distributed_optimizer) reduce-scattered once per step, after the last
        # micro-batch's backward (its DDP's no_sync before), then the updated params all-gathered
        # in the compute dtype; both in buckets of max(40M, 1M × dp) parameters
        # (megatron/core/distributed/distributed_data_parallel_config.py bucket_size)
        grad = s.main_grad_bytes(train.compute_dtype, c) * trained
        # --fp8-param-gather: the updated fp8 linear weights are gathered as they are kept
        ag = c * trained - gathered_linear_bytes_saved(c, train) * linear_share(model, rank, layout.tp)[0]
        buckets = int(trained // max(40_000_000, 1_000_000 * layout.dp)) + 1
        return CommBreakdown(reduce_scatter=grad, all_gather=ag, calls=2 * buckets, **_on(link, grad + ag))
    if s.engine == "deepspeed" and s.zero_stage in (1, 2):
        # Gradient reduction: ZeRO-1 once per step (holds full grads), ZeRO-2 every micro-batch.
        # With use_multi_rank_bucket_allreduce (default) each bucket is all-reduced whole; without
        # it each partition is reduced to its owner (reduce-scatter volume). Then the updated
        # 16-bit params are all-gathered once (stage_1_and_2.py: all_gather_dp_groups). Frozen
        # parameters are in no optimizer group: neither reduced nor gathered.
        reductions = 1 if s.zero_stage == 1 else k
        grad = s.ds.reduce_bytes(c) * trained * reductions
        ag = c * trained
        pcie = (4 * trained / n + c * trained / n) if s.offload_optimizer else 0.0
        calls = int(reductions * (trained // s.ds.reduce_bucket_size + 1) + trained // s.ds.allgather_bucket_size + 1)
        if s.ds.use_multi_rank_bucket_allreduce:
            return CommBreakdown(all_reduce=grad, all_gather=ag, pcie=pcie, calls=calls, **_on(link, 2 * grad + ag))
        return CommBreakdown(reduce=grad, all_gather=ag, pcie=pcie, calls=calls, **_on(link, grad + ag))
    if s.engine == "deepspeed":  # stage 3
        ds = s.ds
        # Every parameter of the module is partitioned, adapters included; tensors under the
        # persistence threshold stay whole (LoRA's r × d matrices usually are).
        persist = persistent_params(model, ds.param_persistence_threshold, layout.tp)
        if lora:
            persist += sum(m * per * len(rank.layers) for m, per in adapter_tensors(model, train, layout.tp)
                           if m < ds.param_persistence_threshold)
        gathered = psi + adapters - persist
        # Params are released after forward and re-gathered in backward unless the whole model
        # fits under the live/reuse limits (partitioned_param_coordinator.py).
        regather = gathered > min(ds.max_live_parameters, ds.max_reuse_distance)
        # Persistent params are not gathered per micro-batch, but every persistent partition
        # (frozen ones too: stage3.py _post_step gathers `persistent_parameters`) is all-gathered
        # once after the step (measured: 2-rank gloo count, GA 1 and 2).
        ag = c * gathered * k * (2 if regather else 1) + c * persist
        rs = s.ds.reduce_bytes(c) * trained * k  # every micro-batch (stage3.py reduce_ipg_grads)
        pcie = 0.0
        if s.offload_optimizer:
            pcie += k * 4 * trained / n + c * trained / n
        if s.offload_params:
            pcie += c * gathered / n * k * (2 if regather else 1)
        calls = int(k * (model.num_layers * (2 if regather else 1) + trained // ds.reduce_bucket_size + 1))
        return CommBreakdown(all_gather=ag, reduce_scatter=rs, pcie=pcie, calls=calls, **_on(link, ag + rs))
    # FSDP2: all-gather every unit in forward each micro-batch (param dtype), again in backward
    # for the units resharded after forward (`Strategy.resharding`: the last decoder layer and
    # the root only under "all", stock fully_shard; train/engines/fsdp.py); reduce-scatter
    # in reduce_dtype once per step (sync disabled on non-final micro-batches), or every
    # micro-batch (`reduce_every_micro_batch`, torch's default; "auto" as plan/evaluate.py fsdp_grad_sync
    # resolves it). LoRA adapters live in the
    # decoder-layer units and are gathered with them.
    p = c
    reduce = s.fsdp.reduce_bytes(c) if (train.mixed_precision or lora) else train.master_bytes
    layers = rank_layer_params(model, rank) / layout.tp + adapters  # adapters live in the layers
    units = fsdp_units(model, s, layout, rank, psi + adapters, layers, model.params_per_layer / layout.tp)
    ag_fwd = p * (psi + adapters) * k
    share = fsdp_regather_share(s, rank)
    regathered = fsdp_regathered(s, rank, units)
    ag_bwd = p * regathered * k
    if train.fp8_all_gather:  # the decoder linears' weights all-gathered in fp8 (plan/fp8.py)
        saved = gathered_linear_bytes_saved(c, train) * linear_share(model, rank, layout.tp)[0] * k
        ag_fwd, ag_bwd = ag_fwd - saved, ag_bwd - saved * share
    if train.base_quant == "nf4":  # QLoRA's NF4 linears all-gathered as stored (plan/memory_lora.py)
        saved = nf4_gathered_saving(c) * linear_share(model, rank, layout.tp)[0] * k
        ag_fwd, ag_bwd = ag_fwd - saved, ag_bwd - saved * share
    # held unsharded grads: once per step; torch's default (sync left on): every micro-batch
    reductions = k if s.fsdp.reduce_every_micro_batch else 1
    rs = reduce * trained * reductions
    # each decoder layer, each stage's root group and the carved embedding and head units; in
    # backward the resharded ones again (fsdp_regathered); frozen units reduce nothing (LoRA)
    count = units.count(len(rank.layers), len(rank.stages))
    regather_calls = (round(len(rank.layers) * share) + units.root_groups(len(rank.stages)) * s.reshards_root
                      + (units.embedding > 0) * s.reshards_embedding + (units.head > 0) * s.reshards_root)
    reducing = count - ((units.embedding > 0) + (units.head > 0) if lora else 0)
    calls = k * (count + regather_calls) + reducing * reductions
    w = c if lora else 4  # bytes of a stored parameter shard (LoRA: the frozen base in the compute dtype)
    pcie = (w * (psi + regathered) / n * k + 4 * trained / n) if s.offload_params else 0.0
    if s.fsdp_sharding == "hybrid":
        # shard within a node, all-reduce the 1/g shard across the replicas after each
        # reduce-scatter (`foreach_reduce`: once per step, or per micro-batch with sync left on)
        ar = reduce * trained / n * reductions if layout.dp_replicate > 1 else 0.0
        return CommBreakdown(all_gather=ag_fwd + ag_bwd, reduce_scatter=rs, all_reduce=ar, pcie=pcie,
                             calls=calls + reductions, intra=ag_fwd + ag_bwd + rs,
                             inter=2 * ar if layout.dp_replicate > 1 else 0.0)
    return CommBreakdown(all_gather=ag_fwd + ag_bwd, reduce_scatter=rs, pcie=pcie, calls=calls,
                         **_on(link, ag_fwd + ag_bwd + rs))


def fsdp_regathered(s: Strategy, rank: PipelineRank, units: FsdpUnits) -> float:
    """Parameters FSDP2 gathers again in backward per micro-batch, of a replica in `units`: the
    resharded share of the decoder layers, the root group under "all" (`Strategy.reshards_root`),
    and the carved units (`fsdp.wrap_embeddings`): the embedding as the layers reshard, the head
    as the root does. Stock `fully_shard(reshard_after_forward=True)` on every layer and the root
    thus gathers every parameter twice per micro-batch (counted on 2 gloo ranks:
    tests/accuracy/test_stock_fsdp_comm.py)."""
    return (units.layers * fsdp_regather_share(s, rank) + units.embedding * s.reshards_embedding
            + (units.head + units.root) * s.reshards_root)


def fsdp_regather_share(s: Strategy, rank: PipelineRank) -> float:
    """The share of a pipeline rank's decoder layers FSDP2 gathers again in backward: the layers
    it resharded after forward (`Strategy.resharding`): every one ("all", "layers"), all but each stage's
    last ("not-last": the trainer shards each stage as a model, engines/fsdp.shard_model) or none.
    The root group is gathered again only under "all" (`fsdp_regathered`)."""
    if s.resharding in ("all", "layers"):
        return 1.0
    if s.resharding != "not-last":
        return 0.0
    return (len(rank.layers) - len(rank.stages)) / len(rank.layers)


def _tp_pp_comm(model, train, s: Strategy, layout, k, c) -> CommBreakdown:
    """Megatron TP: 2 all-reduces of b·s·h in forward and 2 in backward per layer (+2 with full
    recompute); with sequence parallelism each is an all-gather + reduce-scatter pair of the same
    ring volume (counted here as the all-reduce it equals). The vocabulary-parallel root adds one
    such pair per pass, forward and backward (never recomputed): the embedding's reduce-scatter
    (all-gather in backward) and lm_head's all-gather (reduce-scatter in backward). The
    vocab-parallel loss all-reduces two fp32 per token (the row max, the sum of exponentials)
    and the loss sum. PP: activations forward and their grads backward across each stage boundary,
    received and sent once per stage a rank runs (virtual stages cross more boundaries).
    Measured on 2 gloo ranks (`strategy.tp: 2`, tests/accuracy/test_measured_tp_comm.py).

    DeepSpeed's AutoTP (`scheme.reduces_per_linear`, no vocabulary parallelism) all-reduces each
    row-parallel output in forward (o, down: 2 per layer and forward pass) and each
    column-parallel linear's input gradient in backward, one per linear (`input_linears`: 5 for
    Llama; DeepSpeed 0.19 module_inject/layers.py: `LinearAllreduce` through `RowParallel`,
    `LinearLayer` through `ColumnParallel`, whose backward all-reduces); the embedding, lm_head
    and loss are whole on every rank and move nothing. Measured
    on 2 gloo ranks (zero1/zero2 × tp 2, tests/accuracy/test_measured_tp_comm.py)."""
    out = CommBreakdown()
    scheme = s.tp_scheme
    act = c * train.micro_batch * train.seq_len * model.hidden_size
    layers = busiest_layers(model, s, layout)
    # per pass a layer runs two pairs, attention's and the MLP's; a MoE layer's MLP runs
    # experts.moe_tp_pairs (EP beside TP), on the busiest rank's MoE layers
    pairs = calls = layers
    volume, launched = experts.moe_tp_pairs(model, s)
    if (volume, launched) != (1, 1):
        busiest = [r for r in strategy_ranks(model, s, layout) if len(r.layers) == layers]
        moe = max(experts.moe_layers_of(model, r) for r in busiest)
        pairs, calls = layers + moe * (volume - 1) / 2, layers + moe * (launched - 1) / 2
    if layout.tp > 1:
        if scheme.reduces_per_linear:
            per_layer = 2 * (train.layer_passes - 1) + sum(input_linears(model))  # forward passes, backward
        else:
            per_layer = 2 * train.layer_passes  # 2 per pass: forward, backward (and recompute)
        root = (2 if layout.pp == 1 else 1) if scheme.vocab_parallel else 0  # embedding, lm_head: a stage each under PP
        loss = 4 * (2 * train.micro_batch * train.seq_len + 1) if scheme.vocab_parallel else 0  # fp32 max, sum-exp; the sum
        ar = (per_layer * pairs + root) * act * k + loss * k
        n = round((per_layer * calls + root) * k)
        out = out + CommBreakdown(all_reduce=ar, blocking=2 * ar, blocking_calls=n)
    if layout.pp > 1:
        v = s.pp_virtual_stages
        p2p = 2 * act / layout.tp * k * 2 * v  # send + recv, forward activations and backward grads, per stage
        out = out + CommBreakdown(p2p=p2p, blocking=p2p, blocking_calls=4 * k * v)
    return out
