"""The optimizer's bytes per parameter and the temporaries of one step (pure, no torch)."""

from __future__ import annotations

from shardwise.specs.train import TrainSpec


def optimizer_bytes(train: TrainSpec) -> float:
    """Optimizer state bytes per parameter."""
    state = train.master_bytes
    return {
        "adamw": 2 * state,  # exp_avg + exp_avg_sq
        "sgd": state,  # momentum buffer
        "adam8bit": 2,  # bitsandbytes: two uint8 states (block absmax is ~1.6% extra, ignored)
    }[train.optimizer]

def optimizer_temp(train: TrainSpec, n_params: float, largest: float) -> float:
    """Temporaries of one optimizer step over `n_params` elements whose largest tensor has
    `largest` (torch/optim/adam.py): fused AdamW (`_fused_adamw_`, one kernel) and
    bitsandbytes' 8-bit Adam allocate none; foreach AdamW allocates `exp_avg_sq_sqrt` for
    every parameter at once (state dtype); the for-loop version two per tensor while it
    runs (`exp_avg_sq.sqrt()` and its division). SGD with momentum updates in place
    (docs/accuracy.md "Memory: what changed and why it agrees")."""
    if train.optimizer != "adamw" or train.optimizer_impl == "fused":
        return 0.0
    state = train.master_bytes
    if train.optimizer_impl == "foreach":
        return state * n_params
    return 2 * state * min(largest, n_params)
