"""FP8 linears (`plan --fp8`): the decoder linears' GEMMs at the GPU's FP8 peak, the casts around
them, FSDP2's float8 all-gather, and what plan refuses. Expected figures are derived here by hand
from Llama 3.1 8B's config (hidden 4096, 32 layers, 32 heads / 8 KV heads of 128, intermediate
14336) and the H100 SXM datasheet (989 bf16, 1979 fp8 dense TFLOP/s)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import evaluate
from shardwise.plan.fp8 import cast_bytes
from shardwise.plan.planner import build_specs
from shardwise.specs import Strategy
from shardwise.specs.train import TrainSpec

H, KV, INTER, LAYERS = 4096, 1024, 14336, 32
LINEAR_PER_LAYER = H * (H + KV + KV + H) + 3 * H * INTER  # q, k, v, o; gate, up, down
IN_WIDTHS = 3 * H + H + 2 * H + INTER  # q/k/v read h, o reads q (h), gate/up read h, down reads i
OUT_WIDTHS = H + 2 * KV + H + 2 * INTER + H


def _eval(strategy: str = "fsdp", gpus: int = 8, **kw):
    m, hw, t = build_specs(model="llama-3.1-8b", gpu="h100-sxm", gpus=gpus, seq_len=8192, micro_batch=2,
                           precision="bf16-mixed", **kw)
    return evaluate(m, hw, t, Strategy.from_name(strategy)), m, hw, t


def test_the_layers_gemms_run_at_the_fp8_peak():
    """At 16,384 tokens a micro-batch the layers' GEMMs are compute-bound: fp8 halves their time
    on an H100 (1979 / 989 TFLOP/s), everything else (lm_head, attention) is unchanged."""
    bf16, _, hw, _ = _eval(fp8="none")
    fp8, *_ = _eval(fp8="tensorwise")
    tokens = 2 * 8192
    layer_flops = 3 * 2 * LINEAR_PER_LAYER * tokens * LAYERS  # forward, input and weight gradients
    rate = 989e12 * hw.gpu.gemm_efficiency
    saved = layer_flops / rate - layer_flops / (1979e12 * hw.gpu.gemm_efficiency)
    assert bf16.time.gemm_s - fp8.time.gemm_s == pytest.approx(saved, rel=0.02)
    assert fp8.time.attention_s == bf16.time.attention_s
    assert fp8.time.tokens_per_s_per_gpu > bf16.time.tokens_per_s_per_gpu


def test_the_casts_move_the_bytes_of_each_recipe():
    """tensorwise: 10 bytes an element of each linear's input, output gradient and weight per
    micro-batch; delayed (Transformer Engine): 4 of the input and gradient, and the weight's 4 once
    per optimizer step."""
    m = build_specs(model="llama-3.1-8b", gpu="h100-sxm", gpus=8)[0]
    tokens, k = 2 * 8192, 2
    t = TrainSpec(seq_len=8192, micro_batch=2, grad_accum=k, fp8="tensorwise")
    per_micro = 10 * tokens * IN_WIDTHS + 10 * tokens * OUT_WIDTHS + 10 * LINEAR_PER_LAYER
    assert cast_bytes(m, t, 1, LAYERS) == pytest.approx(k * LAYERS * per_micro, rel=1e-12)
    t = t.model_copy(update={"fp8": "delayed"})
    want = LAYERS * (k * (4 * tokens * IN_WIDTHS + 4 * tokens * OUT_WIDTHS) + 4 * LINEAR_PER_LAYER)
    assert cast_bytes(m, t, 1, LAYERS) == pytest.approx(want, rel=1e-12)
    # under full checkpointing the replayed forward casts its input and weight again
    t = TrainSpec(seq_len=8192, micro_batch=2, fp8="tensorwise", checkpointing="full")
    assert cast_bytes(m, t, 1, LAYERS) == pytest.approx(LAYERS * (per_micro + 5 * tokens * IN_WIDTHS
                                                                  + 5 * LINEAR_PER_LAYER), rel=1e-12)
    # mxfp8 (Transformer Engine's block scaling): one pass reads 2 bytes and writes both fp8
    # orientations (1 + 1) with an E8M0 scale per 32 values (2/32) of the input and the gradient
    # each micro-batch, of the weight once per step; backward reuses the saved columnwise copies
    t = TrainSpec(seq_len=8192, micro_batch=2, grad_accum=k, fp8="mxfp8")
    mx = 2 + 1 + 1 + 2 / 32
    want = LAYERS * (k * mx * tokens * (IN_WIDTHS + OUT_WIDTHS) + mx * LINEAR_PER_LAYER)
    assert cast_bytes(m, t, 1, LAYERS) == pytest.approx(want, rel=1e-12)


def test_fsdp2s_float8_all_gather_moves_and_holds_the_linears_in_one_byte():
    """The decoder linears' weights are gathered in fp8: one byte fewer per weight in forward and
    in backward's re-gather of the resharded layers (the trainer's stock sharding keeps the last
    layer: 31 of 32 re-gathered), and the two layers held unsharded (in flight and prefetched)."""
    plain, *_ = _eval(fp8="tensorwise")
    gathered, *_ = _eval(fp8="tensorwise", fp8_all_gather=True)
    linears = LINEAR_PER_LAYER * LAYERS
    regathered = 1.0 if plain.strategy.resharding == "all" else (LAYERS - 1) / LAYERS
    assert plain.comm.all_gather - gathered.comm.all_gather == pytest.approx(linears * (1 + regathered), rel=1e-9)
    assert plain.memory.gpu.gathered_params - gathered.memory.gpu.gathered_params == pytest.approx(
        2 * LINEAR_PER_LAYER, rel=1e-9)
    # other engines do not gather in fp8: nothing changes
    z3, z3_ag = _eval("zero3", fp8="tensorwise")[0], _eval("zero3", fp8="tensorwise", fp8_all_gather=True)[0]
    assert z3.comm.all_gather == z3_ag.comm.all_gather


@pytest.mark.parametrize(("args", "says"), [
    (["--gpu", "a100-80g", "--fp8", "tensorwise"], "a100-80g has no FP8 tensor-core rate"),
    (["--gpu", "h100-sxm", "--fp8", "tensorwise", "--lora-rank", "16"], "--fp8 tensorwise with LoRA"),
    (["--gpu", "h100-sxm", "--fp8", "rowwise", "--fp8-all-gather"], "--fp8-all-gather with --fp8 rowwise"),
    (["--gpu", "h100-sxm", "--fp8", "tensorwise", "--precision", "fp16-mixed"], "use bf16-mixed or bf16-pure"),
    (["--gpu", "h100-sxm", "--fp8", "tensorwise", "--fp8-all-gather", "-s", "zero3"], "no FSDP2 strategy is planned"),
    (["--gpu", "h100-sxm", "--fp8", "e4m3"], "--fp8"),
    (["--gpu", "h100-sxm", "--fp8", "mxfp8"], "MXFP8 block scaling runs on Blackwell tensor cores"),
])
def test_what_fp8_cannot_run_is_refused_naming_the_flag(args, says):
    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", *args])
    assert r.exit_code == 2, r.output
    assert says in r.output


def test_fp8_rows_are_plan_only_and_not_emitted(tmp_path):
    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "-s", "fsdp", "--fp8",
                                 "tensorwise", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["train"]["fp8"] == "tensorwise"
    assert doc["recommended_setting"]["runnable"] is False
    assert "torchtitan" in doc["reason"]
    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--fp8", "tensorwise",
                                 "--emit", str(tmp_path / "out")])
    assert r.exit_code == 2 and "--fp8 tensorwise is planner-only" in r.output


def test_the_spec_refuses_fp8_without_bf16_compute():
    with pytest.raises(ShardwiseError, match="bf16-mixed or bf16-pure"):
        TrainSpec(fp8="delayed", precision="fp32")


def test_mxfp8_plans_on_blackwell_and_is_refused_elsewhere_by_the_planner():
    m, hw, t = build_specs(model="llama-3.1-8b", gpu="b200", gpus=8, seq_len=8192, micro_batch=2,
                           precision="bf16-mixed", fp8="mxfp8")
    assert evaluate(m, hw, t, Strategy.from_name("fsdp")).time.tokens_per_s_per_gpu > 0
    m, hw, t = build_specs(model="llama-3.1-8b", gpu="h100-sxm", gpus=8, fp8="mxfp8")
    with pytest.raises(ShardwiseError, match=r"--fp8 mxfp8 on h100-sxm"):
        evaluate(m, hw, t, Strategy.from_name("fsdp"))


# --- Transformer Engine's recipes keep each linear's input in fp8 ------------------------------
# Llama 3.1 8B per token and layer: what TE's linears keep of their inputs against a bf16 input
# (2 bytes): q/k/v's and gate/up's (the two norm outputs, each read by those linears alone) and
# down_proj's (the MLP product) one byte each; o_proj's fp8 copy is a byte beside the attention
# output the kernel keeps (layernorm_linear.py `ln_out_to_save`, linear.py `saved_inputmat`)
def _per_token(fp8: str, tp: int = 1, model: str = "llama-3.1-8b") -> float:
    from shardwise import catalog
    from shardwise.plan.activations import layer_saved_per_token

    train = TrainSpec(seq_len=8192, micro_batch=1, fp8=fp8, attention="sdpa", sequence_parallel=tp > 1)
    return layer_saved_per_token(catalog.get_model(model), train, tp=tp)


@pytest.mark.parametrize("tp", [1, 4])
def test_transformer_engine_keeps_the_linears_inputs_in_fp8(tp):
    saved = 2 * H + INTER - H  # the two norm outputs and the product one byte fewer, o_proj's copy one more
    for te in ("delayed", "current"):
        assert _per_token("tensorwise", tp) - _per_token(te, tp) == pytest.approx(saved / tp)
    mx = 1 + 1 / 32  # MXFP8 keeps the columnwise copy with an E8M0 scale per 32 values
    assert _per_token("tensorwise", tp) - _per_token("mxfp8", tp) == pytest.approx((2 * H * (2 - mx) + INTER * (2 - mx)
                                                                                  - H * mx) / tp)
    assert _per_token("tensorwise", tp) == _per_token("none", tp)  # torchao keeps the bf16 inputs


def test_transformer_engine_in_a_gpt_block_and_an_moe_layer():
    # MPT-7B (d_model 4096, 4h GeLU MLP): fc1's GeLU keeps fc1's output, fc2 the GeLU output in fp8
    h, inter = 4096, 4 * 4096
    assert _per_token("none", model="mpt-7b") - _per_token("delayed", model="mpt-7b") == pytest.approx(2 * h + inter - h)
    # Qwen3-30B-A3B (hidden 2048, 32 query heads of 128): only the attention side's norm output is the
    # linears' alone (the MoE norm feeds the router too); o_proj reads 4096 wide; the experts stay bf16
    assert _per_token("none", model="qwen3-30b-a3b") - _per_token("current", model="qwen3-30b-a3b") \
        == pytest.approx(2048 - 32 * 128)


def test_current_scaling_reads_each_tensor_once_more_than_delayed():
    """Current scaling: an amax read (2 bytes) before delayed scaling's cast-transpose (4): every
    cast 6/4 of delayed's, the weights' once a step as delayed's."""
    from shardwise import catalog

    m = catalog.get_model("llama-3.1-8b")
    for ckpt in ("none", "full"):
        t = TrainSpec(seq_len=8192, micro_batch=2, grad_accum=4, checkpointing=ckpt, fp8="delayed")
        cur = t.model_copy(update={"fp8": "current"})
        assert cast_bytes(m, cur, 1, LAYERS) == pytest.approx(1.5 * cast_bytes(m, t, 1, LAYERS))


