"""A 16-bit CPU run on a CPU whose 16-bit matrix multiply is torch's reference loop is told so
before it starts: on an AVX2 machine a 1.36B LoRA step took 12 minutes at bf16 and the
watchdog's default run.timeout_s (600 s) ended it as hung, with nothing saying why it was slow."""

from __future__ import annotations

import pytest
import torch

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.preflight import cpu_precision_note


def _run(precision: str, device: str = "cpu"):
    cfg = TrainConfig.model_validate({
        "model": {"name": "qwen2.5-0.5b"}, "data": {"kind": "synthetic", "synthetic": {"seq_len": 64}},
        "strategy": {"name": "fsdp"}, "precision": precision,
        "run": {"micro_batch": 1, "device": device, "nproc": 2}, "hardware": {"gpu": "h100-sxm"},
    })
    return run_spec(cfg, 2, device, environ={})


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", "bf16"), ("bf16-pure", "bf16"), ("fp16-mixed", "fp16")])
def test_a_16_bit_cpu_run_without_the_kernel_is_told_to_use_fp32(precision, dtype):
    asked = []
    note = cpu_precision_note(_run(precision), native=lambda d: asked.append(d) or False)
    assert asked == [dtype]
    assert note is not None and f"precision {precision!r}" in note and f"native {dtype} matrix multiply" in note
    assert "precision fp32" in note and "run.timeout_s" in note
    assert torch.backends.cpu.get_cpu_capability() in note


def test_no_note_where_the_kernel_is_native_or_nothing_is_16_bit():
    never = lambda d: pytest.fail("asked about the CPU for a run that needs no answer")  # noqa: E731
    assert cpu_precision_note(_run("bf16-mixed"), native=lambda d: True) is None
    assert cpu_precision_note(_run("fp32"), native=never) is None
    assert cpu_precision_note(_run("bf16-mixed", device="cuda"), native=never) is None

