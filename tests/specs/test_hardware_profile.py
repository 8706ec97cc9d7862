"""A measured hardware profile replaces the catalog's figures, and the plan moves the way the
measurement says (slower GEMMs → longer step; faster network → less exposed communication)."""

from __future__ import annotations

import json

import pytest

from shardwise import catalog
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy, TrainSpec
from shardwise.specs.profile import HardwareProfile, default_profile_path, load_profile

M = catalog.get_model("llama-2-7b")


def _write(tmp_path, doc) -> str:
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_measured_gemm_rate_slows_the_plan(tmp_path):
    hw = catalog.build_hardware(gpu="h100-sxm", gpus=8)
    base = evaluate(M, hw, TrainSpec(), Strategy.from_name("fsdp")).time
    prof = load_profile(_write(tmp_path, {"gpu_name": "NVIDIA H100 80GB HBM3",
                                          "gpu": {"gemm_efficiency": hw.gpu.gemm_efficiency / 2}}))
    slow = evaluate(M, prof.apply(hw), TrainSpec(), Strategy.from_name("fsdp")).time
    assert slow.gemm_s == pytest.approx(2 * base.gemm_s, rel=0.05)  # compute-bound GEMMs at half the rate
    assert slow.step_s > base.step_s and slow.tokens_per_s_per_gpu < base.tokens_per_s_per_gpu


def test_measured_network_changes_exposed_communication(tmp_path):
    hw = catalog.build_hardware(gpu="a100-80g", gpus=16, gpus_per_node=8, inter="eth-10")
    base = evaluate(M, hw, TrainSpec(), Strategy.from_name("zero3")).time
    fast = HardwareProfile(gpu_name="A100", inter={"bus_bytes_per_s": 25e9}).apply(hw)
    assert fast.inter.bus_bytes_per_s == 25e9 and fast.gpu == hw.gpu  # only what was measured changes
    t = evaluate(M, fast, TrainSpec(), Strategy.from_name("zero3")).time
    assert t.comm_s < base.comm_s and t.step_s < base.step_s


def test_bad_profiles_name_the_file_and_field(tmp_path):
    with pytest.raises(ShardwiseError, match=r"gpu\.gemm_efficiency"):
        load_profile(_write(tmp_path, {"gpu_name": "x", "gpu": {"gemm_efficiency": 1.7}}))
    with pytest.raises(ShardwiseError, match="unknown field"):
        load_profile(_write(tmp_path, {"gpu_name": "x", "gpu": {"gemm_eff": 0.5}}))
    bad = tmp_path / "broken.json"
    bad.write_text('{"gpu_name": "x",\n "gpu": }')
    with pytest.raises(ShardwiseError, match=r"broken\.json:2"):
        load_profile(bad)
    with pytest.raises(ShardwiseError, match="shardwise calibrate"):
        load_profile(tmp_path / "missing.json")


def test_default_path_is_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_profile_path() == tmp_path / "shardwise" / "hardware-profile.json"


def test_trainer_config_applies_the_profile(tmp_path):
    from shardwise.config.load import validate
    from shardwise.run import run_spec

    path = _write(tmp_path, {"gpu_name": "NVIDIA H200", "gpu": {"hbm_efficiency": 0.5, "memory_bytes": 100e9}})
    cfg = validate({"model": {"name": "tiny-llama"}, "hardware": {"gpu": "h200", "profile": path}})
    run = run_spec(cfg, 1, "cpu")
    assert run.hardware.gpu.hbm_efficiency == 0.5 and run.hardware.gpu.memory_bytes == 100e9
    plain = run_spec(validate({"model": {"name": "tiny-llama"}, "hardware": {"gpu": "h200"}}), 1, "cpu")
    assert plain.hardware.gpu.hbm_efficiency == catalog.get_gpu("h200").hbm_efficiency


def test_plan_cli_takes_a_profile_and_nics(tmp_path):
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    def tps(*flags: str) -> float:
        res = CliRunner().invoke(app, ["plan", "--json", "--gpu", "h100-sxm", "--gpus", "16", "--gpus-per-node", "8",
                                       "-s", "fsdp", *flags])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["strategies"][0]["time"]["tokens_per_s_per_gpu"]

    slow = _write(tmp_path, {"gpu_name": "H100", "gpu": {"gemm_efficiency": 0.3}})
    assert tps("--profile", slow) < tps()
    # one NIC per node instead of one per GPU: the cross-node rings slow down
    assert tps("--nics-per-node", "1") < tps()
    res = CliRunner().invoke(app, ["plan", "--profile", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "nope.json" in res.output


def test_profile_timing_constants_override_the_catalog_and_say_measured():
    """A profile's measured host constants replace the bundled time model's, and the provenance of
    each (and of the GPU efficiencies it measured) says where: `shardwise calibrate` on that GPU."""
    hw = catalog.build_hardware(gpu="h100-sxm", gpus=1)
    prof = HardwareProfile(gpu_name="NVIDIA H100 80GB HBM3", measured_at="2026-12-02",
                           timing={"launch_s": 25e-6, "fsdp2_hook_s": 1e-3},
                           host_torch_adam_params_per_s=2e8, gpu={"gemm_efficiency": 0.5})
    out = prof.apply(hw)
    assert (out.timing.launch_s, out.timing.fsdp2_hook_s) == (25e-6, 1e-3)
    assert out.timing.host_torch_adam_params_per_s == 2e8
    for name in ("launch_s", "fsdp2_hook_s", "host_torch_adam_params_per_s"):
        assert out.timing.provenance[name].kind == "measured"
        assert "NVIDIA H100" in out.timing.provenance[name].basis
    assert out.timing.provenance["elementwise_factor"] == hw.timing.provenance["elementwise_factor"]
    assert out.gpu.efficiency_provenance["gemm_efficiency"].kind == "measured"
    assert out.gpu.efficiency_provenance["hbm_efficiency"] == hw.gpu.efficiency_provenance["hbm_efficiency"]
    # and the plan moves the way the measurement says: slower launches and hooks, a longer step
    model = catalog.get_model("qwen2.5-0.5b")
    train = TrainSpec(seq_len=1024, micro_batch=2)
    s = Strategy.from_name("fsdp", fsdp={"single_rank": "fsdp"})
    assert evaluate(model, out, train, s).time.step_s > evaluate(model, hw, train, s).time.step_s


def test_profile_with_an_unknown_timing_constant_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "gpu_name": "x", "timing": {"launch_seconds": 1e-5}}))
    with pytest.raises(ShardwiseError, match="launch_seconds"):
        load_profile(path)


