"""Saved-for-backward bytes per rank under the trainer's TP plan, fp32, 2 gloo
ranks, the activation bench's tiny Llama and Qwen2 (shardwise.bench.saved, 2 layers, 2 × 128
tokens), measured with the same storage-deduped hook as tests/accuracy/test_measured_memory.py.

Megatron-LM's sequence parallelism has its column-parallel linears save their *sharded* input
and all-gather it again in backward (Korthikanti et al. 2022); DTensor's ColwiseParallel (the
trainer's plan, and torchtitan's) saves the *all-gathered* input instead: per token,
c·h·(1 − 1/tp) more per block (the attention's and the MLP's shared input) and at lm_head. The
planner books that for torch's engines (plan.activations.gathered_inputs); without it the plan
was 11% under the measurement for both shapes. The issue's bar is 10%; what is left (about 2%)
is RoPE's cos/sin tables, [s, head_dim] on every rank, which the plan divides by tp.

DeepSpeed's AutoTP (zero1 × tp 2, `<shape>:fp32:autotp`) has no sequence parallelism: norms,
residuals and the linears' inputs are whole on every rank, only the attention and MLP internals
are split (the `autotp` TP scheme, specs.strategy.TP_SCHEMES). Planned within 1% of the
measurement for both shapes; the parameters each rank holds (the decoder linears split, the
embedding, lm_head and norms whole) are the plan's exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_once

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent
SHAPES = ["tiny-llama", "tiny-qwen2"]


@pytest.fixture(scope="module")
def measured(shared_dir) -> Path:
    return run_once(shared_dir / "tp-saved", HERE / "tp_saved_worker.py", [([f"{s}:fp32{x}" for s in SHAPES for x in ("", ":autotp")], 2, 300)])


@pytest.mark.parametrize("shape", SHAPES)
def test_saved_bytes_per_rank_are_the_plan(shape, measured):
    from shardwise.bench import saved
    from shardwise.catalog import build_hardware
    from shardwise.plan.activations import activation_bytes
    from shardwise.plan.evaluate import memory_as_run
    from shardwise.specs import ModelSpec, Strategy, TrainSpec

    got = json.loads((measured / f"{shape}-fp32.json").read_text())["saved"]
    cfg = {**saved.SHAPES[shape], "num_hidden_layers": 2}
    model = ModelSpec.from_hf_dict(cfg, name=shape)
    train = TrainSpec(precision="fp32", seq_len=saved.SEQ, micro_batch=saved.BATCH, attention="sdpa")
    plan = memory_as_run(model, build_hardware(gpu="a100-80g", gpus=2), train,
                         Strategy.from_name("fsdp", tp=2)).gpu.activations
    assert abs(plan - got) <= 0.03 * got, (plan, got)  # the issue asks 10%
    # what DTensor adds over Megatron-SP is the gathered linear inputs, from first principles:
    # fp32, (1 - 1/tp) of h per token, two blocks a layer and lm_head's input
    megatron = activation_bytes(model, train, tp=2, gathered=False)
    tokens, tp = saved.SEQ * saved.BATCH, 2
    assert plan - megatron == pytest.approx(tokens * 4 * model.hidden_size * (1 - 1 / tp) * (2 * model.num_layers + 1))
    assert (megatron - got) / got < -0.05  # Megatron's accounting would be the 11% under


def _plan(shape: str, strategy: str):
    from shardwise.bench import saved
    from shardwise.catalog import build_hardware
    from shardwise.plan.evaluate import memory_as_run
    from shardwise.specs import ModelSpec, Strategy, TrainSpec

    model = ModelSpec.from_hf_dict({**saved.SHAPES[shape], "num_hidden_layers": 2}, name=shape)
    train = TrainSpec(precision="fp32", seq_len=saved.SEQ, micro_batch=saved.BATCH, attention="sdpa")
    return model, train, memory_as_run(model, build_hardware(gpu="a100-80g", gpus=2), train,
                                       Strategy.from_name(strategy, tp=2))


@pytest.mark.parametrize("shape", SHAPES)
def test_autotp_saved_bytes_and_params_per_rank_are_the_plan(shape, measured):
    from shardwise.plan.activations import activation_bytes

    got = json.loads((measured / f"{shape}-fp32-autotp.json").read_text())
    model, train, plan = _plan(shape, "zero1")
    assert plan.strategy.tp_scheme.name == "autotp"
    assert abs(plan.gpu.activations - got["saved"]) <= 0.03 * got["saved"], (plan.gpu.activations, got)
    # each rank holds half of every decoder layer (its norms whole: a few h) and the whole
    # embedding and lm_head; the plan books exactly that up to the layers' norms
    assert got["params"] == pytest.approx(model.layer_params / 2 + model.root_params, rel=0.01)
    assert plan.gpu.params == pytest.approx(4 * got["params"], rel=0.01)  # fp32: ZeRO-1 keeps the module whole
    # from first principles: without sequence parallelism the layers' norms and residuals are whole
    # on each rank (what Megatron-SP would split): AutoTP is planned with sequence parallelism off
    sp = activation_bytes(model, train, tp=2)
    no_sp = activation_bytes(model, train.model_copy(update={"sequence_parallel": False}), tp=2)
    assert plan.gpu.activations == no_sp > sp
