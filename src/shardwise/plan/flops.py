"""Training FLOPs: one function, shared by the step-time model and the trainer's MFU."""

from __future__ import annotations

from shardwise.plan.selective import selective_replayed_params
from shardwise.specs.model import ModelSpec


def flops_per_token(model: ModelSpec, seq_len: int, checkpointing: str = "none", attention: str = "sdpa") -> float:
    """Hardware FLOPs per trained token (forward + backward + what checkpointing replays).

    `model_flops_per_token` plus the replayed forward: full checkpointing replays the whole
    forward (one more of the three passes: 8/6 of the total); selective (torchtitan's per-op
    policy, its default `early_stop=False`: the whole layer is re-run) replays the matmuls it
    does not save, 2 FLOPs per replayed weight per token, summed over the decoder layers
    (dense and MoE layers differ). It keeps SDPA's output, so flash/SDPA attention is not
    replayed; eager attention's score and value matmuls (bmm, not in the save list) are: one
    more attention forward. Eager computes the full s×s square, twice the causal count used
    here in every pass. MFU by convention counts model FLOPs only.
    """
    base = model_flops_per_token(model, seq_len)
    if checkpointing == "full":
        return base * 8 / 6
    if checkpointing == "selective":
        replay = 2 * model.num_layers * selective_recompute_params(model)
        if attention == "eager":
            replay += attention_flops_per_token(model, seq_len) / 3
        return base + replay
    return base


def _layer_kinds(model: ModelSpec) -> tuple[bool, ...]:
    """Per decoder layer: routed experts or not (meta-path models: all layers alike)."""
    return model.moe_layers if model.inventory is None else (model.is_moe,) * model.num_layers


def selective_recompute_params(model: ModelSpec) -> float:
    """Weights per decoder layer, averaged over the layers, whose forward matmul torchtitan's
    per-op selective checkpointing replays in backward (`selective.selective_replayed_params`
    of each layer's kind: every matmul weight but those of the kept mms, the 1st, 3rd, ... of
    `selective.mm_order`; routed experts as the k a token visits). L times this is the
    model's total; 2 FLOPs per weight per token."""
    kinds = _layer_kinds(model)
    per_kind = {moe: selective_replayed_params(model, moe) for moe in set(kinds)}
    return sum(per_kind[moe] for moe in kinds) / len(kinds)


def attention_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Attention scores and values per token, forward + backward, causal: QKᵀ contracts the
    q/k head width (q_dim) and PV produces the value width (o_dim; MLA: heads·v_head_dim), 2
    FLOPs per multiply-add over s keys, three passes, halved for the causal triangle:
    3·L·s·(q_dim + o_dim) (= 6·L·s·q_dim where v and q heads are as wide)."""
    return 3 * model.num_layers * seq_len * (model.q_dim + model.o_dim)


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Model FLOPs per trained token that MFU counts (no recomputation).

    6·Ψ_matmul (2 forward, 4 backward per weight; PaLM appendix B) over the weights a token
    multiplies through (MoE: router, shared experts and its top-k routed experts), plus the
    causal attention term `attention_flops_per_token`. The input embedding and a learned position
    table (gpt2, mpt without ALiBi) are lookups, not matmuls, so they are excluded (a tied lm_head
    stays in).
    """
    embed = model.vocab_size * model.hidden_size  # lookup, not a matmul
    lookups = (embed if not model.tie_embeddings else 0) + model.position_embedding_params  # learned positions
    matmul_params = model.active_params - lookups
    return 6 * matmul_params + attention_flops_per_token(model, seq_len)


def run_flops_per_token(model: ModelSpec, train) -> float:
    """Model FLOPs per token of the run `train` describes: `model_flops_per_token` for full
    fine-tuning. LoRA skips the weight-gradient GEMMs of the frozen base (2 of the 6 FLOPs per
    weight per token): 4 per frozen matmul weight, 6 per adapter weight (plan/lora.py; A and B
    run forward and backward like any weight), and the full 6 for `modules_to_save` copies
    (their frozen originals are not run). What the trainer's MFU counts."""
    if not train.lora_rank:
        return model_flops_per_token(model, train.seq_len)
    from shardwise.plan.lora import adapter_params, saved_module_params

    base = model_flops_per_token(model, train.seq_len) - attention_flops_per_token(model, train.seq_len)
    return (base * 4 / 6 + 6 * adapter_params(model, train) + 2 * saved_module_params(model, train.lora_modules_to_save)
            + attention_flops_per_token(model, train.seq_len))


def forward_only_flops_per_token(model: ModelSpec, train) -> float:
    """FLOPs per trained token of the forwards a preference objective runs without gradients
    (`TrainSpec.forward_only_share` sequences per trained sequence: DPO's reference on the same
    batch, KTO's reference and KL forwards): one forward, a third of `model_flops_per_token`
    (2 of its 6 FLOPs per weight, one of the three attention passes). A LoRA reference with the
    adapters off runs the base's matmuls alone, the same count. 0 for SFT, ORPO, SimPO and a
    precomputed DPO reference (that pass runs before training, outside the step)."""
    return train.forward_only_share * model_flops_per_token(model, train.seq_len) / 3
