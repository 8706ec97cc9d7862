"""The preflight refuses, before any rank starts, a run whose ranks on this node cannot hold the
weights while they load (shardwise.train.host_memory), with the numbers; host memory is faked
(tests/conftest.py `host_memory`), never read off this machine."""

from __future__ import annotations

import re

import pytest

from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.run.host import read_meminfo
from shardwise.specs.hardware import GIB
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
        "checkpointing": {"output_dir": str(path.parent / "out"), "activation": "none"},
    })


PARAMS = 12 * (4 * 768 * 768 + 3 * 768 * 2048) + 2 * 32000 * 768 + 25 * 768  # the checkpoint's 134,105,856
PEAK = re.compile(r"each rank peaks at (?P<peak>[\d.]+) GiB training \(process (?P<process>[\d.]+), the step's "
                  r"tensors (?P<tensors>[\d.]+), heap slack (?P<slack>[\d.]+)\) × (?P<ranks>\d+) ranks \+ the "
                  r"launcher (?P<launcher>[\d.]+) = (?P<node>[\d.]+) GiB")


def test_a_cpu_run_that_does_not_fit_the_node_is_refused_with_the_numbers(checkpoint, host_memory):
    host_memory(int(4.5 * GIB))
    with pytest.raises(ShardwiseError) as e:
        preflight(config(checkpoint), world_size=2, device="cpu")
    msg = str(e.value)
    assert "predicted to run out of host memory: strategy 'ddp'" in msg and "against 4.50 GiB (MemAvailable" in msg
    m = PEAK.search(msg)
    assert m, msg
    v = {k: float(x) for k, x in m.groupdict().items()}
    # ddp on CPU keeps a whole fp32 replica, its fp32 grads and AdamW's two fp32 moments (16 bytes a
    # parameter), and in forward bf16 autocast's copy of each weight, kept for backward (2 more); the
    # activations of 8 tokens add almost nothing
    assert 18 * PARAMS / GIB <= v["tensors"] <= 18 * PARAMS / GIB + 0.05
    assert v["peak"] == pytest.approx(v["process"] + v["tensors"] + v["slack"], abs=0.015)
    assert v["ranks"] == 2 and v["node"] == pytest.approx(2 * v["peak"] + v["launcher"], abs=0.015)


def test_the_same_run_sharded_fits(checkpoint, host_memory):
    """FSDP2 keeps half of those 16 bytes a parameter on each of 2 ranks: it fits where ddp did not."""
    host_memory(int(4.5 * GIB))
    preflight(config(checkpoint, "fsdp"), world_size=2, device="cpu")


def test_host_memory_gb_overrides_meminfo_and_force_runs_anyway(checkpoint, host_memory):
    host_memory(64 * GIB)
    with pytest.raises(ShardwiseError, match=r"against 0.93 GiB \(.*hardware.host_memory_gb\)"):
        preflight(config(checkpoint, host_memory_gb=1.0), world_size=2, device="cpu")
    preflight(config(checkpoint, host_memory_gb=1.0), world_size=2, device="cpu", force=True)


def test_a_gpu_run_is_refused_when_its_ranks_cannot_load_the_weights(checkpoint, host_memory):
    """On CUDA the host holds the load phase: ddp reads into each GPU, the host only the read
    window (the 4 kB file and one embedding slice of 32000 x 768 bf16 values) and the process."""
    from shardwise.run.bridge import run_spec
    from shardwise.train.host_memory import check_host_memory

    host_memory(int(0.5 * GIB))
    with pytest.raises(ShardwiseError) as e:
        check_host_memory(run_spec(config(checkpoint), 8, "cuda"))
    msg = str(e.value)
    assert "loading the weights (sharded read) needs" in msg and "× 8 ranks" in msg
    assert f"reads in flight {2 * 32000 * 768 / GIB:.2f}" in msg and "the rank's part 0.00" in msg


def test_meminfo_parsing(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemAvailable:   20000000 kB\nHugePages_Total:       0\n")
    assert read_meminfo(f) == {"MemTotal": 24576000 * 1024, "MemAvailable": 20000000 * 1024, "HugePages_Total": 0}
    assert read_meminfo(tmp_path / "missing") == {}