def test_every_bundled_constant_has_a_provenance():
    tm = catalog.timing_model()
    for name, prov in tm.provenance.items():
        assert prov.kind in ("fitted", "measured", "derived", "assumed") and prov.basis, name
        if prov.kind == "fitted":
            assert len(prov.cases) >= 3 and len(prov.sources) >= 2, name
    for family in catalog.family_names():
        _, provs = catalog.family_efficiencies(family)
        assert set(provs) >= {"gemm_efficiency", "attention_efficiency", "hbm_efficiency"}


def _cpu_profile_doc() -> dict:
    """What `shardwise calibrate` writes on a machine without a GPU (bench/calibrate.py build_profile)."""
    from shardwise.bench.calibrate import build_profile

    device = {"device": "cpu", "gemm_best_flops": 2e11, "attention_flops": 5e10, "memory_bytes_per_s": 1e10,
              "host_torch_adam_params_per_s": 1e8, "adamw_params_per_s": 1e8, "adamw_impl": "forloop"}
    return build_profile(device, None)


def test_a_cpu_profile_is_refused_for_a_gpu_plan_naming_the_file(tmp_path):
    """Applied, a CPU's measured GEMM rate becomes the GPU's peak: the plan printed "MFU 90%",
    "0 tokens/s per GPU". `plan --profile` refuses it, naming the file and why."""
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    path = _write(tmp_path, _cpu_profile_doc())
    for args in (["plan", "--profile", path], ["plan", "--json", "--profile", path]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, res.output
        out = " ".join(res.output.split())
        assert path in out and "measured on a CPU" in out and "shardwise calibrate" in out
        assert "tokens/s" not in out and "MFU" not in out  # nothing planned with it
    with pytest.raises(ShardwiseError, match="measured on a CPU"):
        load_profile(path)
    # an older CPU profile without `device`: its gpu_name says so
    doc = _cpu_profile_doc()
    del doc["device"]
    with pytest.raises(ShardwiseError, match="measured on a CPU"):
        load_profile(_write(tmp_path, doc))
    # for a run on the CPU (the trainer's hardware.profile with device cpu) it is what was measured
    hw = load_profile(path, device="cpu").apply(catalog.build_hardware(gpu="a100-80g", gpus=2))
    assert hw.gpu.bf16_flops == 2e11


def test_trainer_refuses_a_cpu_profile_on_cuda_only(tmp_path):
    from shardwise.config.load import validate
    from shardwise.run import run_spec

    path = _write(tmp_path, _cpu_profile_doc())
    cfg = validate({"model": {"name": "tiny-llama"}, "hardware": {"gpu": "h200", "profile": path}})
    assert run_spec(cfg, 1, "cpu").hardware.gpu.bf16_flops == 2e11
    with pytest.raises(ShardwiseError, match="measured on a CPU") as err:
        run_spec(cfg, 1, "cuda")
    assert path in str(err.value) and "cannot run" not in str(err.value)  # the profile's error, not a layout's


def test_mfu_above_100_percent_is_refused_naming_the_inputs(monkeypatch):
    """The step is priced at most at the peak, so MFU > 100% means inconsistent inputs: here a
    model FLOP count 10x the one the step was priced with. Refused, naming peak and efficiencies."""
    import shardwise.plan.timing as timing

    hw = catalog.build_hardware(gpu="h100-sxm", gpus=8)
    ok = evaluate(M, hw, TrainSpec(), Strategy.from_name("zero3")).time.mfu
    assert 0 < ok < 1
    real = timing.run_flops_per_token
    monkeypatch.setattr(timing, "run_flops_per_token", lambda m, t: real(m, t) * 10)
    with pytest.raises(ShardwiseError) as err:
        evaluate(M, hw, TrainSpec(), Strategy.from_name("zero3"))
    msg = str(err.value)
    for name in ("above 100%", "h100-sxm", "bf16 peak", "gemm_efficiency", "attention_efficiency", M.name):
        assert name in msg, (name, msg)


def test_slow_rates_print_significant_digits_not_zero():
    from shardwise.numfmt import rate

    assert [rate(x) for x in (0.00123, 0.5, 42.46, 3204.2)] == ["0.00123", "0.5", "42.5", "3,204"]
