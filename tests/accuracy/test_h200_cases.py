"""The planner against shardwise's trainer measured on one H200 (benchmarks/measurements/
h200-trainer-cases.json: torch.cuda.max_memory_allocated, nvidia-smi's peak, median step time
of 11 runs). The expected figures are the measurements, never the planner's own output."""

from __future__ import annotations

import pytest
from bench_scripts import load

from shardwise import catalog
from shardwise.plan.evaluate import evaluate, memory_as_run
from shardwise.specs import Strategy, TrainSpec

h200 = load("h200_cases")
CASES = {c["name"]: c for c in h200.load_cases()}


@pytest.mark.parametrize("name", list(CASES))
def test_allocated_peak_within_5_percent(name):
    row = h200.compare(CASES[name])
    assert abs(row["allocated_gib"]["rel_err"]) <= 0.05, row["allocated_gib"]


@pytest.mark.parametrize("name", list(CASES))
def test_tokens_per_s_in_sample_within_20_percent(name):
    """IN-SAMPLE: these 11 cases are among the data the time model's constants were fitted or
    measured on (catalog/timing.yaml), so this band guards the fit, not accuracy; the held-out
    (leave-one-out, ±25%) band is tests/accuracy/test_accuracy_doc.py's. The fit weighs every source
    alike, so the H200 runs are not fitted alone (llama2-7b-fsdp-ac sits at about -17%)."""
    row = h200.compare(CASES[name])
    assert abs(row["tokens_per_s"]["rel_err"]) <= 0.20, (row["tokens_per_s"], row["time_parts_s"])


@pytest.mark.parametrize("name", list(CASES))
def test_every_measured_run_fits(name):
    """All 11 ran on the H200: no false OOM, and the device peak planned is what nvidia-smi saw
    within the allocator's noise (±15%)."""
    row = h200.compare(CASES[name])
    assert row["fits"]["predicted"] is True
    assert abs(row["device_gib"]["rel_err"]) <= 0.15, row["device_gib"]


def test_llama2_7b_fits_one_h200_with_fused_adamw_not_with_foreach():
    """The false OOM of the issue: a foreach AdamW step allocates exp_avg_sq_sqrt for every
    parameter (4Ψ, 25 GiB at 6.74B), the fused step none. Measured peak: 101.88 GiB (fused)."""
    model, hw, train, strategy = h200.specs(CASES["llama2-7b-fsdp-ac"])
    fused = memory_as_run(model, hw, train, strategy)
    foreach = memory_as_run(model, hw, train.model_copy(update={"optimizer_impl": "foreach"}), strategy)
    assert fused.fits
    assert foreach.gpu.step_buffers == pytest.approx(4 * model.params)  # world size 1: the whole model
    assert fused.gpu.step_buffers < 0.1 * foreach.gpu.step_buffers  # the root's reduce-scatter copy only
    assert foreach.gpu.allocated > fused.gpu.allocated + 20 * 2**30


def test_phases_are_not_summed():
    """The loss's peak (logits) and the optimizer step never coexist: the peak is one phase."""
    model, hw, train, strategy = h200.specs(CASES["q05-fsdp"])
    g = memory_as_run(model, hw, train, strategy).gpu
    phases = g.phases
    assert g.allocated == max(phases.values())
    assert phases["forward"] > phases["step"]  # 151,936-token vocabulary: the loss dominates
    summed = g.params + g.grads + g.optimizer_states + g.step_buffers + g.activations + g.logits + g.gathered_params
    assert g.allocated < summed


def test_reserved_above_allocated_and_fits_uses_what_cannot_be_reclaimed():
    """The device total (nvidia-smi's figure, compared above) includes cache the allocator frees
    and retries with before an out-of-memory; fits is decided on `required`: the allocated peak,
    the unreclaimable slack, the CUDA context (and NCCL)."""
    model, hw, train, strategy = h200.specs(CASES["l7b8-fsdp"])
    g = memory_as_run(model, hw, train, strategy).gpu
    assert g.reserved > g.allocated and g.total > g.reserved
    assert g.allocated < g.required < g.total

    def on(gb):
        return memory_as_run(model, catalog.build_hardware(gpu="h200", gpus=1, gpus_per_node=1, memory_gb=gb),
                           train, strategy)

    assert on((g.required + g.total) / 2 / 0.95 / 1e9).fits  # short of the device total: the cache goes
    assert not on((g.allocated + g.required) / 2 / 0.95 / 1e9).fits  # short of what must exist


