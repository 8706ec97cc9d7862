"""Preference objectives' own terms (TrainSpec.objective / .reference): the frozen reference
model's weights, its forward's transient memory, its gather traffic and its FLOPs. Pure, no torch.

What the paired batch itself costs (2 × micro_batch sequences through the trained forward and
backward) is not here: the planner runs its activation, logit, compute and TP/PP terms on
`TrainSpec.as_sequences()`, the batch as the engines see it.

Followed from TRL (huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8):
- trl/trainer/dpo_trainer.py `__init__`: with ref_model None the reference is created from the
  policy's path unless the model is a PEFT model or precompute_ref_log_probs is set (then none is
  held); it is prepared with `prepare_deepspeed` under DeepSpeed, `prepare_fsdp` under FSDP, else
  `accelerator.prepare_model(evaluation_mode=True)` (whole on each GPU, not wrapped).
- trl/models/utils.py `prepare_deepspeed`: "If ZeRO-3 is used, we shard both the active and
  reference model. Otherwise ... initialized on each device with ZeRO disabled (stage 0)".
  DeepSpeed's bf16/fp16 engine stores the module in that dtype.
- trl/models/utils.py `prepare_fsdp` (FSDP2): `fully_shard(model, ...)` on the root module only,
  so the reference's forward gathers the whole model at once (one FSDP unit); its
  `offload_policy` is the policy's cpu_offload.
- `_compute_loss`: the policy's logits stay referenced (`outputs.logits`, saved by
  selective_log_softmax for backward) while the reference runs under torch.no_grad() on the same
  batch and returns its own logits.
"""

from __future__ import annotations

from shardwise.plan.loss import logits_bytes
from shardwise.plan.stage import persistent_params
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec


def reference_shards(strategy: Strategy) -> bool:
    """The reference is sharded over the data-parallel ranks as the policy is: under ZeRO-3
    (`prepare_deepspeed` keeps stage 3) and FSDP2 (`prepare_fsdp`); else whole on each GPU."""
    return strategy.engine == "fsdp2" or (strategy.engine == "deepspeed" and strategy.zero_stage == 3)


def reference_params(model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
                     psi: float) -> tuple[float, float]:
    """(GPU bytes, host bytes per GPU) of the frozen reference's weights: the compute dtype
    (c bytes each; no gradients, no optimizer state), the replica's `psi` parameters, over the
    shard group where it is sharded (ZeRO-3: the small persistent tensors whole, as for the
    policy), on the host where the engine offloads parameters. Nothing without a held reference
    (precomputed log-probs; LoRA's base with adapters disabled)."""
    if not train.holds_reference:
        return 0.0, 0.0
    c, n = train.compute_bytes, max(layout.dp_shard, 1)
    if not reference_shards(strategy):
        return c * psi, 0.0
    if strategy.engine == "deepspeed":
        persist = persistent_params(model, strategy.ds.param_persistence_threshold, layout.tp)
        shard = c * psi / n
        return (c * persist + (0.0 if strategy.offload_params else shard)), (shard if strategy.offload_params else 0.0)
    shard = c * psi / n
    return (0.0, shard) if strategy.offload_params else (shard, 0.0)


def reference_forward(model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout, psi: float,
                      vocab_tp: int) -> float:
    """Bytes per GPU live during the no-grad forward(s) beside the policy's saved activations: the
    forward-only sequences' logits (c bytes per vocabulary entry per token, nothing saved for
    backward; one forward at a time) beside the policy's own logits, which it still holds, and the reference's gathered
    weights where it is sharded (FSDP2: the whole model, TRL's one root unit; ZeRO-3: the layer in
    flight and the prefetched one). None without forward-only sequences. Liger's fused
    preference loss (--cross-entropy fused) materialises neither's logits."""
    share = train.forward_only_share
    if not share:
        return 0.0
    seq = train.as_sequences()
    logits = 0.0
    if seq.cross_entropy != "fused":
        c, v = seq.compute_bytes, model.vocab_size / vocab_tp
        policy = seq.tokens_per_micro_batch  # the policy's logits, still referenced
        # one no-grad forward at a time, each over as many sequences as the trained one (DPO's
        # reference on the pair; KTO's on the examples, then on the KL sequences)
        logits = c * v * policy * 2 if seq.cross_entropy in ("standard", "inplace", "chunked-output") else (
            c * v * policy + logits_bytes(model, seq, vocab_tp))
    gathered = 0.0
    if train.holds_reference and reference_shards(strategy) and layout.dp_shard > 1:
        c = train.compute_bytes
        gathered = c * psi if strategy.engine == "fsdp2" else c * 2 * model.params_per_layer / layout.tp
    return logits + gathered


def no_grad_forwards(train: TrainSpec) -> int:
    """Forwards without gradients per micro-batch through a model the size of the policy: DPO's
    reference (a held copy, or the policy itself with the adapters off); KTO's reference twice (its
    KL sequences, then the examples: trl/trainer/kto_trainer.py `_compute_kl_logps`, then
    `self.ref_model(**ref_model_kwargs)`) and the policy once more on the KL sequences."""
    ref = train.reference in ("model", "adapters_off")
    if train.objective == "dpo":
        return 1 if ref else 0
    if train.objective == "kto":
        return (2 if ref else 0) + 1
    return 0


def no_grad_gather_bytes(model: ModelSpec, train: TrainSpec, strategy: Strategy, layout: ParallelLayout,
                         psi: float) -> float:
    """All-gather bytes per GPU per optimizer step of the no-grad forwards (`no_grad_forwards`)
    where the model they run is sharded (ZeRO-3, FSDP2: the held reference as the policy is, or
    the policy itself): every parameter gathered once per forward and micro-batch, in the compute
    dtype (no backward gathers them again; ZeRO-3's persistent tensors are whole and not gathered)."""
    if not (reference_shards(strategy) and layout.dp_shard > 1):
        return 0.0
    gathered = psi
    if strategy.engine == "deepspeed":
        gathered -= persistent_params(model, strategy.ds.param_persistence_threshold, layout.tp)
    return train.compute_bytes * gathered * train.grad_accum * no_grad_forwards(train)


def objective_words(train: TrainSpec) -> str:
    """The objective as the plan's title says it ("" for SFT)."""
    if train.objective == "sft":
        return ""
    pair = ", chosen + rejected in one batch" if train.sequences_per_example == 2 else ""
    ref = {"model": "a frozen reference model held", "precomputed": "reference log-probs precomputed (that pass "
           "before training is not in the step)", "adapters_off": "reference = the base with adapters off (no "
           "extra weights)", "none": "no reference"}[train.reference]
    return f"{train.objective.upper()} ({ref}{pair}; planner-only: shardwise train runs SFT only)"
