"""The parameters one GPU's model replica holds (pure, no torch): a pipeline rank's layers and
its part of the root (plan.pipeline: the trainer's split) split over TP, ZeRO-3's persistent
tensors, ZeRO-1/2's gradient partition, and what ZeRO-3 and FSDP2 keep gathered. Memory,
communication, time and the load phase read them here (plan/memory.py, memory_lora.py, comm.py,
timing.py, load.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.plan.pipeline import PipelineRank, pipeline_ranks
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec


@dataclass(frozen=True, slots=True)
class Replica:
    """One GPU's share of the model under a strategy, as each engine's model-state rule reads it
    (plan/memory.py, memory_lora.py): the specs, its pipeline rank, ψ (the parameters it holds,
    `rank_params`), the shard group's size n and the GPUs sharing one host."""

    model: ModelSpec
    train: TrainSpec
    strategy: Strategy
    layout: ParallelLayout
    psi: float
    n: int
    per_node: int
    rank: PipelineRank

    @property
    def layer(self) -> float:
        """One decoder layer's parameters on this TP rank."""
        return self.model.params_per_layer / self.layout.tp

    @property
    def layers(self) -> float:
        """The decoder-layer parameters this replica holds, on this TP rank."""
        return rank_layer_params(self.model, self.rank) / self.layout.tp


def strategy_ranks(model: ModelSpec, strategy: Strategy, layout: ParallelLayout) -> tuple[PipelineRank, ...]:
    """Every pipeline rank's share under `strategy` (its pp_virtual_stages) and `layout`."""
    return pipeline_ranks(model.num_layers, layout.pp, strategy.pp_virtual_stages if layout.pp > 1 else 1)


def whole_model(model: ModelSpec, layout: ParallelLayout, rank: PipelineRank | None) -> PipelineRank:
    """`rank`, or where the caller names none, the one rank of an unsplit model (pp 1 only: under
    pipeline parallelism the ranks differ, and the caller must say which)."""
    if rank is not None:
        return rank
    if layout.pp != 1:
        raise ValueError("under pipeline parallelism name the pipeline rank (plan.pipeline.PipelineRank)")
    return pipeline_ranks(model.num_layers, 1)[0]


def rank_layer_params(model: ModelSpec, rank: PipelineRank) -> int:
    """Decoder-layer parameters of a pipeline rank's layers (layers differ where dense layers sit
    among MoE layers)."""
    sizes = model.layer_sizes
    return sum(sizes[i] for i in rank.layers)


def rank_root_params(model: ModelSpec, rank: PipelineRank) -> float:
    """Parameters outside the decoder layers that a pipeline rank holds (whole, before any TP
    split): the token embedding (and a learned position table) with stage 0, the final norm and
    lm_head with the last stage. A tied lm_head is the embedding's own matrix at pp 1, and a copy
    of it on the last stage's rank under pipeline parallelism (Megatron-LM keeps one there and
    all-reduces the two gradients; shardwise's trainer refuses tied models under PP,
    run.resolve.check_pipeline)."""
    if rank.embedding and rank.head:
        return model.root_params
    embed = model.vocab_size * model.hidden_size + model.position_embedding_params
    head = model.root_params - embed + (model.lm_head_params if model.tie_embeddings else 0)
    return (embed if rank.embedding else 0.0) + (head if rank.head else 0.0)


def rank_params(model: ModelSpec, tp: int, rank: PipelineRank, vocab_tp: int | None = None) -> float:
    """Parameters one GPU of a pipeline rank holds: its decoder layers split over TP ranks (norms
    are replicated; negligible), its root part (`rank_root_params`) over `vocab_tp` of them
    (default tp; `vocab_shards`)."""
    return rank_layer_params(model, rank) / tp + rank_root_params(model, rank) / (tp if vocab_tp is None else vocab_tp)

def vocab_shards(strategy: Strategy, tp: int) -> int:
    """How many ways the embedding, lm_head and logits are split: tp where the strategy's TP is
    vocabulary-parallel (Megatron's, DTensor's), else 1 (AutoTP keeps them whole)."""
    return tp if strategy.tp_scheme.vocab_parallel else 1


def loss_parallel(strategy: Strategy, tp: int) -> bool:
    """The standard loss runs torch's `loss_parallel` over vocabulary shards (DTensor TP)."""
    return vocab_shards(strategy, tp) > 1 and strategy.tp_scheme.torch_loss_parallel


