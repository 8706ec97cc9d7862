"""Saved-for-backward bytes per rank under the trainer's TP plan (issue 26 item d), fp32, 2 gloo
ranks, the activation bench's tiny Llama and Qwen2 (shardwise.bench.saved, 2 layers, 2 × 128
tokens), measured with the same storage-deduped hook as tests/test_measured_memory.py.

What is known and not yet in the planner: plan/activations.py models Megatron-LM's sequence
parallelism, whose column-parallel linears save their *sharded* input and all-gather it again in
backward (Korthikanti et al. 2022). DTensor's ColwiseParallel (the trainer's plan, and
torchtitan's) saves the *all-gathered* input instead: per token, c·h·(1 − 1/tp) more per block
(the attention's and the MLP's shared input) and at lm_head. The planner's figure is therefore
below the measured one (−11% for both shapes today, outside the issue's 10%); this test holds the
measured bytes to the planner's plus that first-principles difference, within 2% (the rest: RoPE's
cos/sin tables, [s, head_dim] on every rank, which the plan divides by tp).
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
    return run_once(shared_dir / "tp-saved", HERE / "tp_saved_worker.py", [([f"{s}:fp32" for s in SHAPES], 2, 300)])


@pytest.mark.parametrize("shape", SHAPES)
def test_saved_bytes_are_the_plan_plus_the_gathered_linear_inputs(shape, measured):
    from shardwise.bench import saved
    from shardwise.catalog import build_hardware
    from shardwise.plan.evaluate import memory_as_run
    from shardwise.specs import ModelSpec, Strategy, TrainSpec

    got = json.loads((measured / f"{shape}-fp32.json").read_text())["saved"]
    cfg = {**saved.SHAPES[shape], "num_hidden_layers": 2}
    model = ModelSpec.from_hf_dict(cfg, name=shape)
    train = TrainSpec(precision="fp32", seq_len=saved.SEQ, micro_batch=saved.BATCH, attention="sdpa")
    plan = memory_as_run(model, build_hardware(gpu="a100-80g", gpus=2), train,
                         Strategy.from_name("fsdp", tp=2)).gpu.activations
    tokens, tp = saved.SEQ * saved.BATCH, 2
    gathered = tokens * 4 * model.hidden_size * (1 - 1 / tp) * (2 * model.num_layers + 1)
    assert abs(plan + gathered - got) <= 0.02 * got, (plan, gathered, got)
    assert (plan - got) / got < -0.05  # the known gap (module docstring): fixed, this test should change