def test_current_scaling_through_the_cli():
    ok = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "-s", "fsdp",
                                  "--fp8", "current", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["train"]["fp8"] == "current"
    bad = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "a100-80g", "--fp8", "current"])
    assert bad.exit_code == 2 and "a100-80g has no FP8 tensor-core rate" in bad.output


def test_torchaos_mxlinear_keeps_bf16_inputs_and_casts_a_dimension_a_kernel():
    """torchao's MXLinear (torchtitan's "mx" converter) saves input_hp and weight_hp, as its float8
    does; each cast writes one orientation (2 + 1 + 1/32 bytes): input and weight forward, the
    gradient twice and the saved input and weight again in backward, every micro-batch."""
    from shardwise import catalog

    assert _per_token("mxfp8-torchao") == _per_token("none")
    m = catalog.get_model("llama-3.1-8b")
    t = TrainSpec(seq_len=8192, micro_batch=2, grad_accum=3, fp8="mxfp8-torchao")
    one = 2 + 1 + 1 / 32
    tokens, k = 2 * 8192, 3
    per_micro = one * (tokens * IN_WIDTHS) * 2 + 2 * one * tokens * OUT_WIDTHS + 2 * one * LINEAR_PER_LAYER
    assert cast_bytes(m, t, 1, LAYERS) == pytest.approx(LAYERS * k * per_micro)
    from shardwise.plan.fp8 import recipe_refusal

    assert recipe_refusal(catalog.get_gpu("b200"), t) is None
    assert "--fp8 mxfp8-torchao on h100-sxm: MXFP8 block scaling runs on Blackwell" in recipe_refusal(
        catalog.get_gpu("h100-sxm"), t)