def test_fsdp2_accumulation_trainer_vs_stock():
    """Held (`reduce_every_micro_batch: false`): unsharded fp32 grads between micro-batches (sync
    off); stock FSDP2 reduce-scatters every micro-batch into the sharded grads (4 bytes × Ψ/N) and
    moves k× the reduce-scatter bytes."""
    from shardwise.config.strategy import FSDPKnobs
    from shardwise.plan.comm import plan_comm

    m = catalog.get_model("llama-2-7b")
    hw = catalog.build_hardware(gpu="h100-sxm", gpus=8)
    train = TrainSpec(grad_accum=4, seq_len=2048)
    trainer = Strategy.from_name("fsdp", fsdp=FSDPKnobs(reduce_every_micro_batch=False))
    stock = Strategy.from_name("fsdp", fsdp=FSDPKnobs(reduce_every_micro_batch=True))
    a, b = memory_as_run(m, hw, train, trainer).gpu, memory_as_run(m, hw, train, stock).gpu
    assert a.held_grads == pytest.approx(4 * m.params) and b.held_grads == 0
    assert b.grads_persist and not a.grads_persist
    assert plan_comm(m, hw, train, stock).reduce_scatter == pytest.approx(4 * plan_comm(m, hw, train, trainer).reduce_scatter)


def test_time_follows_the_optimizer_and_loss_implementation():
    model, hw, train, strategy = h200.specs(CASES["l7b8-fsdp"])
    fused = evaluate(model, hw, train, strategy).time
    foreach = evaluate(model, hw, train.model_copy(update={"optimizer_impl": "foreach"}), strategy).time
    assert foreach.optimizer_s > 2 * fused.optimizer_s
    q_model, q_hw, q_train, q_strategy = h200.specs(CASES["q05-fsdp"])
    std = evaluate(q_model, q_hw, q_train, q_strategy).time
    fused_ce = evaluate(q_model, q_hw, q_train.model_copy(update={"cross_entropy": "fused"}), q_strategy).time
    assert fused_ce.memory_bound_s < std.memory_bound_s


def test_plan_cli_takes_the_implementation_settings():
    import json

    from typer.testing import CliRunner

    from shardwise.cli.app import NOTHING_FITS_EXIT, app

    def run(*flags):
        res = CliRunner().invoke(app, ["plan", "--json", "--model", "llama-2-7b", "--gpu", "h200", "--gpus", "1",
                                       "-s", "fsdp", "--seq-len", "4096", "--checkpointing", "full",
                                       "--fsdp-single-rank", "fsdp", "--no-fused-kernels", *flags])  # as measured:
        # fully_shard, eager layers
        doc = json.loads(res.output)
        # exit 3: nothing the recommender may pick fits (the plan is still printed)
        assert res.exit_code == (0 if doc["recommended"] else NOTHING_FITS_EXIT), res.output
        return doc["strategies"][0]

    fused, foreach = run(), run("--optimizer-impl", "foreach")
    assert foreach["memory"]["step_buffers"] > fused["memory"]["step_buffers"]
    # the false OOM of the issue, and why it was one: foreach's 4Ψ step temporaries (25 GiB at 6.74B);
    # with 10% kept free (126 GiB usable) the fused step fits and the foreach one does not
    assert foreach["memory"]["required"] - fused["memory"]["required"] > 20 * 2**30
    tight_fused, tight_foreach = run("--margin", "0.1"), run("--margin", "0.1", "--optimizer-impl", "foreach")
    assert fused["fits"] and tight_fused["fits"] and not tight_foreach["fits"]
    assert run("--expandable-segments")["memory"]["allocator_slack"] < fused["memory"]["allocator_slack"]
    assert run("--fused-kernels")["time"]["memory_bound_s"] < fused["time"]["memory_bound_s"]
    bad = CliRunner().invoke(app, ["plan", "--optimizer-impl", "apex"])
    assert bad.exit_code == 2 and "--optimizer-impl" in bad.output
