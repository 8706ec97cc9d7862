"""`shardwise calibrate` on CPU: gloo collectives and CPU kernels, a profile the planner reads,
and a plan that moves the way the measurement says."""

from __future__ import annotations

import json
import time

import pytest

from shardwise import catalog
from shardwise.bench.calibrate import build_profile, bus_bandwidth, catalog_gpu
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy, TrainSpec
from shardwise.specs.profile import load_profile

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    from typer.testing import CliRunner

    from shardwise.cli import app

    out = tmp_path_factory.mktemp("calibrate") / "profile.json"
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, ["calibrate", "--gpus", "2", "--quick", "--out", str(out)])
    elapsed = time.perf_counter() - t0
    assert res.exit_code == 0, res.output
    return out, elapsed, res.output


def test_calibrate_runs_on_cpu_within_a_minute(profile):
    path, elapsed, output = profile
    assert elapsed < 60, elapsed
    assert str(path) in " ".join(output.split())
    doc = json.loads(path.read_text())
    raw = doc["raw"]
    assert doc["gpu_name"].startswith("cpu")  # says it measured a CPU, not a GPU
    for key in ("gemm_best_flops", "attention_flops", "memory_bytes_per_s"):
        assert raw[key] > 0
    assert doc["host_torch_adam_params_per_s"] > 0
    assert doc["intra"]["bus_bytes_per_s"] > 0 and doc["intra"]["latency_s"] > 0
    assert raw["collectives"]["world"] == 2 and raw["collectives"]["backend"] == "gloo"


def test_profile_moves_the_plan_the_way_it_was_measured(profile):
    """A CPU's rates are orders of magnitude below an A100's datasheet: the same plan with the
    profile predicts a far longer step; the communication uses the measured gloo bandwidth."""
    prof = load_profile(profile[0])
    m = catalog.get_model("llama-2-7b")
    hw = catalog.build_hardware(gpu="a100-80g", gpus=2, gpus_per_node=2)
    base = evaluate(m, hw, TrainSpec(), Strategy.from_name("fsdp")).time
    measured_hw = prof.apply(hw)
    measured = evaluate(m, measured_hw, TrainSpec(), Strategy.from_name("fsdp")).time
    assert measured_hw.gpu.peak_flops("bf16") == pytest.approx(prof.gpu.bf16_flops)
    assert measured.gemm_s > 10 * base.gemm_s and measured.tokens_per_s_per_gpu < base.tokens_per_s_per_gpu
    assert measured.comm_s > base.comm_s  # gloo on loopback is far slower than NVLink


def test_bus_bandwidth_follows_nccl_tests():
    # 2 ranks, 1 MiB all-gather in 1 ms: busbw = S·(n−1)/n / t = 2^20 · 1/2 / 1e-3
    secs = {"all_gather": {"1048576": 1e-3, "4096": 1e-4}, "reduce_scatter": {"1048576": 1e-3, "4096": 1e-4},
            "all_reduce": {"1048576": 2e-3, "4096": 2e-4}}
    bw = bus_bandwidth(secs, 2)
    assert bw["per_kind"]["all_gather"]["1048576"] == pytest.approx(2**20 / 2 / 1e-3)
    assert bw["per_kind"]["all_reduce"]["1048576"] == pytest.approx(2 * 2**20 / 2 / 2e-3)
    assert bw["bus_bytes_per_s"] == pytest.approx(2**20 / 2 / 1e-3)
    assert bw["latency_s"] == pytest.approx(1e-4)


def test_a_known_gpu_keeps_its_datasheet_peak():
    """On a catalog GPU the profile holds efficiencies (MFU stays relative to the datasheet)."""
    assert catalog_gpu("NVIDIA H200") == "h200" and catalog_gpu("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert catalog_gpu("NVIDIA A100-SXM4-40GB") == "a100-40g" and catalog_gpu("Quadro P400") is None
    device = {"device": "NVIDIA H200", "gemm_best_flops": 700e12, "attention_flops": 500e12,
              "memory_bytes_per_s": 4.0e12, "host_torch_adam_params_per_s": 1e9, "pcie_bytes_per_s": 50e9}
    doc = build_profile(device, None)
    assert "bf16_flops" not in doc["gpu"]
    assert doc["gpu"]["gemm_efficiency"] == pytest.approx(700 / 989)
    assert doc["gpu"]["hbm_efficiency"] == pytest.approx(4.0 / 4.8)
    assert doc["pcie_bytes_per_s"] == 50e9
