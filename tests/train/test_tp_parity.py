"""Tensor (and sequence) parallelism trains what one process trains (issue 26).

`strategy.tp: 2` on 2 gloo ranks (TP alone: FSDP2 has no data-parallel group to shard over) and
FSDP2 × TP = 2 × 2 on 4 ranks, against one process, fp32, gradient accumulation 2, 8 steps, a
tiny Llama (MHA, untied) and a tiny Qwen2 (GQA 4:2, q/k/v biases, tied embeddings), each on the
bundled SFT data packed into rows of 128 tokens (several documents per row: position_ids restart
per document, one SDPA call per document) and on synthetic rows. The chunked loss runs
vocab-parallel on lm_head's shard; one run takes the standard loss through `loss_parallel`.

- Loss curves agree within 1e-5 relative everywhere.
- Final weights agree within 1e-5 relative on synthetic data (every token frequent). On packed
  SFT data (Qwen's within 1.2e-5 today, Llama's below) the tiny Llama's embedding rows of tokens the data holds once or
  twice get gradients at the rounding floor in some elements, which AdamW's per-element
  normalisation turns into lr-sized steps: ~1e-3 relative in the embedding and ~4e-4 in the
  layers it feeds after 8 steps (torch 2.13, transformers 5.24), the gap every data-parallel
  strategy shows across world sizes on this data (tests/train/test_packed_parity.py's docstring
  measures it for DDP). TP changes only the order of the row-parallel and vocab-parallel sums,
  so it hits the same floor; the synthetic runs, same code path, hold 1e-5.
- Qwen's k_proj bias is left out: its gradient is zero in exact arithmetic (test_packed_parity).
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_packed_parity import result
from test_parity import RTOL, rel_loss_diff, rel_weight_diff

pytestmark = pytest.mark.distributed

MODELS = ["tiny-llama", "tiny-qwen"]
DATA = ["sft", "synthetic"]


def _flags(data: str) -> str:
    return ":sft" if data == "sft" else ""


ONE = [f"{m}:ddp:2{_flags(d)}" for m in MODELS for d in DATA] + ["tiny-llama:ddp:2:std", "tiny-llama:ddp:1:repeat:bf16"]
TP = [f"{m}:fsdp:2{_flags(d)}:tp2" for m in MODELS for d in DATA]
TWO = [*TP, "tiny-llama:fsdp:2:tp2:std", "tiny-llama:fsdp:1:repeat:bf16:tp2", "tiny-llama:fsdp:2:ckpt:tp2"]
# What AdamW makes of the rounding floor on packed SFT rows (module docstring)
SFT_BOUNDS = {"model.embed_tokens.weight": 2e-3, "other": 1e-3}


@pytest.fixture(scope="module")
def one_process(ranks_runner):
    return ranks_runner(ONE, nproc=1)


@pytest.fixture(scope="module")
def tp2(ranks_runner):
    return ranks_runner(TWO, nproc=2)


@pytest.fixture(scope="module")
def fsdp_tp(ranks_runner):
    return ranks_runner(TP, nproc=4)


@functools.cache
def _initial(model: str) -> dict[str, torch.Tensor]:
    from parity_worker import parity_config

    from shardwise.run import run_spec
    from shardwise.train.model import build_model

    return build_model(run_spec(parity_config("ddp", 1, 1, model), 1, "cpu")).state_dict()


def _compare(got: dict, ref: dict, exact: bool, model: str) -> None:
    loss = rel_loss_diff(got["losses"], ref["losses"])
    assert len(got["losses"]) == 8
    assert loss <= RTOL, f"loss curve off by {loss:.2e} relative"
    w = {k: v for k, v in rel_weight_diff(got["weights"], ref["weights"]).items() if not k.endswith("k_proj.bias")}
    worst = max(w, key=w.get)
    if exact:
        assert w[worst] <= RTOL, (worst, w[worst])
    else:
        for k, v in w.items():
            assert v <= SFT_BOUNDS.get(k, SFT_BOUNDS["other"]), (k, v)
    init = _initial(model)
    keys = [k for k in ref["weights"] if k in init and "norm" not in k]
    moved = rel_weight_diff({k: init[k] for k in keys}, {k: got["weights"][k] for k in keys})
    assert min(moved.values()) > 100 * RTOL  # it trained


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_one_process(world, model, data, one_process, tp2, fsdp_tp):
    out = tp2 if world == 2 else fsdp_tp
    got = result(out, f"{model}:fsdp:2{_flags(data)}:tp2", world)
    ref = result(one_process, f"{model}:ddp:2{_flags(data)}", 1)
    # TP alone (one data rank) is planned as DDP at tp 2: no fully_shard (Strategy.single_rank_ddp)
    assert got["engine"] == ("ddp" if world == 2 else "fsdp2")
    _compare(got, ref, exact=data == "synthetic", model=model)


def test_activation_checkpointing_under_tp(one_process, tp2):
    got = result(tp2, "tiny-llama:fsdp:2:ckpt:tp2", 2)
    _compare(got, result(one_process, "tiny-llama:ddp:2", 1), exact=True, model="tiny-llama")


def test_standard_loss_runs_loss_parallel(one_process, tp2):
    got = result(tp2, "tiny-llama:fsdp:2:tp2:std", 2)
    _compare(got, result(one_process, "tiny-llama:ddp:2:std", 1), exact=True, model="tiny-llama")


def test_bf16_tp_alone_trains_as_ddp_does(one_process, tp2):
    """TP alone has no fully_shard (no MixedPrecisionPolicy): bf16-mixed is autocast over fp32
    weights, as the DDP engine runs it; the curve matches DDP's bf16 one (1.6e-4 today)."""
    got = result(tp2, "tiny-llama:fsdp:1:repeat:bf16:tp2", 2)["losses"]
    ref = result(one_process, "tiny-llama:ddp:1:repeat:bf16", 1)["losses"]
    assert got[-1] < got[0] - 1.0  # it learns the repeated batch
    assert rel_loss_diff(got, ref) <= 2e-3
