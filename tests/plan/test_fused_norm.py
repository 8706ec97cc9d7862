"""`--fused-norm`: each RMSNorm as one kernel (torchtitan's fused_rmsnorm, Liger, apex). One fact,
`TrainSpec.norm_fused` (also implied by --fused-kernels), read by what the norm saves for backward
(plan/activations.py) and by the bytes it moves (plan/kernels.py)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app
from shardwise.plan.activations import layer_saved_per_token
from shardwise.plan.kernels import elementwise_bytes
from shardwise.specs import TrainSpec

L7 = catalog.get_model("llama-2-7b")  # hidden 4096
H = 4096
EAGER = TrainSpec(seq_len=2048)
FUSED = EAGER.model_copy(update={"fused_norm": True})


def test_fused_kernels_imply_a_fused_norm():
    assert FUSED.norm_fused and not EAGER.norm_fused
    assert EAGER.model_copy(update={"fused_kernels": True}).norm_fused


def test_the_fused_norm_moves_its_input_and_output_once():
    # per token and norm, bf16 (c = 2): HF's chain reads x, writes and reads its fp32 upcast, pow,
    # mean, x·rsqrt, the cast back and the weight: r + 28 + 3c = 36 bytes per element; one kernel
    # reads x and writes the output: r + c = 4. Two norms per layer: 2 · 4096 · 32 fewer bytes.
    assert elementwise_bytes(L7, EAGER, False, 1) - elementwise_bytes(L7, FUSED, False, 1) == 2 * H * 32


def test_the_fused_norm_saves_its_input_not_the_fp32_upcast():
    # HF's LlamaRMSNorm saves the fp32 upcast (4h, for pow and the multiply), the fp32 rstd per row
    # and the normalised tensor (c·h, the weight's grad); a fused kernel its c-byte input and the
    # rstd: 4h fewer per norm, two norms per layer
    assert layer_saved_per_token(L7, EAGER) - layer_saved_per_token(L7, FUSED) == 2 * 4 * H


def test_plan_takes_fused_norm():
    def plan(*flags):
        res = CliRunner().invoke(app, ["plan", "--json", "-m", "llama-2-7b", "--gpu", "h100-sxm", "--gpus", "8",
                                       "-s", "fsdp", "--no-fused-kernels", *flags])  # eager layers: HF's RMSNorm
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    eager, fused = plan(), plan("--fused-norm")
    assert fused["train"]["fused_norm"] is True and eager["train"]["fused_norm"] is False
    e, f = eager["strategies"][0], fused["strategies"][0]
    assert f["memory"]["activations"] < e["memory"]["activations"]
    assert f["time"]["memory_bound_s"] < e["time"]["memory_bound_s"]
    assert f["time"]["gemm_s"] == e["time"]["gemm_s"]
