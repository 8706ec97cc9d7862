"""The planner's "deepspeed" accounting against DeepSpeed's own estimators
(estimate_zero{2,3}_model_states_mem_needs_all_live) called on a real qwen2.5-0.5b-shaped model.
Needs torch, transformers and deepspeed (the planner-only install skips this file)."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from shardwise import catalog  # noqa: E402
from shardwise.plan.memory import plan_memory  # noqa: E402
from shardwise.specs import Strategy, TrainSpec  # noqa: E402


@pytest.fixture(scope="module")
def real_model():
    """qwen2.5-0.5b shape (tied embeddings) with real (uninitialised) bf16 storage:
    `_all_live` dedupes parameters by data_ptr, which is 0 on the meta device."""
    spec = catalog.get_model("qwen2.5-0.5b")
    cfg = transformers.AutoConfig.for_model(**spec.to_hf_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    return spec, model


def _printed_rows(text: str) -> dict[str, tuple[float, float]]:
    """Parse DeepSpeed's table: '  0.92GB |   1.95GB | offload_optimizer=none' (GiB)."""
    rows = {}
    for cpu, gpu, opts in re.findall(r"([\d.]+)GB \|\s+([\d.]+)GB \| (.+)", text):
        key = re.sub(r"\s+", "", opts).replace("OffloadDeviceEnum.", "")  # enum repr varies by version
        rows[key] = (float(cpu) * 2**30, float(gpu) * 2**30)
    return rows


@pytest.mark.parametrize("gpus", [2, 8])
def test_matches_deepspeed_zero2_estimator(real_model, capsys, gpus):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    spec, model = real_model
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus, num_nodes=1)
    rows = _printed_rows(capsys.readouterr().out)
    hw = catalog.build_hardware(gpus=gpus)
    train = TrainSpec()
    plain = plan_memory(spec, hw, train, Strategy.from_name("zero2"), accounting="deepspeed").gpu
    off = plan_memory(spec, hw, train, Strategy.from_name("zero2+opt-offload"), accounting="deepspeed")
    half_cent = 0.005 * 2**30  # DeepSpeed prints 2 decimals
    assert plain.model_states + plain.step_buffers == pytest.approx(rows["offload_optimizer=none"][1], abs=half_cent)
    assert off.gpu.model_states == pytest.approx(rows["offload_optimizer=cpu"][1], abs=half_cent)
    assert off.host.total == pytest.approx(rows["offload_optimizer=cpu"][0], abs=half_cent)


@pytest.mark.parametrize("gpus", [2, 8])
def test_matches_deepspeed_zero3_estimator(real_model, capsys, gpus):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live

    spec, model = real_model
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus, num_nodes=1)
    rows = _printed_rows(capsys.readouterr().out)
    hw = catalog.build_hardware(gpus=gpus)
    half_cent = 0.005 * 2**30
    cases = {
        "zero3": "offload_param=none,offload_optimizer=none,zero_init=1",
        "zero3+opt-offload": "offload_param=none,offload_optimizer=cpu,zero_init=1",
        "zero3+full-offload": "offload_param=cpu,offload_optimizer=cpu,zero_init=1",
    }
    for name, key in cases.items():
        p = plan_memory(spec, hw, TrainSpec(), Strategy.from_name(name), accounting="deepspeed")
        g = p.gpu
        assert g.model_states + g.step_buffers + g.engine_buffers == pytest.approx(rows[key][1], abs=half_cent), name
        if name != "zero3":
            assert p.host.total == pytest.approx(rows[key][0], abs=half_cent), name
