"""Regional compilation (shardwise.train.model.compile): per-layer compiled forwards train the same
model as eager under DDP and FSDP2 (2 gloo ranks, fp32), compile once per run plus at most one
recompile when the sequence length first changes (never per step), and the planner's
fused-kernel activations bound what inductor's compiled layers actually save."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import HERE, run_once

pytestmark = pytest.mark.distributed
STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def runs(shared_dir):
    items = [f"{s}:{m}" for s in STRATEGIES for m in ("eager", "compiled")]
    out = run_once(shared_dir / "compile", HERE / "compile_worker.py", [(items, 2, 400)])
    return {(s, m): json.loads((out / f"{s}-{m}.json").read_text()) for s in STRATEGIES
            for m in ("eager", "compiled")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_layers_train_like_eager(runs, strategy):
    eager, compiled = runs[(strategy, "eager")], runs[(strategy, "compiled")]
    assert compiled["fused_kernels"] and not eager["fused_kernels"]  # the plan follows the build
    diff = max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"], strict=True))
    assert len(compiled["losses"]) == 6 and diff <= 1e-5, (compiled["losses"], eager["losses"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_graph_for_all_layers_and_no_recompile_per_step(runs, strategy):
    """Both layers share one compiled graph; the length change 32 → 48 recompiles it once with a
    symbolic sequence length, and 48, 64, 40, 64 reuse that: 2 graphs over 6 steps."""
    c = runs[(strategy, "compiled")]["counters"]
    assert c["stats"]["unique_graphs"] == 2, c
    assert c["frames"]["ok"] == c["frames"]["total"] == 2, c
    assert not runs[(strategy, "eager")]["counters"].get("stats", {}).get("unique_graphs")


def test_planned_fused_activations_bound_what_inductor_saves():
    """Saved-for-backward bytes of a bf16 forward (a 2-layer Llama, h 256, seq 256): eager
    matches the planner's eager figure, and inductor-compiled layers save less than eager and
    at most the planner's fused-kernel figure (it overestimates them by ~11%, the safe side)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.bench import saved
    from shardwise.catalog import get_model
    from shardwise.plan.activations import activation_bytes
    from shardwise.specs.train import TrainSpec
    from shardwise.train.model.compile import compile_layers

    torch.set_num_threads(1)
    shape = dict(hidden_size=256, intermediate_size=704, num_heads=4, num_kv_heads=4)
    spec = get_model("tiny-llama").model_copy(update=shape)
    d = dict(spec.to_hf_dict())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                             attn_implementation="sdpa").to(torch.bfloat16)
    model.config.use_cache = False
    batch = {"input_ids": torch.randint(0, spec.vocab_size, (2, 256))}
    eager = saved.saved_activation_bytes(model, batch)
    compile_layers(model, "inductor")
    saved.saved_activation_bytes(model, batch)  # compiles
    compiled = saved.saved_activation_bytes(model, batch)
    plan = {fk: activation_bytes(spec, TrainSpec(seq_len=256, micro_batch=2, fused_kernels=fk), 1, 1, False)
            for fk in (False, True)}
    assert abs(plan[False] - eager) <= 0.02 * eager, (plan, eager)
    assert compiled < 0.8 * eager
    assert compiled <= plan[True] <= 1.15 * compiled, (compiled, plan[True])
