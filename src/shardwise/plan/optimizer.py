"""The optimizer's bytes per parameter and the temporaries of one step (pure, no torch)."""

from __future__ import annotations

from shardwise.specs.train import TrainSpec

# Block-quantized AdamW states: each state is one code per element and one fp32 scale per block.
# torchao.optim AdamW8bit: uint8 codes, block_size 256 (torchao/optim/subclass_8bit.py
# OptimState8bit.zeros); AdamW4bit: two codes per byte, block_size 128 (subclass_4bit.py);
# bitsandbytes' 8-bit blockwise states use 256-element blocks with an fp32 absmax each
# (bitsandbytes/functional.py optimizer_update_8bit_blockwise). Both keep tensors under 4096
# elements in full precision (torchao adam.py `_new_buffer`, bitsandbytes `min_8bit_size`):
# norms and biases, a fraction of a percent of a decoder's parameters, planned quantized here.
LOW_BIT_STATE_BYTES = {
    "adamw8bit": 2 * (1 + 4 / 256),
    "adamw4bit": 2 * (0.5 + 4 / 128),
    "paged_adamw8bit": 2 * (1 + 4 / 256),
}


def optimizer_bytes(train: TrainSpec) -> float:
    """Optimizer state bytes per parameter."""
    if train.optimizer in LOW_BIT_STATE_BYTES:
        return LOW_BIT_STATE_BYTES[train.optimizer]
    state = train.master_bytes
    return {
        "adamw": 2 * state,  # exp_avg + exp_avg_sq
        "sgd": state,  # momentum buffer
    }[train.optimizer]


def paged_states(train: TrainSpec) -> bool:
    """bitsandbytes' paged optimizers allocate their states in CUDA unified memory
    (cudaMallocManaged, bitsandbytes/functional.py `get_paged`), outside torch's caching allocator:
    the driver keeps them on the GPU while it has room and pages them to the host under pressure.
    torch's memory statistics (torchtune's 'peak memory') never count them, and they cannot cause a
    torch out-of-memory error; planned as host memory."""
    return train.optimizer == "paged_adamw8bit"


def optimizer_temp(train: TrainSpec, n_params: float, largest: float) -> float:
    """Temporaries of one optimizer step over `n_params` elements whose largest tensor has
    `largest` (torch/optim/adam.py): fused AdamW (`_fused_adamw_`, one kernel) and
    bitsandbytes' 8-bit Adam allocate none (torchao's low-bit AdamW, one compiled kernel per
    tensor, is assumed to allocate none either: not measured); foreach AdamW allocates `exp_avg_sq_sqrt` for
    every parameter at once (state dtype); the for-loop version two per tensor while it
    runs (`exp_avg_sq.sqrt()` and its division). SGD with momentum updates in place
    (docs/accuracy.md "Memory: what changed and why it agrees")."""
    if train.optimizer != "adamw" or train.optimizer_impl == "fused":  # low-bit: one fused kernel per tensor
        return 0.0
    state = train.master_bytes
    if train.optimizer_impl == "foreach":
        return state * n_params
    return 2 * state * min(largest, n_params)