def tp_train(train: TrainSpec, strategy: Strategy) -> TrainSpec:
    """`train` as the strategy's TP runs it: without sequence parallelism where its scheme has
    none (AutoTP), whatever `train.sequence_parallel` asks (plan.activations.seq_shards)."""
    if strategy.tp > 1 and train.sequence_parallel and not strategy.tp_scheme.sequence_parallel:
        return train.model_copy(update={"sequence_parallel": False})
    return train


def stage_params(model: ModelSpec, tp: int, pp: int, vocab_tp: int | None = None, virtual: int = 1) -> float:
    """Parameters held by one GPU of the fullest pipeline rank (`rank_params`); the whole model
    over TP at pp 1."""
    return max(rank_params(model, tp, r, vocab_tp) for r in pipeline_ranks(model.num_layers, pp, virtual))


def fullest_rank(model: ModelSpec, strategy: Strategy, layout: ParallelLayout) -> PipelineRank:
    """The pipeline rank holding the most parameters under `strategy` (the first of equals)."""
    vocab_tp = vocab_shards(strategy, layout.tp)
    return max(strategy_ranks(model, strategy, layout), key=lambda r: rank_params(model, layout.tp, r, vocab_tp))


def busiest_layers(model: ModelSpec, strategy: Strategy, layout: ParallelLayout) -> int:
    """The most decoder layers one pipeline rank runs (⌈L/(pp·v)⌉ per stage of the longest ones)."""
    return max(len(r.layers) for r in strategy_ranks(model, strategy, layout))


def replica_params(model: ModelSpec, strategy: Strategy, layout: ParallelLayout,
                   rank: PipelineRank | None = None) -> float:
    """ψ of one GPU's model replica under `strategy`'s TP scheme (`rank_params`, `vocab_shards`):
    pipeline rank `rank`'s, by default the fullest one's."""
    rank = rank or fullest_rank(model, strategy, layout)
    return rank_params(model, layout.tp, rank, vocab_shards(strategy, layout.tp))


def persistent_params(model: ModelSpec, threshold: int, tp: int) -> float:
    """ZeRO-3 keeps parameters with fewer than `stage3_param_persistence_threshold` elements
    whole on every rank (partition_parameters.py: `ds_persist`)."""
    return sum(n * k for n, k in model.tensor_sizes() if n / tp < threshold) / tp

def optimizer_groups(model: ModelSpec, weight_decay: float) -> tuple[tuple[int, ...], ...]:
    """The trainer's AdamW groups as tensor sizes, each in `model.parameters()` order
    (train/engines/base.decay_groups): the decayed tensors, then the rest (norms, biases,
    embeddings: specs.train.weight_decayed) — one group without weight decay, two with it."""
    flags = model.hf_decayed
    if flags is None:  # an inventory that does not say: HF order, one group
        return (model.hf_order,)
    decayed = tuple(n for n, d in zip(model.hf_order, flags, strict=True) if d)
    rest = tuple(n for n, d in zip(model.hf_order, flags, strict=True) if not d)
    groups = (decayed + rest,) if weight_decay == 0 else (decayed, rest)
    return tuple(g for g in groups if g)

def replica_partition(r: Replica) -> float:
    """Elements of the gradient partition of DeepSpeed ZeRO-1/2 on the fullest data-parallel rank
    of replica `r`: `partition_holding` of the unsplit model; under TP or PP the per-rank tensor
    order is engine-specific, so the ideal ψ/N (under expert parallelism too: plan/experts.py, n the effective shard count)."""
    if r.n <= 1:
        return r.psi
    if r.layout.tp > 1 or r.layout.pp > 1 or r.layout.ep > 1:
        return r.psi / r.n
    return partition_holding(r.model, r.n, weight_decay=r.train.weight_decay)


