"""LoRA under parameter offload: DeepSpeed's offload_param moves every partitioned parameter to
the host, the frozen base's too (deepspeedai/DeepSpeed partition_parameters.py `_partition_param`:
a partition goes to `remote_device` unless the tensor persists; requires_grad only decides
quantisation). Expected bytes are derived here from Llama-2-7B's shape and LoRA's r·(d_in + d_out)
per adapted linear, never read from the planner."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.plan.memory import plan_memory
from shardwise.specs import Strategy, TrainSpec

GiB = 2**30
# Llama-2-7B (catalog: its config.json)
H, L, INTER, VOCAB = 4096, 32, 11008, 32000
PSI = 2 * VOCAB * H + L * (4 * H * H + 3 * H * INTER + 2 * H) + H  # embed, lm_head, layers, final norm
NORMS = (2 * L + 1) * H  # every norm weight: h elements, under ZeRO-3's persistence threshold (1e5)
R = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# every A (r × d_in) and B (d_out × r) has at most 8·11008 = 88,064 elements: all persist whole
ADAPTERS = L * R * (4 * (H + H) + 3 * (H + INTER))
N = 8  # GPUs, one node


def _plan(strategy: str, lora: bool):
    m = catalog.get_model("llama-2-7b")
    assert m.params == PSI
    train = TrainSpec(precision="fp32", lora_rank=R if lora else 0, lora_targets=TARGETS)
    return plan_memory(m, catalog.build_hardware(gpus=N), train, Strategy.from_name(strategy))


def test_zero3_full_offload_moves_the_frozen_base_to_the_host():
    lora = _plan("zero3+full-offload", lora=True)
    w = 4  # fp32: DeepSpeed keeps the module in the compute dtype
    # GPU: the persistent tensors whole (norms, every adapter matrix) and the frozen norms' own
    # partitions (ds_persist partitions stay on the local device)
    assert lora.gpu.params == pytest.approx(w * (NORMS + ADAPTERS) + w * NORMS / N, rel=1e-12)
    assert lora.gpu.params < 0.1 * GiB  # was 3.5 GiB: the whole base's partition (26.4 GiB on one GPU)
    # host, per node (8 ranks): every other partition, base and adapters
    assert lora.host.params == pytest.approx(w * (PSI + ADAPTERS - NORMS) / N * N, rel=1e-12)
    # and the adapters' offloaded optimizer: fp32 grads, master, Adam's two moments, per node
    assert lora.host.grads == pytest.approx(4 * ADAPTERS, rel=1e-12)
    assert lora.host.optimizer_states == pytest.approx(8 * ADAPTERS, rel=1e-12)


def test_zero3_offload_base_follows_full_fine_tuning():
    """Without LoRA the same plan offloads the parameters; LoRA's base now goes the same way:
    the host holds the same base partitions plus the adapters'."""
    full = _plan("zero3+full-offload", lora=False)
    lora = _plan("zero3+full-offload", lora=True)
    # full fine-tuning: every partition on the host (all trainable: the flat CPU buffer), the
    # persistent norms whole on the GPU too
    assert full.gpu.params == pytest.approx(4 * NORMS, rel=1e-12)
    assert full.host.params == pytest.approx(4 * PSI / N * N, rel=1e-12)
    assert lora.host.params - full.host.params == pytest.approx(4 * (ADAPTERS - NORMS), rel=1e-9)


def test_zero3_without_param_offload_keeps_the_base_on_gpu():
    lora = _plan("zero3+opt-offload", lora=True)
    w = 4
    assert lora.gpu.params == pytest.approx(w * (NORMS + ADAPTERS) + w * (PSI + ADAPTERS) / N, rel=1e-12)
    assert lora.host.params == 0


def test_fsdp_offload_lora_host_is_per_node():
    """FSDP2's CPUOffloadPolicy: each rank's shards on the host; the host figure is the node's."""
    lora = _plan("fsdp+offload", lora=True)
    # fp32 base and fp32 adapters, sharded over 8 ranks, 8 ranks a node
    assert lora.host.params == pytest.approx(4 * (PSI + ADAPTERS) / N * N, rel=1e-12)
    assert lora.gpu.params == 0
