"""Communication volumes, step time, the recommender and `shardwise explain`: expectations
derived here by hand from the ZeRO paper and the engines' documented behaviour."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app
from shardwise.config.strategy import STRATEGY_NAMES
from shardwise.plan.comm import ideal_comm, plan_comm
from shardwise.plan.evaluate import evaluate, resolved
from shardwise.plan.recommend import recommend
from shardwise.specs import Strategy, TrainSpec

M7 = catalog.get_model("llama-2-7b")
PSI = M7.params
HW8 = catalog.build_hardware(gpus=8)


@pytest.mark.parametrize("name, factor", [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 3), ("fsdp", 3)])
def test_paper_volumes(name, factor):
    # ZeRO paper §7: 2Ψ for DDP / ZeRO-1 / ZeRO-2, 3Ψ for ZeRO-3 (fp16 elements: 2 bytes)
    assert ideal_comm(PSI, Strategy.from_name(name)).total == pytest.approx(factor * 2 * PSI)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_engine_volumes_bf16_with_accumulation(k):
    train = TrainSpec(grad_accum=k)
    # FSDP2's gradient sync resolved as plan resolves it (memory, comm and time read a bool)
    comm = {n: plan_comm(M7, HW8, train, resolved(M7, HW8, train, Strategy.from_name(n)))
            for n in ("ddp", "zero1", "zero2", "fsdp", "fsdp-grad-op")}
    # DDP: fp32 gradients (autocast keeps fp32 params) all-reduced once per step (no_sync)
    assert comm["ddp"].all_reduce == pytest.approx(4 * PSI)
    # DeepSpeed ZeRO-1: bf16 bucket all-reduce once per step; ZeRO-2 once per micro-batch;
    # both all-gather the updated bf16 params once
    assert comm["zero1"].all_reduce == pytest.approx(2 * PSI)
    assert comm["zero2"].all_reduce == pytest.approx(2 * PSI * k)
    assert comm["zero1"].all_gather == comm["zero2"].all_gather == pytest.approx(2 * PSI)
    # FSDP2: bf16 all-gather of everything in forward and of the layers again in backward (not
    # the root group, not the last layer: neither is resharded after forward), every
    # micro-batch; fp32 reduce-scatter once (sync disabled before)
    regathered = M7.params_per_layer * (M7.num_layers - 1)
    assert comm["fsdp"].all_gather == pytest.approx(2 * PSI * k + 2 * regathered * k)
    assert comm["fsdp"].reduce_scatter == pytest.approx(4 * PSI)
    assert comm["fsdp-grad-op"].all_gather == pytest.approx(2 * PSI * k)


def test_zero1_zero2_reduce_to_owner_is_the_paper_volume():
    from shardwise.config.strategy import DeepSpeedKnobs

    s = Strategy.from_name("zero2", ds=DeepSpeedKnobs(use_multi_rank_bucket_allreduce=False))
    c = plan_comm(M7, HW8, TrainSpec(), s)
    assert c.total == pytest.approx(ideal_comm(PSI, s).total)  # 2Ψ in bf16
    default = plan_comm(M7, HW8, TrainSpec(), Strategy.from_name("zero2"))
    assert default.total == pytest.approx(1.5 * c.total)  # all-reduce (2Ψ) + all-gather (Ψ)


def test_zero3_regathers_large_models_every_micro_batch():
    c = plan_comm(M7, HW8, TrainSpec(grad_accum=2), Strategy.from_name("zero3"))
    # Ψ > stage3_max_live_parameters (1e9): params are released after forward and gathered
    # again in backward; persistent tensors (norms, < 1e5 elements) once after the step
    norms = (2 * M7.num_layers + 1) * M7.hidden_size
    assert c.all_gather == pytest.approx(2 * ((PSI - norms) * 2 * 2 + norms))
    assert c.reduce_scatter == pytest.approx(2 * PSI * 2)


def test_hybrid_splits_link_levels():
    hw = catalog.build_hardware(gpus=16, gpus_per_node=8, inter="eth-100")
    c = plan_comm(M7, hw, TrainSpec(), Strategy.from_name("fsdp-hybrid"))
    full = plan_comm(M7, hw, TrainSpec(), Strategy.from_name("fsdp"))
    # all-gathers and reduce-scatters stay inside the node; across nodes only the 1/8 shard of
    # fp32 gradients is all-reduced (ring volume 2 × 4Ψ/8)
    assert c.inter == pytest.approx(2 * 4 * PSI / 8)
    assert c.intra == pytest.approx(c.all_gather + c.reduce_scatter)
    assert full.inter == pytest.approx(full.total) and full.intra == 0
    t_h = evaluate(M7, hw, TrainSpec(), Strategy.from_name("fsdp-hybrid")).time
    t_f = evaluate(M7, hw, TrainSpec(), Strategy.from_name("fsdp")).time
    assert t_h.step_s < t_f.step_s


def test_tensor_parallel_all_reduces():
    train = TrainSpec(seq_len=2048, micro_batch=1)
    c = plan_comm(M7, HW8, train, Strategy.from_name("zero1", tp=2, tp_impl="megatron"))
    # Megatron: 2 all-reduces of b·s·h (bf16) forward and 2 backward per layer, plus the
    # vocabulary-parallel root's one per pass (embedding, lm_head) and the vocab-parallel loss's
    # two fp32 per token and its sum (measured: tests/accuracy/test_measured_tp_comm.py)
    act = 2 * 2048 * M7.hidden_size
    tp_bytes = (4 * M7.num_layers + 2) * act + 4 * (2 * 2048 + 1)
    assert c.all_reduce - 2 * (M7.params / 2) == pytest.approx(tp_bytes, rel=1e-6)
    # DeepSpeed's AutoTP (zero1's own TP): 2 forward all-reduces per layer (o, down) and one per
    # column-parallel linear in backward (q, k, v, gate, up); embedding, lm_head and loss whole
    auto = plan_comm(M7, HW8, train, Strategy.from_name("zero1", tp=2))
    root = M7.params - M7.layer_params
    dp_grads = 2 * (M7.layer_params / 2 + root)  # bf16 gradients of the rank's replica
    assert auto.all_reduce - dp_grads == pytest.approx((2 + 5) * M7.num_layers * act, rel=1e-6)
    full = plan_comm(M7, HW8, train.model_copy(update={"checkpointing": "full"}), Strategy.from_name("zero1", tp=2))
    assert full.all_reduce - auto.all_reduce == pytest.approx(2 * M7.num_layers * act, rel=1e-6)  # the recompute


def test_pipeline_bubble():
    train = TrainSpec(grad_accum=4)
    e = evaluate(M7, HW8, train, Strategy.from_name("zero1", pp=4))
    frac = (4 - 1) / (4 + 4 - 1)
    t = e.time
    # the bubble is that fraction of the pipeline's time (the step without exposed comm and offload)
    assert t.bubble_s / (t.step_s - t.exposed_comm_s - t.offload_s) == pytest.approx(frac)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_time_invariants(name):
    e = evaluate(M7, HW8, TrainSpec(), Strategy.from_name(name))
    t = e.time
    assert 0 <= t.exposed_comm_s <= t.comm_s + 1e-12
    assert t.step_s >= t.compute_s
    assert 0 < t.mfu < 0.6  # never above the achievable fraction of peak
    slow = catalog.build_hardware(gpus=8, gpus_per_node=8, interconnect="pcie")
    assert evaluate(M7, slow, TrainSpec(), Strategy.from_name(name)).time.step_s >= t.step_s


def test_mfu_uses_6psi():
    e = evaluate(M7, HW8, TrainSpec(seq_len=2048), Strategy.from_name("fsdp"))
    # model FLOPs per token: 6Ψ (minus the embedding lookup) + 6·L·h·s causal attention
    flops = 6 * (PSI - M7.vocab_size * M7.hidden_size) + 6 * M7.num_layers * M7.hidden_size * 2048
    assert e.time.mfu == pytest.approx(flops * e.time.tokens_per_s_per_gpu / 312e12)


def test_recommender_fits_and_explains():
    r = recommend(M7, HW8, TrainSpec())
    assert r.best.fits and r.best.strategy.name not in ("ddp", "zero0")
    assert "tokens/s per GPU" in r.reason and "Runner-up" in r.reason
    fitting = sorted(e.time.tokens_per_s_per_gpu for e in [r.best] + ([r.runner_up] if r.runner_up else []))
    assert r.best.time.tokens_per_s_per_gpu >= 0.97 * fitting[-1]


def test_recommender_needs_offload_for_70b_on_8x80():
    r = recommend(catalog.get_model("llama-2-70b"), HW8, TrainSpec())
    assert "offload" in r.best.strategy.name
    assert "Do not fit" in r.reason and "zero3" in r.reason


runner = CliRunner()


def test_plan_json_has_comm_time_and_recommendation():
    import json

    res = runner.invoke(app, ["plan", "--json"])
    doc = json.loads(res.output)
    assert doc["recommended"] in STRATEGY_NAMES and doc["reason"]
    for s in doc["strategies"]:
        assert {"compute_s", "comm_s", "exposed_comm_s", "offload_s", "step_s", "tokens_per_s_per_gpu", "mfu"} <= set(s["time"])
        assert s["comm"]["total"] >= 0 and "all_gather" in s["comm"]


def _explain(*args):
    res = runner.invoke(app, ["explain", "--format", "markdown", *args])  # the Markdown source: its table parses
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_explain_default_numbers():
    out = _explain()
    # 2Ψ and 3Ψ in bf16 for Llama-2-7B: 2·2·6.738e9 = 27.0 GB, 3·2·6.738e9 = 40.4 GB
    assert "2Ψ = 27.0 GB" in out and "3Ψ = 40.4 GB" in out
    # model states per GPU: ZeRO-2 2Ψ + 14Ψ/8 = 25.3 GB (+ DeepSpeed's straddling grads, < 1%),
    # ZeRO-3 16Ψ/8 = 13.5 GB
    import re

    row = {m[0]: float(m[1]) for m in re.findall(r"\| (\w+) \| ([\d.]+) \|", out)}
    assert row["zero2"] == pytest.approx((2 * PSI + 14 * PSI / 8) / 1e9, rel=0.01)
    assert row["zero3"] == pytest.approx(16 * PSI / 8 / 1e9, abs=0.05)
    # nothing about some other setup: the seed material's fixed scenarios are gone
    assert "seed material" not in out and "13B on 8×80 GB" not in out


def test_explain_70b_on_ethernet():
    out = _explain("--model", "llama-2-70b", "--gpus", "8", "--gpus-per-node", "1", "--gpu", "a100-80g",
                   "--interconnect", "eth-10")
    # 2Ψ = 2·2·68.98e9 = 275.9 GB; 3Ψ = 413.9 GB per GPU per step over 10 GbE
    assert "2Ψ = 275.9 GB" in out and "3Ψ = 413.9 GB" in out
    assert "eth-10" in out
    # nothing fits without offload: every row says "no"
    for name in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        assert f"| {name} |" in out
    assert "| yes |" not in out


def test_deepspeed_reduce_dtype_knob():
    from shardwise.config.strategy import DeepSpeedKnobs

    # DeepSpeed reduces in the parameter dtype by default (bf16: 2 bytes); shardwise's trainer
    # asks for fp32 (communication_data_type), which doubles the gradient bytes, not the
    # parameter all-gather
    base = plan_comm(M7, HW8, TrainSpec(grad_accum=2), Strategy.from_name("zero2"))
    fp32 = plan_comm(M7, HW8, TrainSpec(grad_accum=2),
                     Strategy.from_name("zero2", ds=DeepSpeedKnobs(communication_data_type="fp32")))
    assert base.all_reduce == pytest.approx(2 * PSI * 2) and fp32.all_reduce == pytest.approx(4 * PSI * 2)
    assert fp32.all_gather == base.all_gather == pytest.approx(2 * PSI)
    z3 = plan_comm(M7, HW8, TrainSpec(), Strategy.from_name("zero3", ds=DeepSpeedKnobs(communication_data_type="fp32")))
    assert z3.reduce_scatter == pytest.approx(4 * PSI)


# --- LoRA: only adapter gradients are reduced ----------------------------------------------
# Adapters by hand for Llama-2-7B (h = 4096, MHA: q/k/v/o all 4096 × 4096, I = 11008, 32 layers):
# rank r on a d_in → d_out linear adds r·(d_in + d_out) parameters (A: r × d_in, B: d_out × r).
H, L, INTER = 4096, 32, 11008
ADAPTERS_ATTN16 = L * 4 * 16 * (H + H)  # r = 16 on q, k, v, o: 16,777,216
NORMS = (2 * L + 1) * H  # RMSNorm weights: the only tensors under ZeRO-3's 1e5 persistence threshold


def test_adapter_count_from_the_shape():
    from shardwise.plan.lora import adapter_params

    assert ADAPTERS_ATTN16 == 16_777_216
    assert adapter_params(M7, TrainSpec(lora_rank=16)) == ADAPTERS_ATTN16
    mlp = TrainSpec(lora_rank=8, lora_targets=("gate_proj", "up_proj", "down_proj"))
    assert adapter_params(M7, mlp) == L * 8 * 3 * (H + INTER)
    assert adapter_params(M7, TrainSpec(lora_rank=16), tp=2, pp=2) == ADAPTERS_ATTN16 / 4
    assert adapter_params(M7, TrainSpec()) == 0


@pytest.mark.parametrize("k", [1, 2])
def test_lora_reduces_only_adapter_gradients(k):
    a = ADAPTERS_ATTN16
    train = TrainSpec(lora_rank=16, grad_accum=k)
    c = {n: plan_comm(M7, HW8, train, Strategy.from_name(n)) for n in ("ddp", "zero0", "zero1", "zero2")}
    # DDP: PEFT keeps adapters in fp32; only they require grad, all-reduced once per step
    assert c["ddp"].all_reduce == pytest.approx(4 * a) and c["ddp"].total == pytest.approx(8 * a)
    # DeepSpeed stage 0: once per step in the module dtype (bf16)
    assert c["zero0"].all_reduce == pytest.approx(2 * a)
    # ZeRO-1: bf16 adapter grads once per step, ZeRO-2 every micro-batch; then only the
    # updated adapters are all-gathered (the frozen base is in no optimizer group)
    assert c["zero1"].all_reduce == pytest.approx(2 * a)
    assert c["zero2"].all_reduce == pytest.approx(2 * a * k)
    assert c["zero1"].all_gather == c["zero2"].all_gather == pytest.approx(2 * a)
    full = plan_comm(M7, HW8, TrainSpec(grad_accum=k), Strategy.from_name("ddp"))
    assert c["ddp"].total / full.total == pytest.approx(a / PSI)


@pytest.mark.parametrize("k", [1, 2])
def test_lora_zero3_gathers_the_frozen_base_and_reduces_adapters(k):
    a = ADAPTERS_ATTN16
    c = plan_comm(M7, HW8, TrainSpec(lora_rank=16, grad_accum=k), Strategy.from_name("zero3"))
    # frozen base (Ψ > 1e9 live limit): gathered in forward and again in backward every micro-batch
    # (bf16); norms and the r = 16 adapters (16 × 4096 = 65,536 elements each, under 1e5) are
    # persistent: gathered once, after the step
    assert c.all_gather == pytest.approx(2 * (PSI - NORMS) * 2 * k + 2 * (NORMS + a))
    assert c.reduce_scatter == pytest.approx(2 * a * k)  # adapter grads only, every micro-batch
    # rank 64: 64 × 4096 = 262,144 elements per adapter matrix, above the threshold: gathered
    # with their layer like the base weights
    a64 = L * 4 * 64 * (H + H)
    c64 = plan_comm(M7, HW8, TrainSpec(lora_rank=64, grad_accum=k), Strategy.from_name("zero3"))
    assert c64.all_gather == pytest.approx(2 * (PSI - NORMS + a64) * 2 * k + 2 * NORMS)
    assert c64.reduce_scatter == pytest.approx(2 * a64 * k)


@pytest.mark.parametrize("k", [1, 2])
def test_lora_fsdp_gathers_base_and_adapters_reduce_scatters_adapters(k):
    a = ADAPTERS_ATTN16
    layers = M7.params_per_layer * L
    train = TrainSpec(lora_rank=16, grad_accum=k)
    c = plan_comm(M7, HW8, train, resolved(M7, HW8, train, Strategy.from_name("fsdp")))
    # every unit (base + its adapters) gathered in bf16 in forward, the layers but the last again
    # in backward
    assert c.all_gather == pytest.approx(2 * (PSI + a) * k + 2 * (layers + a) * (L - 1) / L * k)
    assert c.reduce_scatter == pytest.approx(4 * a)  # fp32 reduce_dtype, once per step, adapters only
    go = plan_comm(M7, HW8, train, resolved(M7, HW8, train, Strategy.from_name("fsdp-grad-op")))
    assert go.all_gather == pytest.approx(2 * (PSI + a) * k) and go.reduce_scatter == pytest.approx(4 * a)
    hw = catalog.build_hardware(gpus=16, gpus_per_node=8)
    hy = plan_comm(M7, hw, train, resolved(M7, hw, train, Strategy.from_name("fsdp-hybrid")))
    assert hy.inter == pytest.approx(2 * 4 * a / 8)  # the 1/8 adapter-grad shard all-reduced across nodes


def test_lora_plan_json_comm_is_smaller():
    import json

    full = json.loads(runner.invoke(app, ["plan", "--json", "-s", "ddp"]).output)["strategies"][0]["comm"]
    lora = json.loads(runner.invoke(app, ["plan", "--json", "-s", "ddp", "--lora-rank", "16",
                                          "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]).output)
    assert lora["strategies"][0]["comm"]["all_reduce"] == pytest.approx(4 * ADAPTERS_ATTN16)
    assert lora["strategies"][0]["comm"]["total"] < full["total"] / 100


def test_tp_comm_overlap_hides_tp_collectives_behind_the_gemms():
    """Megatron's --tp-comm-overlap / async TP: the TP collectives' time, up to
    overlap_efficiency × the GEMM time, leaves the critical path; nothing else changes."""
    from shardwise.plan.evaluate import evaluate

    model = catalog.get_model("llama-2-70b")
    hw = catalog.build_hardware(gpu="h100-sxm", gpus=64, gpus_per_node=8)
    s = Strategy.from_name("fsdp", tp=8)
    plain = TrainSpec(seq_len=4096, micro_batch=1, grad_accum=4, checkpointing="full")
    e0 = evaluate(model, hw, plain, s)
    e1 = evaluate(model, hw, plain.model_copy(update={"tp_comm_overlap": True}), s)
    tp_bytes = e0.comm.blocking - e0.comm.p2p
    tp_s = tp_bytes * 7 / 8 / hw.intra.bus_bytes_per_s  # ring: S·(n−1)/n over the bus bandwidth, n = 8
    hidden = min(tp_s, hw.timing.overlap_efficiency * e0.time.gemm_s)
    assert hidden > 0
    assert e0.time.exposed_comm_s - e1.time.exposed_comm_s == pytest.approx(hidden, rel=1e-9)
    assert e1.time.comm_s == pytest.approx(e0.time.comm_s)  # the bytes still move
    assert e1.time.gemm_s == e0.time.gemm_s


def test_plan_cli_takes_tp_comm_overlap():
    args = ["plan", "--model", "llama-2-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gpus-per-node", "8",
            "--tp", "8", "-s", "fsdp", "--seq-len", "4096", "--json"]
    runner = CliRunner()
    plain, overlap = (runner.invoke(app, args + extra) for extra in ([], ["--tp-comm-overlap"]))
    assert plain.exit_code == 0 and overlap.exit_code == 0, (plain.output, overlap.output)
    import json

    def exposed(res):
        doc = json.loads(res.stdout)
        return doc["strategies"][0]["time"]["exposed_comm_s"]

    assert exposed(overlap) < exposed(plain)
