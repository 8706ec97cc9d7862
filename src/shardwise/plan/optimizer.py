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
# The quantize/dequantize work of a block-quantized update beyond its bytes (block absmax, the codes
# looked up, torchao's branchless 8-step binary search over its 256-entry map): the time it adds,
# as bytes per parameter at the update's bandwidth. Measured on torchao's published ViT-H
# fine-tune (torchao/optim/README.md at 072500a, "Benchmarks": 630M parameters, BF16 AMP, batch 8,
# RTX 4070 Ti SUPER, 672 GB/s; imgs/s fused AdamW 41.9, ao 8-bit 42.5, bnb 8-bit 43.6, ao 4-bit
# 42.4): the step each optimizer saves, against what its bytes alone save over fused AdamW's 28
# (fp32 states; at the default hbm_efficiency 0.55, the card's family), is the work's time:
# ao 8-bit 20.3 ms planned vs 2.7 measured -> 10.4 B; bnb 8-bit 20.3 vs 7.4 -> 7.6 B; ao 4-bit 23.7
# vs 2.3 -> 12.6 B (tests/plan/test_memory_savers.py recomputes them). In fp32 AMP that work is
# smaller than the bytes saved; with bf16 states (torchtune's pure-bf16 recipes) it is larger,
# and the low-bit update is the slower one (torchtune's ladder: -4.67% tokens/s).
LOW_BIT_WORK_BYTES = {
    "adamw8bit": 10.4,
    "adamw4bit": 12.6,
    "paged_adamw8bit": 7.6,
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
