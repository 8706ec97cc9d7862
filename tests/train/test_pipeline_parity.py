"""Pipeline parallelism trains what one process trains, resumes exactly, and its checkpoints
move between pipeline degrees and engines.

Tiny 4-layer Llama (MHA) and Qwen2 (GQA 4:2, q/k/v biases, untied), the bundled SFT data packed
into rows of 128 tokens (padding-free varlen batches, padded for the pipeline to one shape per
micro-batch: shardwise.train.sft_data), 8 steps of a global batch of 8 rows, gradient accumulation
4 (the pipeline's micro-batches), fp32, AdamW eps 1e-5 (as the other parity tests compare
weights: tests/train/test_tp_parity.py's docstring), clipping at 1.0, on gloo:

- pp 2 on 2 ranks with each schedule: 1F1B (Llama), GPipe (Qwen2), interleaved 1F1B with 2
  virtual stages per rank (Llama);
- pp 2 × dp 2 (FSDP2 inside each stage, Qwen2) and pp 2 × tp 2 (DTensor TP inside each stage,
  Llama; with the chunked loss and with the standard one under loss_parallel) on 4 ranks; dp 2 × tp 2 × pp 2 (Qwen2) on 8 ranks;
- LoRA (rank 4, every decoder linear) and full activation checkpointing at pp 2; the validation
  split evaluated at steps 4 and 8.
Against one process (DDP on 1 rank): loss curves and final weights within 1e-5 relative. Measured
(torch 2.13): loss curves 0 to 1.1e-7, weights 0 to 5e-7, but Qwen2's k_proj bias at
dp 2 × tp 2 × pp 2, 1.8e-6 (its gradient is zero in exact arithmetic: test_packed_parity; left out
as in test_tp_parity).

Resume: from step 4 on the same layout (pp 2), bit-exact (losses and every final weight); pp 2 → 1,
1 → 2, and pp 2 × dp 2 → ZeRO-3 (DeepSpeed), FSDP2 and pp 4 on 4 ranks, within 1e-5. Export: `shardwise export` of a
pp 2 checkpoint loads with `from_pretrained` and holds the run's final weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HERE, run_once
from test_packed_parity import result
from test_parity import RTOL, rel_loss_diff, rel_weight_diff

pytestmark = pytest.mark.distributed

WORKER = HERE / "pipeline_worker.py"
F = "sft:eps1e-5"
LLAMA_REF = f"pp-llama:ddp:4:{F}:eval:save4"
QWEN_REF = f"pp-qwen2:ddp:4:{F}"
LORA_REF = f"pp-llama:ddp:4:{F}:eval:lora"
STD_REF = f"pp-llama:ddp:4:{F}:eval:std"  # the standard loss (logits, then cross-entropy)
ONE_F1B = f"pp-llama:fsdp:4:pp2:{F}:eval:save4"  # 1F1B, the default schedule
GPIPE = f"pp-qwen2:fsdp:4:pp2:{F}:gpipe"
INTERLEAVED = f"pp-llama:fsdp:4:pp2:{F}:eval:interleaved2"
LORA = f"pp-llama:fsdp:4:pp2:{F}:eval:lora"
CKPT = f"pp-llama:fsdp:4:pp2:{F}:eval:ckpt"  # activation checkpointing of every decoder layer
PP_DP = f"pp-qwen2:fsdp:4:pp2:{F}:save4"
PP_TP = f"pp-llama:fsdp:4:pp2:tp2:{F}:eval"
PP_TP_STD = f"pp-llama:fsdp:4:pp2:tp2:{F}:eval:std"  # vocabulary-parallel logits under loss_parallel
THREE_D = f"pp-qwen2:fsdp:4:pp2:tp2:{F}"


def _dir(item: str) -> str:
    return item.replace(":", "-")


SAME = f"pp-llama:fsdp:4:pp2:{F}:eval:from={_dir(ONE_F1B)}@4"  # resumed on the same layout
TO_ONE = f"pp-llama:fsdp:4:{F}:eval:from={_dir(ONE_F1B)}@4"  # pp 2 -> 1 (one rank: DDP)
FROM_ONE = f"pp-llama:fsdp:4:pp2:{F}:eval:from={_dir(LLAMA_REF)}@4"  # 1 -> pp 2
TO_ZERO3 = f"pp-qwen2:zero3:2:{F}:from={_dir(PP_DP)}@4"  # pp 2 × dp 2 -> ZeRO-3 on 4 ranks
TO_FSDP = f"pp-qwen2:fsdp:2:{F}:from={_dir(PP_DP)}@4"  # pp 2 × dp 2 -> FSDP2 over 4 data ranks
TO_PP4 = f"pp-qwen2:fsdp:4:pp4:{F}:from={_dir(PP_DP)}@4"  # pp 2 × dp 2 -> pp 4 (a layer per stage)

LAUNCHES = [
    ([LLAMA_REF, QWEN_REF, LORA_REF, STD_REF], 1, 240),
    ([ONE_F1B, GPIPE, INTERLEAVED, LORA, CKPT, SAME, FROM_ONE], 2, 300),
    ([TO_ONE], 1, 120),
    ([PP_DP, PP_TP, PP_TP_STD, TO_ZERO3, TO_FSDP, TO_PP4], 4, 480),
    ([THREE_D], 8, 300),
]


@pytest.fixture(scope="module")
def runs(shared_dir) -> Path:
    return run_once(shared_dir / "pipeline-parity", WORKER, LAUNCHES)


def _get(out: Path, item: str) -> dict:
    world = next(n for items, n, _ in LAUNCHES if item in items)
    return result(out, item, world)


def _weights_close(got: dict, ref: dict) -> None:
    w = {k: v for k, v in rel_weight_diff(got, ref).items() if not k.endswith("k_proj.bias")}
    worst = max(w, key=w.get)
    assert w[worst] <= RTOL, (worst, w[worst])


@pytest.mark.parametrize("item, ref, layout", [
    (ONE_F1B, LLAMA_REF, dict(pp=2, dp_shard=1, tp=1)),
    (GPIPE, QWEN_REF, dict(pp=2, dp_shard=1, tp=1)),
    (INTERLEAVED, LLAMA_REF, dict(pp=2, dp_shard=1, tp=1)),
    (PP_DP, QWEN_REF, dict(pp=2, dp_shard=2, tp=1)),
    (PP_TP, LLAMA_REF, dict(pp=2, dp_shard=1, tp=2)),
    (PP_TP_STD, STD_REF, dict(pp=2, dp_shard=1, tp=2)),
    (THREE_D, QWEN_REF, dict(pp=2, dp_shard=2, tp=2)),
    (LORA, LORA_REF, dict(pp=2, dp_shard=1, tp=1)),
    (CKPT, LLAMA_REF, dict(pp=2, dp_shard=1, tp=1)),
])
def test_pipeline_matches_one_process(item, ref, layout, runs):
    got, want = _get(runs, item), _get(runs, ref)
    assert got["engine"] == "pipeline" and {k: got["layout"][k] for k in layout} == layout
    assert len(got["losses"]) == 8
    loss = rel_loss_diff(got["losses"], want["losses"])
    assert loss <= RTOL, f"loss curve off by {loss:.2e} relative"
    # clipped by the norm over every stage's gradients: equal to the one process's within 1e-4 (fp32
    # sums of squares in another order; 1.1e-5 at dp 2 × tp 2 × pp 2, where Qwen2's k_proj bias
    # gradients, zero in exact arithmetic, are rounding noise that differs by layout)
    assert rel_loss_diff(got["grad_norms"], want["grad_norms"]) <= 1e-4
    assert got["losses"][-1] < got["losses"][0] - 0.1  # it trained (LoRA: 7.64 -> 7.41)
    _weights_close(got["weights"], want["weights"])
    if "eval" in item:  # evaluated through the stages in order, at steps 4 and 8
        assert len(got["evals"]) == 2 and rel_loss_diff(got["evals"], want["evals"]) <= RTOL


def test_resume_on_the_same_layout_is_bit_exact(runs):
    full, resumed = _get(runs, ONE_F1B), _get(runs, SAME)
    assert resumed["losses"] == full["losses"][4:]
    assert resumed["weights"].keys() == full["weights"].keys()
    assert all(torch.equal(resumed["weights"][k], full["weights"][k]) for k in full["weights"])


@pytest.mark.parametrize("item, source", [(TO_ONE, ONE_F1B), (FROM_ONE, LLAMA_REF), (TO_ZERO3, PP_DP),
                                          (TO_FSDP, PP_DP), (TO_PP4, PP_DP)])
def test_resume_across_pipeline_degrees_and_engines(item, source, runs):
    got, full = _get(runs, item), _get(runs, source)
    assert len(got["losses"]) == 4
    assert rel_loss_diff(got["losses"], full["losses"][4:]) <= RTOL
    _weights_close(got["weights"], full["weights"])


def test_export_of_a_pipeline_checkpoint_loads_with_from_pretrained(runs, tmp_path):
    """`shardwise export` reads the checkpoint both stages wrote (each its own layers, by name)."""
    from transformers import AutoModelForCausalLM

    ckpt = runs / "runs" / _dir(ONE_F1B) / "checkpoints" / "step-00000008"
    out = tmp_path / "hf"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "export", str(ckpt), str(out), "--set",
                           "export.dtype=fp32"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    final = _get(runs, ONE_F1B)["weights"]
    sd = model.state_dict()
    assert set(final) <= set(sd)
    assert all(torch.equal(sd[k], final[k]) for k in final)
