"""The preflight refuses, before any rank starts, a run whose ranks on this node cannot hold the
weights while they load (shardwise.train.host_memory), with the numbers; host memory is faked
(tests/conftest.py `host_memory`), never read off this machine."""

from __future__ import annotations

import pytest

from shardwise.errors import ShardwiseError
from shardwise.specs.hardware import GIB
from shardwise.train.config import TrainConfig
from shardwise.train.host_memory import read_meminfo
from shardwise.train.preflight import preflight


@pytest.fixture
def checkpoint(tmp_path):
    """A 134M-parameter Llama config with a (small) safetensors file: only the config's shape and
    the file's size are read before ranks start."""
    from transformers import LlamaConfig

    d = tmp_path / "llama-134m"
    LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                vocab_size=32000, tie_word_embeddings=False).save_pretrained(d)
    import torch
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1000)}, d / "model.safetensors")
    return d


def config(path, strategy="ddp", **hardware) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"path": str(path)},
        "data": {"kind": "synthetic", "synthetic": {"samples": 8, "seq_len": 8}},
        "strategy": {"name": strategy},
        "precision": "bf16-mixed",
        "run": {"steps": 1, "micro_batch": 1, "device": "cpu", "compile": False},
        "logging": {"progress": False, "tensorboard": False},
        "hardware": hardware,
        "checkpointing": {"output_dir": str(path.parent / "out")},
    })


def test_a_load_that_does_not_fit_the_node_is_refused_with_the_numbers(checkpoint, host_memory):
    host_memory(int(1.5 * GIB))
    with pytest.raises(ShardwiseError) as e:
        preflight(config(checkpoint), world_size=2, device="cpu")
    msg = str(e.value)
    # ddp on CPU: a fp32 replica per rank, the read window (the 4 kB file, one embedding slice of
    # 32000 x 768 bf16 values) and the process (0.5 GiB, plan/load.py PROCESS_BYTES), on 2 ranks
    params = 12 * (4 * 768 * 768 + 3 * 768 * 2048) + 2 * 32000 * 768 + 25 * 768  # 134,105,856
    part, read = 4 * params / GIB, 2 * 32000 * 768 / GIB
    per_rank = part + read + 0.5
    assert "predicted to run out of host memory: strategy 'ddp'" in msg
    assert f"loading the weights (sharded read) needs {per_rank:.2f} GiB per rank × 2 ranks = {2 * per_rank:.2f} GiB" in msg
    assert f"the rank's part {part:.2f}" in msg and "against 1.50 GiB (MemAvailable in /proc/meminfo)" in msg


def test_the_same_run_sharded_fits(checkpoint, host_memory):
    """FSDP2 reads half the model per rank: 2 × (0.25 + 0.5) GiB fits in 1.6 GiB."""
    host_memory(int(1.6 * GIB))
    preflight(config(checkpoint, "fsdp"), world_size=2, device="cpu")


def test_host_memory_gb_overrides_meminfo_and_force_runs_anyway(checkpoint, host_memory):
    host_memory(64 * GIB)
    with pytest.raises(ShardwiseError, match=r"against 0.93 GiB \(.*hardware.host_memory_gb\)"):
        preflight(config(checkpoint, host_memory_gb=1.0), world_size=2, device="cpu")
    preflight(config(checkpoint, host_memory_gb=1.0), world_size=2, device="cpu", force=True)


def test_meminfo_parsing(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemAvailable:   20000000 kB\nHugePages_Total:       0\n")
    assert read_meminfo(f) == {"MemTotal": 24576000 * 1024, "MemAvailable": 20000000 * 1024, "HugePages_Total": 0}
    assert read_meminfo(tmp_path / "missing") == {}
