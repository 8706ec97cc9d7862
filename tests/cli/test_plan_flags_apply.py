"""`shardwise plan` inputs that should not pass silently: a knob for an engine nothing planned
runs, a chunk size for a loss that is not chunked (refused, exit 2, naming the flag); a sequence
beyond the model's trained context (said, not refused: RoPE scaling exists); a --profile's
measured figures shown in --json's hardware section, as planned."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardwise.cli.app import app


def run(*args):
    return CliRunner().invoke(app, ["plan", *args])


@pytest.mark.parametrize(("args", "flag"), [
    (["-s", "fsdp", "--ds-bucket", "5e7"], "--ds-bucket"),
    (["-s", "ddp", "-s", "fsdp-grad-op", "--ds-reduce-bucket", "5e7"], "--ds-reduce-bucket"),
    (["-s", "fsdp", "--no-ds-overlap-comm"], "--ds-overlap-comm"),
    (["-s", "ddp", "--ds-comm-dtype", "bf16"], "--ds-comm-dtype"),
    (["-s", "zero2", "--ds-prefetch", "1e7"], "--ds-prefetch"),  # a ZeRO-3 knob, ZeRO-2 planned
    (["-s", "zero3", "--no-ds-multi-rank-allreduce"], "--ds-multi-rank-allreduce"),  # ZeRO-1/2 only
])
def test_deepspeed_knobs_without_a_strategy_they_apply_to_are_refused(args, flag):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert flag in res.output and "drop the flag" in res.output


def test_deepspeed_knobs_with_a_deepspeed_strategy_plan(tmp_path):
    assert run("-s", "fsdp", "-s", "zero2", "--ds-bucket", "5e7", "--json").exit_code == 0
    assert run("-s", "zero3", "--ds-prefetch", "1e7", "--json").exit_code == 0
    assert run("--ds-bucket", "5e7", "--json").exit_code == 0  # the default list has DeepSpeed strategies
    # --emit-strategy names a strategy that is planned too
    res = run("-s", "fsdp", "--emit-strategy", "zero2", "--ds-bucket", "5e7", "--emit", str(tmp_path / "e"))
    assert "DeepSpeed knob" not in res.output


def test_ce_chunk_needs_the_chunked_loss():
    res = run("--ce-chunk", "2048", "--cross-entropy", "standard")
    assert res.exit_code == 2 and "--ce-chunk" in res.output and "--cross-entropy chunked" in res.output
    alone = run("--ce-chunk", "2048", "--json", "-s", "fsdp")  # the chunked loss is the schema's default
    assert alone.exit_code == 0 and json.loads(alone.stdout)["train"]["ce_chunk"] == 2048
    res = run("--ce-chunk", "2048", "--cross-entropy", "fused")
    assert res.exit_code == 2 and "'fused'" in res.output
    ok = run("--ce-chunk", "2048", "--cross-entropy", "chunked", "--json", "-s", "fsdp")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["train"]["ce_chunk"] == 2048


def test_a_sequence_beyond_the_trained_context_is_said_not_refused():
    # llama-2-7b: max_position_embeddings 4096
    res = run("-m", "llama-2-7b", "--seq-len", "8192", "-s", "fsdp", "--checkpointing", "full", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # the warning goes to stderr: stdout stays one JSON object
    assert doc["train"]["seq_len"] == 8192
    assert any("--seq-len 8192" in w and "max_position_embeddings 4096" in w for w in doc["warnings"])
    assert "max_position_embeddings 4096" in res.stderr
    table = run("-m", "llama-2-7b", "--seq-len", "8192", "-s", "fsdp", "--checkpointing", "full")
    assert table.exit_code == 0 and "warning:" in table.stderr
    within = run("-m", "llama-2-7b", "--seq-len", "4096", "-s", "fsdp", "--json")
    assert json.loads(within.stdout)["warnings"] == [] and "warning" not in within.stderr


def test_the_json_hardware_is_the_hardware_as_planned_with_a_profile(tmp_path):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"gpu_name": "NVIDIA H100 80GB HBM3", "pcie_bytes_per_s": 1.1e10,
                                "host_adam_params_per_s": 7.0e8,
                                "gpu": {"gemm_efficiency": 0.55, "hbm_bytes_per_s": 3.0e12,
                                        "adamw_params_per_s": 4.0e10, "adamw_impl": "fused"},
                                "intra": {"bus_bytes_per_s": 3.0e11}}))

    def hardware(*flags):
        res = run("--gpu", "h100-sxm", "-s", "fsdp", "--json", *flags)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["hardware"]

    catalog_hw, measured = hardware(), hardware("--profile", str(prof))
    assert catalog_hw["profile"] is None and measured["profile"] == str(prof)
    assert catalog_hw["gpu_rates"]["gemm_efficiency"] != 0.55  # the catalog's (timing.yaml's hopper family)
    assert measured["gpu_rates"]["gemm_efficiency"] == 0.55 and measured["gpu_rates_kind"]["gemm_efficiency"] == "measured"
    assert measured["gpu_rates"]["hbm_bytes_per_s"] == 3.0e12
    assert measured["gpu_rates"]["adamw_params_per_s"] == 4.0e10 and measured["gpu_rates"]["adamw_impl"] == "fused"
    assert measured["pcie_bytes_per_s"] == 1.1e10
    assert measured["timing"]["host_adam_params_per_s"] == 7.0e8 and measured["timing_kind"]["host_adam_params_per_s"] == "measured"
    assert measured["links"]["intra"]["bus_bytes_per_s"] == 3.0e11
    # what the profile leaves out keeps the catalog's value
    assert measured["gpu_rates"]["attention_efficiency"] == catalog_hw["gpu_rates"]["attention_efficiency"]
    assert measured["timing"]["host_torch_adam_params_per_s"] == catalog_hw["timing"]["host_torch_adam_params_per_s"]
    assert measured["timing_kind"]["host_torch_adam_params_per_s"] == catalog_hw["timing_kind"]["host_torch_adam_params_per_s"]
