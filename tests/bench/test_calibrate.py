"""`shardwise calibrate` on CPU: gloo collectives and CPU kernels, a profile the planner reads,
and a plan that moves the way the measurement says."""

from __future__ import annotations

import json
import time

import pytest

from shardwise import catalog
from shardwise.bench.calibrate import (
    build_profile,
    bus_bandwidth,
    catalog_gpu,
    measure_collectives,
    node_groups,
)
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy, TrainSpec
from shardwise.specs.profile import load_profile

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    from typer.testing import CliRunner

    from shardwise.cli.app import app

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
    assert doc["gpu_name"].startswith("cpu") and doc["device"] == "cpu"  # says it measured a CPU, not a GPU
    for key in ("gemm_best_flops", "attention_flops", "memory_bytes_per_s"):
        assert raw[key] > 0
    assert doc["host_torch_adam_params_per_s"] > 0
    assert doc["intra"]["bus_bytes_per_s"] > 0 and doc["intra"]["latency_s"] > 0
    assert raw["collectives"]["world"] == 2 and raw["collectives"]["backend"] == "gloo"
    assert "inter" not in doc  # one node: nothing crosses nodes
    # the AdamW kernel the trainer uses on CPU (run/bridge.py optimizer_impl), measured and labelled
    assert doc["gpu"]["adamw_impl"] == "forloop" and doc["gpu"]["adamw_params_per_s"] > 0
    assert load_profile(path, device="cpu").apply(catalog.build_hardware(gpu="a100-80g", gpus=2)).gpu.adamw_impl == "forloop"
    # the time model's host costs, measured here and carried into the plan as measured
    timing = doc["timing"]
    assert 1e-7 < timing["launch_s"] < 1e-3  # an eager op: microseconds, not nothing, not milliseconds
    assert 1e-6 < timing["fsdp2_hook_s"] < 5e-2
    hw = load_profile(path, device="cpu").apply(catalog.build_hardware(gpu="a100-80g", gpus=2))
    assert hw.timing.fsdp2_hook_s == timing["fsdp2_hook_s"]
    assert hw.timing.provenance["launch_s"].kind == "measured"


def test_profile_moves_the_plan_the_way_it_was_measured(profile):
    """A CPU's rates are orders of magnitude below an A100's datasheet: the same plan with the
    profile predicts a far longer step; the communication uses the measured gloo bandwidth.
    (Applied for a run on the CPU, its one use; a GPU plan refuses it: test_hardware_profile.py.)"""
    prof = load_profile(profile[0], device="cpu")  # a CPU profile applies to a run on the CPU only
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


def test_a_slower_measured_adamw_lengthens_the_planned_step():
    """The optimizer step is priced from the profile's AdamW rate when it has one: half the
    rate, twice the update's time; a faster one, a shorter step; no rate, the bytes model."""
    from shardwise.specs.profile import HardwareProfile

    m = catalog.get_model("llama-2-7b")
    hw = catalog.build_hardware(gpu="h100-sxm", gpus=8)
    train, s = TrainSpec(), Strategy.from_name("zero2")

    def planned(rate):
        prof = HardwareProfile(gpu_name="H100", gpu={"adamw_params_per_s": rate, "adamw_impl": "fused"})
        return evaluate(m, prof.apply(hw), train, s).time

    base = evaluate(m, hw, train, s).time
    fast, slow = planned(4e10), planned(2e10)
    assert slow.optimizer_s > fast.optimizer_s and slow.step_s > fast.step_s
    assert slow.tokens_per_s_per_gpu < fast.tokens_per_s_per_gpu
    # the update's share doubles; clipping and DeepSpeed's copies stay priced by bytes
    from shardwise.plan.stage import stage_params

    shard = stage_params(m, 1, 1) / 8  # ZeRO-2 shards the optimizer over the 8 ranks
    assert slow.optimizer_s - fast.optimizer_s == pytest.approx(shard / 2e10 - shard / 4e10, rel=1e-6)
    # a rate that matches the bytes model's bandwidth gives the bytes model's time
    from shardwise.plan.kernels import OPTIMIZER_BYTES

    same = hw.gpu.hbm_bytes_per_s * hw.gpu.hbm_efficiency / OPTIMIZER_BYTES["fused"]
    assert planned(same).optimizer_s == pytest.approx(base.optimizer_s, rel=1e-9)
    # a rate measured with another kernel scales by the kernels' bytes (foreach moves more)
    foreach = evaluate(m, HardwareProfile(gpu_name="H100", gpu={"adamw_params_per_s": 2e10, "adamw_impl": "foreach"})
                       .apply(hw), train, s).time
    assert foreach.optimizer_s < slow.optimizer_s


def test_node_groups_split_intra_and_inter():
    assert node_groups(8, 8) == {"intra": [list(range(8))]}
    assert node_groups(4, 2) == {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]]}
    assert node_groups(3, 1) == {"inter": [[0, 1, 2]]}
    with pytest.raises(Exception, match="LOCAL_WORLD_SIZE"):
        node_groups(6, 4)


def test_ranks_laid_out_as_two_nodes_measure_the_inter_node_link():
    """LOCAL_WORLD_SIZE=1 over 2 ranks: two one-rank "nodes", so the collectives run across them
    and the profile gets an `inter` link (how torchrun / srun over several nodes is measured)."""
    c = measure_collectives(2, quick=True, local_world=1)
    assert set(c["levels"]) == {"inter"} and c["local_world"] == 1
    assert c["levels"]["inter"]["group_size"] == 2 and c["levels"]["inter"]["bus_bytes_per_s"] > 0
    device = {"device": "cpu", "gemm_best_flops": 1e11, "attention_flops": 5e10, "memory_bytes_per_s": 1e10,
              "host_torch_adam_params_per_s": 1e8, "adamw_params_per_s": 1e8, "adamw_impl": "forloop"}
    doc = build_profile(device, c)
    assert "intra" not in doc and doc["inter"]["bus_bytes_per_s"] == c["levels"]["inter"]["bus_bytes_per_s"]
    hw = load_profile_doc(doc).apply(catalog.build_hardware(gpu="a100-80g", gpus=16, gpus_per_node=8))
    assert hw.inter.bus_bytes_per_s == doc["inter"]["bus_bytes_per_s"]


def load_profile_doc(doc):
    from shardwise.specs.profile import HardwareProfile

    return HardwareProfile.model_validate(doc)
