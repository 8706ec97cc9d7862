"""The RTX A6000 catalog entry.

Expected figures come from NVIDIA's Ampere GA102 whitepaper v2 (RTX A6000: 154.8 dense FP16/BF16
tensor TFLOPS with FP32 accumulate, 309.7 with sparsity; 48 GB GDDR6 at 768 GB/s; PCIe 4.0) and an
nvidia-smi log (49140 MiB), not from the planner; the published rows are torchtune's README at
1814feb (benchmarks/published/torchtune-readme-2024-11.yaml)."""

from __future__ import annotations

import pytest

from shardwise import catalog


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