@lru_cache(maxsize=4096)
def partition_holding(model: ModelSpec, n: int, weight_decay: float = 0.0) -> float:
    """Elements of the gradient partition on DeepSpeed ZeRO-1/2's fullest rank (the whole model,
    no TP or PP): DeepSpeed flattens each optimizer group (`optimizer_groups`) and splits it into
    N slices; every tensor that overlaps the rank's slice of a group is held whole
    (stage_1_and_2.py: params_in_partition). Measured exactly on both ranks of tiny Llamas, one
    group and two (tests/accuracy/test_measured_memory.py, tests/plan/test_zero12_groups.py)."""
    if n <= 1:
        return model.params
    held = [0] * n
    for sizes in optimizer_groups(model, weight_decay):
        part = -(-sum(sizes) // n)
        start = 0
        for size in sizes:
            end = start + size
            for r in range(start // part, min(n - 1, (end - 1) // part) + 1):
                held[r] += size
            start = end
    return max(held)

def zero3_gathered(model: ModelSpec, train: TrainSpec, ds, layout: ParallelLayout,
                   rank: PipelineRank | None = None) -> float:
    """Elements ZeRO-3 keeps gathered at the end of forward, on every step after the first (the
    first records the trace and releases each module after its forward: it holds less).

    After a module's forward, DeepSpeed releases its parameters unless the trace reuses them
    within `stage3_max_reuse_distance` elements (partitioned_param_coordinator.py
    `__params_to_release`, 0.19.8 :657-661). The walk sums the parameters of the modules it
    passes, counted by the released module's leaf flag:

    - decoder layers as ZeRO-3 leaves (fetch unit "layer", DeepSpeedKnobs.zero3_unit): a leaf
      counts recursively, and the first module of backward is the root (the CausalLM), which holds
      every parameter, so a layer is kept when the rest of the forward (the later layers, the
      final norm, lm_head) is within the distance; the input embedding (not a leaf) counts the
      leaf layers as empty and stays when 2·lm_head + norm is; lm_head, reused at once, stays.
      Measured per hook on 2 CPU ranks (benchmarks/results/zero3_gathered.json): the 1.36B Llama
      keeps layers 5-23, embed and lm_head (1,107.3M elements, 2.06 GiB bf16), exactly; at a
      distance of 5e8, 593.5M, exactly; the 134M Llama the whole model.
    - submodules as the unit ("module"): each linear reappears in backward after the rest of the
      forward and the backward of the later layers (with full checkpointing, their recompute
      too), so a suffix of the layers stays, plus lm_head and the prefetch bucket. Measured on one
      H200: 0.92 GiB for qwen2.5-0.5b (whole model).
    A model whose gathered params are all within the distance is never released (no re-gather:
    comm.py). `rank`: the pipeline rank (default: the whole model, pp 1)."""
    rank = whole_model(model, layout, rank)
    layer = model.params_per_layer / layout.tp
    layers = len(rank.layers)
    tail = model.root_params / layout.tp  # embed, norm, lm_head
    lm_head = model.lm_head_params / layout.tp
    gathered = (rank_layer_params(model, rank) / layout.tp + tail
                - persistent_params(model, ds.param_persistence_threshold, layout.tp))
    distance = ds.max_reuse_distance
    if ds.zero3_unit(model.params_per_layer / layout.tp) == "layer":
        norm = model.hidden_size
        embed = max(0.0, tail - lm_head - norm)  # tied: lm_head is the embedding, counted once
        kept_layers = sum(1 for after in range(layers) if after * layer + lm_head + norm < distance)
        live = kept_layers * layer + (embed if 2 * lm_head + norm < distance else 0.0) + lm_head
        # never less than the layer computing, gathered whole
        return max(0.0, min(gathered, max(live, layer)))
    passes = train.layer_passes  # forward, (recompute,) backward of each later layer
    kept_layers = 0
    for after in range(layers):  # `after` = layers that follow this one in forward
        if passes * after * layer + 2 * lm_head >= distance:
            break
        kept_layers += 1
    live = kept_layers * layer + lm_head + min(ds.prefetch_bucket_size, layer)
    # never less than the fetch unit, gathered whole while it computes: the largest submodule
    unit = model.largest_module / layout.tp
    return max(0.0, min(gathered, max(live, unit + min(ds.prefetch_bucket_size, layer))))


@dataclass(frozen=True, slots=True)
class FsdpUnits:
    """A replica's FSDP2 units, in parameters on one GPU: `layer` the largest decoder layer,
    `layers` all of its decoder layers, `embedding` and `head` the units
    `strategy.fsdp.wrap_embeddings` carves out of the root (the token embedding; the final norm
    and lm_head; 0 where they stay in it), `root` what the root keeps."""

    layer: float
    layers: float
    embedding: float
    head: float
    root: float

    @property
    def carved(self) -> bool:
        return self.embedding > 0 or self.head > 0

    @property
    def largest_outside_root(self) -> float:
        return max(self.layer, self.embedding, self.head)

    def root_groups(self, stages: int) -> int:
        """Root units that hold parameters, of a rank running `stages` stages (each stage's model
        has its root; one emptied by the carving gathers nothing)."""
        return stages - (1 if self.carved and self.root == 0 else 0)

    def count(self, decoder_layers: int, stages: int) -> int:
        """FSDP2 units with parameters: each decoder layer, the roots, the carved units."""
        return decoder_layers + self.root_groups(stages) + (self.embedding > 0) + (self.head > 0)


def embedding_units_refusal(tied: bool, pp: int) -> str | None:
    """Why FSDP2's embedding and head units (`fsdp.wrap_embeddings`) cannot be carved out of the
    root, or None: a tied lm_head is one parameter that cannot sit in two units, and each
    pipeline stage keeps its embedding or head in its own root. The planner (fsdp_units), the
    trainer (train/engines/fsdp.carved_units) and the check before any rank starts
    (run/resolve.check_fsdp_units) all ask here."""
    if tied:
        return ("the model ties lm_head to the input embedding, one parameter that cannot sit in two FSDP units "
                "(the root keeps both)")
    if pp > 1:
        return "each pipeline stage keeps its embedding or head in its own root"
    return None


def carves_embeddings(s: Strategy, tied: bool, pp: int) -> bool:
    """Whether the embedding and head are FSDP2 units of their own (see embedding_units_refusal)."""
    return s.engine == "fsdp2" and s.fsdp.wrap_embeddings and embedding_units_refusal(tied, pp) is None


def fsdp_units(model: ModelSpec, s: Strategy, layout: ParallelLayout, rank: PipelineRank, psi: float,
               layers: float, layer: float) -> FsdpUnits:
    """The FSDP2 units of a pipeline rank's replica of `psi` parameters, `layers` of them in its
    decoder layers (`layer` the largest). `fsdp.wrap_embeddings` carves the token embedding and the
    head (final norm, lm_head) out of the root at pp 1 for an untied model, as the trainer wraps
    them (train/engines/fsdp.shard_model); a learned position table stays in the root."""
    root = psi - layers
    if not carves_embeddings(s, model.tie_embeddings, layout.pp):
        return FsdpUnits(layer, layers, 0.0, 0.0, root)
    # at pp 1 the rank holds the whole root: the token embedding, a learned position table, the
    # final norm and lm_head, split over the vocabulary shards as psi holds them
    whole = rank_root_params(model, rank)
    share = root / whole if whole else 0.0
    embedding, position = model.vocab_size * model.hidden_size, model.position_embedding_params
    return FsdpUnits(layer, layers, embedding * share, (whole - embedding - position) * share, position * share)


def fsdp_gathered_at_loss(s: Strategy, train: TrainSpec, c: float, psi: float, units: FsdpUnits) -> float:
    """Bytes of unsharded FSDP2 parameters while the loss runs: after the last decoder layer's
    forward, before backward gathers and prefetches again (`fsdp_gathered_params` holds
    backward's). Nothing is prefetched; the last decoder layer stays gathered unless it reshards
    after forward, the embedding unit unless it does; the root and the head unit are in use where
    the loss runs inside the model's forward (the trainer's chunked loss), else gathered unless
    the root reshards (`TrainSpec.loss_after_forward`). "none" keeps everything gathered."""
    if s.resharding == "none":
        return c * psi
    root_held = not (train.loss_after_forward and s.reshards_root)
    return c * (units.layer * (not s.reshards_layer(last=True)) + units.embedding * (not s.reshards_embedding)
                + (units.root + units.head) * root_held)


def fsdp_gathered_linears(s: Strategy, lin_total: float, lin_layer: float) -> tuple[float, float]:
    """Decoder linear weights among the gathered parameters, as (backward's, while the loss runs):
    every layer's under "none"; else backward's two layers (in flight and prefetched) and, at the
    loss, the last layer's where it stays gathered (`fsdp_gathered_params`,
    `fsdp_gathered_at_loss`). What fp8 or NF4 all-gathers shrink."""
    if s.resharding == "none":
        return lin_total, lin_total
    return 2 * lin_layer, lin_layer * (not s.reshards_layer(last=True))


def fsdp_gathered_params(s: Strategy, c: float, psi: float, units: FsdpUnits) -> float:
    """Bytes of unsharded FSDP2 parameters held through forward and backward (`Strategy.resharding`),
    of a replica of ψ parameters in `units`. "none": every unit stays gathered from its forward
    to its backward (c·Ψ). Else the root and two units: the one in flight and the one prefetched
    (two decoder layers; the embedding and the first layer, lm_head and the last layer where they
    are units of their own). "all" and "not-last" hold the same: "not-last" keeps the last layer
    and the root from forward into backward; "all" frees both and gathers them again as
    backward starts, while the next layer is prefetched (the root is held through the backward
    either way)."""
    if s.resharding == "none":
        return c * psi
    return c * (units.layer + units.largest_outside_root + units.root)
