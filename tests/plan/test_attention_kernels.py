"""The attention kernel a run uses sets the rate its attention is priced at (plan/timing.py
`compute_time`, GPUSpec.attention_efficiency_of), never its memory: llm-foundry's Triton flash
attention (`--attention triton`, what MPT's published 2023 benchmarks ran) is FlashAttention-2's
rate over the FlashAttention-2 paper's speed-up (1.3-1.5x forward, 2x backward: 1.8 over both)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardwise import catalog
from shardwise.emit import emitted_run
from shardwise.plan.evaluate import evaluate
from shardwise.specs import Strategy, TrainSpec

TIMING_YAML = Path(catalog.__file__).parent / "timing.yaml"
# (1.4 forward + 2.5 x 2 backward) / 3.5: the backward has 2.5x the forward's FLOPs
PAPER_RATIO = (1.4 + 2.5 * 2) / 3.5


def _plan(gpu: str, attention: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "shardwise.cli.app", "plan", "--model", "llama-3.1-8b", "--gpus", "8",
                          "--gpu", gpu, "-s", "fsdp", "--seq-len", "16384", "--attention", attention, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["strategies"][0]


# (On Hopper the fitted FlashAttention-2 figure sits below the Triton prior: docs/accuracy.md says why.)
@pytest.mark.parametrize("gpu", ["a100-80g", "h100-sxm"])
def test_shardwise_plan_prices_triton_attention_at_flash_attention_2_over_the_paper_ratio(gpu):
    flash, triton = _plan(gpu, "flash"), _plan(gpu, "triton")
    spec = catalog.get_gpu(gpu)
    fa2 = spec.attention_efficiency_of("flash")
    assert triton["time"]["attention_s"] == pytest.approx(flash["time"]["attention_s"] * fa2
                                                          / spec.triton_attention_efficiency, rel=1e-6)
    assert triton["time"]["attention_s"] != pytest.approx(flash["time"]["attention_s"], rel=0.05)  # its own rate
    # everything but attention is the same step
    assert triton["time"]["gemm_s"] == flash["time"]["gemm_s"]
    assert triton["memory"] == flash["memory"]  # an O(seq) fused kernel: the same saved tensors


def test_each_stated_triton_figure_is_its_familys_flash_attention_2_prior_over_the_paper_ratio():
    fams = yaml.safe_load(TIMING_YAML.read_text())["families"]
    stated = {name: fam["triton_attention_efficiency"]["value"] for name, fam in fams.items()
              if "triton_attention_efficiency" in fam}
    assert set(stated) == {"hopper", "ampere", "default"}

    def fa2_prior(fam: dict) -> float:
        entry = fam.get("flash_attention_efficiency") or fam["attention_efficiency"]
        return (entry.get("prior") or entry)["value"]  # the figure no tokens/s run informed

    for name, value in stated.items():
        assert value == pytest.approx(fa2_prior(fams[name]) / PAPER_RATIO, abs=0.005), name


def test_a_gpu_without_a_triton_figure_prices_it_as_its_sdpa():
    mi300x = catalog.get_gpu("mi300x")  # CDNA 3: no Triton figure of its own, none borrowed
    assert mi300x.triton_attention_efficiency is None
    assert mi300x.attention_efficiency_of("triton") == mi300x.attention_efficiency


def test_the_trainer_runs_a_triton_plan_with_sdpa_and_says_so():
    hw = catalog.build_hardware(gpu="a100-80g", gpus=8)
    run, notes = emitted_run(catalog.get_model("llama-2-7b"), hw, TrainSpec(attention="triton"),
                             Strategy.from_name("fsdp"))
    assert run.train.attention == "sdpa"
    assert any("planned triton attention; the trainer uses sdpa" in n for n in notes)


def test_evaluate_accepts_triton_on_every_catalog_gpu():
    model = catalog.get_model("llama-3.2-1b")
    for gpu in catalog.gpu_names():
        ev = evaluate(model, catalog.build_hardware(gpu=gpu, gpus=8), TrainSpec(attention="triton"),
                      Strategy.from_name("fsdp"))
        assert ev.time.tokens_per_s_per_gpu > 0, gpu
