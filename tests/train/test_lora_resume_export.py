"""LoRA runs survive like full ones: adapters-only checkpoints that resume on another engine
and world size, and export as a PEFT adapter or as the merged model (2 gloo ranks, CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_once

from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
from shardwise.train.checkpoint.sharded import read_manifest, tensor_shapes

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
SAVE_EVERY = 3
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(shared_dir):
    two = ["zero3+lora:full", "fsdp+lora:resume:zero3+lora-full-w2", "zero3+lora:resume:zero3+lora-full-w2"]
    return run_once(shared_dir / "lora-resume", HERE / "resume_worker.py",
                    [(two, 2, 400), (["ddp+lora:resume:zero3+lora-full-w2"], 1, 300)])


def load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


def _ckpt(runs: Path, step: int = SAVE_EVERY) -> Path:
    return checkpoints_dir(runs / "zero3+lora-full-w2") / step_dir_name(step)


def test_checkpoint_holds_adapters_only(runs):
    shapes = tensor_shapes(_ckpt(runs))
    names = {k.split(".", 1)[1] for k in shapes}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names), sorted(names)[:3]
    assert {k.split(".", 1)[0] for k in shapes} == {"model", "optim"}
    size = sum(f["bytes"] for f in read_manifest(_ckpt(runs))["files"].values())
    full = load(runs, "zero3+lora-full-w2")["weights"]
    base_bytes = sum(v.numel() * 4 for k, v in full.items() if ".lora_" not in k)
    adapter_elems = sum(v.numel() for k, v in full.items() if ".lora_" in k)
    # weights + two Adam moments of the adapters (fp32) and metadata; the base is not in it
    assert 12 * adapter_elems <= size < 12 * adapter_elems + 0.5 * base_bytes, (size, adapter_elems, base_bytes)


@pytest.mark.parametrize(("resumed", "exact"), [
    ("zero3+lora-resume-zero3+lora-full-w2-w2", True),  # same engine and world size: bit for bit
    ("fsdp+lora-resume-zero3+lora-full-w2-w2", False),  # ZeRO-3 -> FSDP2
    ("ddp+lora-resume-zero3+lora-full-w2-w1", False),  # 2 ranks -> 1
])
def test_lora_resumes_on_another_engine_and_world_size(runs, resumed, exact):
    full = load(runs, "zero3+lora-full-w2")
    res = load(runs, resumed)
    assert res["start_step"] == SAVE_EVERY and len(res["losses"]) == len(full["losses"]) - SAVE_EVERY
    tail = full["losses"][SAVE_EVERY:]
    if exact:
        assert res["losses"] == tail
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], tail, strict=True))
    assert worst <= RTOL, worst
    for k, v in full["weights"].items():
        if ".lora_" in k:
            assert float((res["weights"][k].double() - v.double()).norm() / v.double().norm()) <= RTOL, k
        else:  # the base was rebuilt from the seed, never loaded, never trained
            assert torch.equal(res["weights"][k], v), k


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    from typer.testing import CliRunner

    from shardwise.train.export.cli import app

    root = tmp_path_factory.mktemp("lora-export")
    out = {}
    for kind, flags in (("adapter", []), ("merged", ["--merged"])):
        out[kind] = root / kind
        res = CliRunner().invoke(app, [str(runs / "zero3+lora-full-w2"), str(out[kind]), *flags])
        assert res.exit_code == 0, res.output
    return out


def _base_and_ids():
    """The base the run trained on, built as the trainer builds it (seeded random init)."""
    from parity_worker import parity_config

    from shardwise.run import run_spec
    from shardwise.train.model.build import build_model

    cfg = parity_config("ddp", 1, 1)
    base = build_model(run_spec(cfg, 1, "cpu")).eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    return base, ids


def test_exported_adapter_loads_with_peft_and_merged_model_matches(runs, exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = load(runs, "zero3+lora-full-w2")["weights"]  # the engine's weights after step 8
    assert (exported["adapter"] / "adapter_config.json").is_file()
    assert (exported["adapter"] / "adapter_model.safetensors").is_file()
    assert not (exported["adapter"] / "model.safetensors").exists()
    base, ids = _base_and_ids()
    with torch.no_grad():
        plain = base(ids).logits
    pm = PeftModel.from_pretrained(base, str(exported["adapter"])).eval()
    for name, p in pm.named_parameters():
        if ".lora_" in name:
            key = name.removeprefix("base_model.model.")
            assert torch.equal(p.detach(), final[key]), key
    merged = AutoModelForCausalLM.from_pretrained(exported["merged"]).eval()
    with torch.no_grad():
        with_adapter = pm(ids).logits
        torch.testing.assert_close(merged(ids).logits, with_adapter, rtol=1e-5, atol=1e-5)
    # the adapters do change the model: the comparison is not base vs base
    assert float((with_adapter - plain).abs().max()) > 1e-3
    names = set(merged.state_dict())
    assert not any("lora_" in n or "base_layer" in n for n in names)


@pytest.mark.parametrize(("change", "message"), [
    ({"lora": None}, "holds LoRA adapters only"),
    ({"lora": {"rank": 8}}, "lora.rank = 8"),
    ({"run": {"seed": 4}}, "resume with run.seed: 3"),
])
def test_resume_refuses_other_adapters_or_base(runs, change, message):
    """Preflight, before any rank starts: a LoRA checkpoint only fits its own adapters on its
    own base (the random-init base is the seed's)."""
    from resume_worker import resume_config

    from shardwise.config.schema import TrainConfig
    from shardwise.errors import ShardwiseError
    from shardwise.run import run_spec
    from shardwise.train.checkpoint.resume_checks import check_resumable

    raw = resume_config("zero3+lora", 2, runs / "x").model_dump()
    for section, value in change.items():
        raw[section] = None if value is None else raw[section] | value
    cfg = TrainConfig.model_validate(raw)
    with pytest.raises(ShardwiseError, match=message.replace(".", r"\.")):
        check_resumable(cfg, run_spec(cfg, 2, "cpu"), _ckpt(runs))
    same = resume_config("zero3+lora", 2, runs / "x")
    check_resumable(same, run_spec(same, 2, "cpu"), _ckpt(runs))  # its own config resumes
