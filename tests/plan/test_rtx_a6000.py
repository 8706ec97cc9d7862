"""The RTX A6000 catalog entry and the torchtune rows it and QLoRA made plannable.

Expected figures come from NVIDIA's Ampere GA102 whitepaper v2 (RTX A6000: 154.8 dense FP16/BF16
tensor TFLOPS with FP32 accumulate, 309.7 with sparsity; 48 GB GDDR6 at 768 GB/s; PCIe 4.0) and an
nvidia-smi log (49140 MiB), not from the planner; the published rows are torchtune's README at
1814feb (benchmarks/published/torchtune-readme-2024-11.yaml)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise import catalog

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import accuracy  # noqa: E402

SOURCE = "torchtune-readme-2024-11"
UNSKIPPED = (
    "llama3.1-8b full a6000x1 b2 seq2048 optimizer-in-bwd paged-adamw8bit",
    "llama3.1-8b lora r8 a6000x1 b2 seq2048 packed compile",
    "llama3.1-8b qlora r8 4090x1 b2 seq2048 packed compile",
    "llama3.1-405b qlora r16 a100x8 fsdp b2 seq2048",
)


def test_a6000_has_its_whitepaper_rates():
    gpu = catalog.get_gpu("rtx-a6000")
    assert gpu.bf16_flops == pytest.approx(309.7e12 / 2, rel=1e-3)  # dense = half the sparse figure
    assert gpu.fp32_flops == pytest.approx(38.7e12)
    assert gpu.memory_bytes == 49140 * 2**20
    assert gpu.hbm_bytes_per_s == pytest.approx(768e9)
    assert catalog.build_hardware(gpu="rtx-a6000", gpus=2).intra.name == "pcie4"


def test_a6000_efficiencies_are_the_a100s_labelled_assumed():
    """No A6000 (GA102) run informs any efficiency: each is the A100 family's value, assumed."""
    gpu = catalog.get_gpu("rtx-a6000")
    values, _ = catalog.family_efficiencies("ampere")
    borrows = catalog.family_borrows(gpu.family)
    assert set(values) <= set(borrows) and set(borrows.values()) == {"ampere"}, borrows
    for name, prov in gpu.efficiency_provenance.items():
        assert prov.kind == "assumed", name
        assert prov.basis.startswith("borrowed from ampere "), prov.basis
        assert getattr(gpu, name) == values[name]


def test_the_unskipped_torchtune_rows_are_planned_with_their_config_noted():
    runs = {r["name"]: r for r in accuracy.load_runs() if r["_source"]["id"] == SOURCE}
    for name in UNSKIPPED:
        run = runs[name]
        assert not run.get("skip"), name
        assert "config llama3_1/" in run["note"], name
        out = accuracy.compare(run)
        assert "error" not in out, out
        assert out["fits"] and out["trained"], name  # trained on the GPU: no false OOM


def test_qlora_8b_on_a_4090_is_planned_within_10_percent_of_its_peak():
    """torchtune's QLoRA recipe (NF4 base, rank 8 on q/v/o and the MLP, chunked loss, checkpointing)
    on one RTX 4090: 7.4 GiB published."""
    run = next(r for r in accuracy.load_runs() if r["name"] == UNSKIPPED[2])
    out = accuracy.compare(run)
    assert out["published_memory_gib"] == 7.4
    assert abs(out["memory_rel_err"]) <= 0.10, out["predicted_memory_gib"]
