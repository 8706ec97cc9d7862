"""The planner against measurement on CPU.

Model states: 2 gloo processes run tiny Llama (shardwise.bench.worker.TINY_LLAMA, fp32,
AdamW) one full step plus forward+backward of step 2 under each strategy; a per-rank
census (shardwise.bench.census) counts params, grads, fp32 master and optimizer state
bytes. The planner's per-GPU figure is compared with the largest rank.

Activations: saved-for-backward bytes (storage-deduped, parameters excluded) of one forward
without labels, for tiny Llama and tiny Qwen2 shapes (every precision, attention and
checkpointing) and a tiny config of every further family (shardwise.bench.saved.SHAPES: bf16
and fp32, SDPA — eager for Gemma2, which has no SDPA path — checkpointing none and full;
dense families also under autocast); with full checkpointing also the peak over forward +
backward (the recomputed layer) against plan.activations + plan.recompute. "bf16" here = the model's weights cast to bf16, as DeepSpeed's bf16 mode and
FSDP2 param_dtype=bf16 run the forward (planner precision "bf16-mixed"); see
shardwise/bench/saved.py for why torch.autocast is recorded but not asserted.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from shardwise.bench import census, saved, worker  # noqa: E402

TOL_STATES = 0.02
TOL_ACTS = 0.10
ASSERTED = ("zero1", "zero2", "zero3", "fsdp")
# cheap once the processes are up; "-bigbucket": ZeRO-1/2 with one reduce bucket above Ψ (DeepSpeed's
# 5e8 default on a small model) holds the same partitions after backward as with several buckets;
# "-wd": weight decay, two optimizer groups, each partitioned (the demo's −13.9% was this)
EXTRA = ("ddp", "zero0", "zero3-nopersist", "zero1-bigbucket", "zero2-bigbucket", "zero1-wd", "zero2-wd")
# LoRA rank 8 on every decoder linear (frozen base, trainable adapters), fp32 and bf16-mixed
LORA = tuple(f"{s}-lora{p}" for s in ("ddp", "zero2", "zero3", "fsdp") for p in ("", "-bf16"))
LORA += ("ddp-qlora-bf16", "zero2-qlora-bf16")  # NF4 base (bitsandbytes' CPU kernels)
PARTS = ("params", "grads", "master_params", "optimizer_states")


# ---------------------------------------------------------------- the instruments themselves
def test_saved_bytes_dedupes_by_storage_and_skips_parameters() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(5, 8, requires_grad=True)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = w

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x @ self.w  # saves x (5·8 fp32) and w (a parameter: not counted)
            return y * y  # saves y twice: one storage

    got = saved.saved_activation_bytes(M(), {"x": x})
    # x is in the batch (excluded); y: 5×8 fp32 once.
    assert got == 5 * 8 * 4, got


def test_census_counts_params_grads_and_state_once() -> None:
    lin = torch.nn.Linear(16, 4)  # 64 + 4 fp32
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.randn(3, 16)).sum().backward()
    opt.step()
    view = lin.weight.detach()[:2]  # a view of a param: same storage, must not count again
    c = census.take_census(lin, opt, exclude=(), gc_sweep=False)
    n = (16 * 4 + 4) * 4
    assert c.bytes["params"] == n and c.bytes["grads"] == n and c.bytes["optimizer_states"] == n, c.bytes
    assert c.bytes["master_params"] == 0
    del view
    # what a packed batch holds besides tensors (the varlen kernels' longest document) is no storage
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "max_seqlen": 8}
    assert census.take_census(lin, opt, exclude=tuple(batch.values()), gc_sweep=False).bytes == c.bytes


# ---------------------------------------------------------------- model states (2 processes)
@pytest.fixture(scope="module")
def measured_states() -> dict:
    return worker.measure_model_states(ASSERTED + EXTRA + LORA, timeout_s=300)


def _plan(variant: str):
    """The planner on the very RunSpec the measured engines were built from (the run bridge)."""
    from shardwise.plan.evaluate import memory_as_run

    run = worker.bench_run(variant)
    return memory_as_run(run.model, run.hardware, run.train, run.strategy)


def _table(strategy: str, ranks: list[dict], plan) -> str:
    unit = 4 * worker.model_params()
    rows = [f"{strategy}: bytes per GPU (P = 4Ψ = {unit}); measured = max over ranks after backward of step 2"]
    rows.append(f"  {'part':18}{'measured':>12}{'(P)':>8}{'planned':>12}{'(P)':>8}{'err':>8}")
    for part in (*PARTS, "other"):
        m = max(r["after_backward"][part] for r in ranks)
        p = getattr(plan.gpu, part if part != "other" else "engine_buffers")
        label = part if part != "other" else "other/engine_buf"
        err = f"{(p - m) / m:+.1%}" if m > 0.001 * unit else "-"  # "other" is ~0 after backward
        rows.append(f"  {label:18}{m:>12}{m / unit:>8.4f}{p:>12.0f}{p / unit:>8.4f}{err:>8}")
    return "\n".join(rows)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ASSERTED + EXTRA + LORA)
def test_model_states_match_planner(strategy: str, measured_states: dict) -> None:
    ranks = measured_states[strategy]
    measured = max(sum(r["after_backward"][p] for p in PARTS) for r in ranks)
    plan = _plan(strategy)
    table = _table(strategy, ranks, plan)
    print("\n" + table)
    err = abs(plan.gpu.model_states - measured) / measured
    assert err <= TOL_STATES, f"model states off by {err:.1%}\n{table}"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ASSERTED + EXTRA + LORA)
def test_model_state_parts_match_planner(strategy: str, measured_states: dict) -> None:
    ranks = measured_states[strategy]
    plan = _plan(strategy)
    table = _table(strategy, ranks, plan)
    total = max(sum(r["after_backward"][p] for p in PARTS) for r in ranks)
    bad = []
    for part in PARTS:
        m = max(r["after_backward"][part] for r in ranks)
        p = getattr(plan.gpu, part)
        # a part measured as 0 must be planned as (nearly) 0; else 2% of itself
        if (m == 0 and p > 0.001 * total) or (m and abs(p - m) / m > TOL_STATES):
            bad.append(part)
    assert not bad, f"{strategy}: parts off by more than {TOL_STATES:.0%}: {bad}\n{table}"


@pytest.mark.distributed
def test_census_ranks_agree_and_nothing_leaks(measured_states: dict) -> None:
    """Sanity of the measurement: after the step the grads are gone for DeepSpeed (engine.step
    zeroes them) and the fp32 master exists exactly where DeepSpeed keeps one."""
    unit = 4 * worker.model_params()
    for s in ("zero1", "zero2"):
        for r in measured_states[s]:
            assert r["after_step"]["grads"] == 0, (s, r["after_step"])
            assert abs(r["after_backward"]["master_params"] - unit / worker.WORLD) <= 64 * 4, (s, r)
    for r in measured_states["fsdp"] + measured_states["ddp"]:
        assert r["after_backward"]["master_params"] == 0


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "zero2", "zero3", "fsdp"])
def test_lora_holds_states_for_the_adapters_only(engine: str, measured_states: dict) -> None:
    """Measured, not planned: a LoRA run's grads and AdamW state are the adapters' (a few % of
    the full run's), and a bf16 base halves the frozen params where the engine stores them whole."""
    full = max(r["after_backward"]["optimizer_states"] for r in measured_states["ddp"])
    for r in measured_states[f"{engine}-lora"]:
        assert 0 < r["after_backward"]["optimizer_states"] < 0.1 * full
        assert 0 < r["after_backward"]["grads"] < 0.1 * full / 2
    fp32 = max(r["after_backward"]["params"] for r in measured_states[f"{engine}-lora"])
    bf16 = max(r["after_backward"]["params"] for r in measured_states[f"{engine}-lora-bf16"])
    assert 0.45 < bf16 / fp32 < 0.6, (fp32, bf16)


# ---------------------------------------------------------------- activations (1 process)
LAYERS = 4
ACT_CASES = [
    (shape, prec, attn, ckpt)
    for shape in saved.LLAMA_BLOCK_SHAPES for prec in ("fp32", "bf16", "bf16-autocast") for attn in ("sdpa", "eager")
    for ckpt in ("none", "full")
]
FAMILY_SHAPES = [s for s in saved.SHAPES if s not in saved.LLAMA_BLOCK_SHAPES]
_MOE = {"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"}
ACT_CASES += [
    (shape, prec, saved.attentions(shape)[0], ckpt)
    for shape in FAMILY_SHAPES for prec in ("bf16", "fp32", "bf16-autocast") for ckpt in ("none", "full")
    # fp32: without checkpointing only (the kept layer inputs are the bf16 case's, doubled).
    # Autocast (DDP) with routed experts: memory.autocast_cache still books the fused expert
    # weights as cast (autocast leaves them fp32), so MoE families are asserted in bf16/fp32.
    if not (prec == "fp32" and ckpt == "full")
    and not (prec == "bf16-autocast" and saved.SHAPES[shape]["model_type"] in _MOE)
]


def _act_plan(shape: str, prec: str, attn: str, ckpt: str):
    from shardwise.catalog import build_hardware
    from shardwise.plan.evaluate import memory_as_run
    from shardwise.specs import ModelSpec, Strategy, TrainSpec

    cfg = {**saved.SHAPES[shape], "num_hidden_layers": LAYERS}
    model = ModelSpec.from_hf_dict(cfg, name=shape)
    train = TrainSpec(precision="fp32" if prec == "fp32" else "bf16-mixed", seq_len=saved.SEQ,
                      micro_batch=saved.BATCH, attention=attn, checkpointing=ckpt)
    # "bf16" = a bf16 module (DeepSpeed bf16, FSDP2 param_dtype); "bf16-autocast" = an fp32
    # module under torch.autocast, which is how the DDP engine runs mixed precision.
    strategy = "ddp" if prec == "bf16-autocast" else "fsdp"
    return memory_as_run(model, build_hardware(gpu="a100-80g", gpus=2), train, Strategy.from_name(strategy))


def _planned_saved(g, prec: str) -> float:
    """Under autocast the linears also save the cached bf16 weight casts; the planner books
    them with the activations (memory.autocast_cache)."""
    return g.activations


def _sbh(shape: str) -> int:
    return saved.SEQ * saved.BATCH * saved.SHAPES[shape]["hidden_size"]


@pytest.mark.parametrize("shape,prec,attn,ckpt", ACT_CASES)
def test_activations_match_planner(shape: str, prec: str, attn: str, ckpt: str) -> None:
    """plan.activations = saved-for-backward bytes at the end of forward (no labels)."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model = saved.build_model(shape, LAYERS, prec, attn, ckpt)  # non-reentrant, as shardwise trains
    measured = saved.saved_activation_bytes(model, saved.make_batch(saved.SHAPES[shape]["vocab_size"]),
                                            precision=prec)  # autocast only for "bf16-autocast"
    planned = _planned_saved(_act_plan(shape, prec, attn, ckpt).gpu, prec)
    err = (planned - measured) / measured
    sbh = _sbh(shape)
    assert abs(err) <= TOL_ACTS, (
        f"{shape} {prec} {attn} ckpt={ckpt}: planned {planned:.0f} B ({planned / sbh:.2f}·sbh) vs measured "
        f"saved {measured} B ({measured / sbh:.2f}·sbh), {err:+.1%}"
    )


@pytest.mark.parametrize("shape", list(saved.SHAPES))
def test_selective_checkpointing_matches_planner(shape: str) -> None:
    """checkpointing "selective" = torchtitan's per-op policy (saved.torchtitan_sac_context on
    every decoder layer): the layer inputs plus the cached outputs of every other mm and of
    SDPA. Those outputs are cached by the checkpoint, not packed through saved-tensor hooks,
    so the measurement is the bytes of op outputs still alive after forward. (Gemma2 runs
    eager: its causal masks, kept for the replay, are the ~7% the plan leaves out.)"""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    attn = saved.attentions(shape)[0]
    model = saved.build_model(shape, LAYERS, "bf16", attn, "selective")
    measured = saved.live_forward_bytes(model, saved.make_batch(saved.SHAPES[shape]["vocab_size"]), precision="bf16")
    planned = _act_plan(shape, "bf16", attn, "selective").gpu.activations
    err = (planned - measured) / measured
    assert abs(err) <= TOL_ACTS, f"{shape} selective: planned {planned:.0f} B vs measured {measured} B, {err:+.1%}"


@pytest.mark.parametrize("shape,prec,attn", [c[:3] for c in ACT_CASES if c[3] == "full"
                                             and (c[0] in saved.LLAMA_BLOCK_SHAPES or c[1] == "bf16")])
def test_checkpointed_peak_matches_planner(shape: str, prec: str, attn: str) -> None:
    """With full checkpointing the saved bytes peak in backward, while the last layer is
    recomputed: plan.activations + plan.recompute against the measured peak of live saved
    bytes over forward + backward (reentrant checkpointing, whose recompute we can see)."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model = saved.build_model(shape, LAYERS, prec, attn, "full", reentrant=True)
    measured = saved.peak_saved_bytes(model, saved.make_batch(saved.SHAPES[shape]["vocab_size"]), precision=prec)
    g = _act_plan(shape, prec, attn, "full").gpu
    planned = _planned_saved(g, prec) + g.recompute
    err = (planned - measured) / measured
    sbh = _sbh(shape)
    assert abs(err) <= TOL_ACTS, (
        f"{shape} {prec} {attn}: planned activations+recompute {planned:.0f} B ({planned / sbh:.2f}·sbh) vs "
        f"measured peak saved {measured} B ({measured / sbh:.2f}·sbh), {err:+.1%}"
    )


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_loss_side_against_planner_logits(prec: str) -> None:
    """plan.gpu.logits is a backward-time peak: the lm_head output (c·V per token), the
    log-softmax output autograd saves (4·V), and during its backward the incoming and the
    outgoing fp32 gradients (4·V each). A forward-only measurement sees what the loss leaves
    alive; the plan must cover it and exceed it by exactly the tensors that are not loss-side
    savings (the logits output, present with or without labels, and the two gradients)."""
    d = saved.loss_side_bytes("tiny-llama", prec)
    plan = _act_plan("tiny-llama", prec, "sdpa", "none")
    planned = plan.gpu.logits
    measured = d["live"]  # everything the loss side leaves alive after forward (log-softmax output)
    tokens = 256
    vocab = 2048
    not_yet_alive = (4 + 4 + (2 if prec == "bf16" else 4)) * tokens * vocab  # 2 gradients, logits output
    assert planned >= measured, (planned, d)
    assert abs(planned - not_yet_alive - measured) / measured <= TOL_ACTS, (planned, d)
