"""plan/load.py by hand: what each load path books per rank and per node."""

from __future__ import annotations

import pytest

from shardwise.catalog import get_model
from shardwise.plan.load import load_path, load_phase, process_bytes
from shardwise.specs import Strategy
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.train import TrainSpec

MODEL = get_model("llama-2-7b")
TRAIN = TrainSpec(seq_len=2048, micro_batch=1, precision="bf16-mixed")
LARGEST = 32000 * 4096  # the embedding (and the untied lm_head)


def _layout(name: str, world: int = 8) -> ParallelLayout:
    return ParallelLayout.for_strategy(Strategy.from_name(name), world, 8)


def test_paths():
    assert load_path(Strategy.from_name("fsdp")) == "sharded"
    assert load_path(Strategy.from_name("zero3")) == "zero3"
    assert load_path(Strategy.from_name("zero3"), "bin") == "zero3"
    assert load_path(Strategy.from_name("ddp"), "bin") == "broadcast"
    assert load_path(Strategy.from_name("zero2"), None) == "whole"


def test_fsdp_on_gpus_holds_one_file_share_and_the_process():
    s = Strategy.from_name("fsdp")
    load = load_phase(MODEL, TRAIN, s, _layout("fsdp"), 8, max_file_bytes=4e9)
    assert load.resident == 0  # the shards are on the GPUs
    assert load.read == pytest.approx(4e9 / 8 + 2 * LARGEST / 8)
    assert load.per_node == pytest.approx(8 * (load.read + process_bytes("cuda", "fsdp2")))


def test_fsdp_on_cpu_holds_its_fp32_shard_and_lora_its_bf16_base_shard():
    s = Strategy.from_name("fsdp")
    full = load_phase(MODEL, TRAIN, s, _layout("fsdp"), 8, device="cpu", max_file_bytes=0)
    assert full.resident == pytest.approx(4 * MODEL.params / 8)
    lora = TrainSpec(seq_len=2048, micro_batch=1, precision="bf16-mixed", lora_rank=8)
    part = load_phase(MODEL, lora, s, _layout("fsdp"), 8, device="cpu", max_file_bytes=0).resident
    assert 2 * MODEL.params / 8 < part < 2 * MODEL.params / 8 * 1.01  # bf16 base + a few fp32 adapters


def test_whole_is_one_fp32_copy_per_rank():
    s = Strategy.from_name("zero2")
    load = load_phase(MODEL, TRAIN, s, _layout("zero2"), 8, path="whole", max_file_bytes=1e9)
    assert load.resident == pytest.approx(4 * MODEL.params) and load.read == 1e9


def test_zero3_rank0_reads_one_tensor_at_a_time():
    s = Strategy.from_name("zero3")
    load = load_phase(MODEL, TRAIN, s, _layout("zero3"), 8)
    assert load.resident == 0 and load.read == pytest.approx(2 * 2 * LARGEST)
