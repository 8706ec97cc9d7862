"""Training FLOPs: one function, shared by the step-time model and the trainer's MFU."""

from __future__ import annotations

from shardwise.specs.model import ModelSpec


def flops_per_token(model: ModelSpec, seq_len: int, checkpointing: str = "none") -> float:
    """Model FLOPs per trained token (forward + backward).

    6·Ψ_active for the matmuls (2 forward, 4 backward per parameter; PaLM appendix B), plus
    attention scores and values: 12·L·d_q·s naive, halved here because causal attention
    only computes the lower triangle (flash/SDPA skip masked blocks) → 6·L·d_q·s.
    Embedding lookups are not matmuls, so the input embedding is excluded from Ψ_active
    (the tied/untied lm_head stays in). Full recompute adds one forward: 8/6 of the total
    (hardware FLOPs; MFU by convention reports model FLOPs, see `model_flops_per_token`).
    """
    base = model_flops_per_token(model, seq_len)
    if checkpointing == "full":
        return base * 8 / 6
    if checkpointing == "selective":  # torchtitan's per-op policy: every second matmul replayed
        return base + 2 * model.num_layers * selective_recompute_params(model)
    return base


def selective_recompute_params(model: ModelSpec) -> float:
    """Weights per layer whose forward matmul torchtitan's per-op selective checkpointing
    replays in backward: it saves the outputs of mm/SDPA except every second mm of a layer
    (torchtitan/distributed/activation_checkpoint.py `_get_custom_policy`). In a Llama block's
    order q(1) k(2) v(3) o(4) gate(5) up(6) down(7), the even ones — k, o, up — are replayed
    (MoE: the expert matmuls count as gate/up/down of the active experts)."""
    h, i = model.hidden_size, model.intermediate_size * (model.experts_per_token if model.is_moe else 1)
    return h * model.kv_dim + model.q_dim * h + h * i


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """FLOPs per token that MFU counts (no recomputation)."""
    embed = model.vocab_size * model.hidden_size  # lookup, not a matmul
    matmul_params = model.active_params - (embed if not model.tie_embeddings else 0)
    return 6 * matmul_params + 6 * model.num_layers * model.q_dim * seq_len
