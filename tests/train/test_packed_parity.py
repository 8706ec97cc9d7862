"""Parity across strategies holds with packed SFT rows on the default packed path (issue 22
item 2): the bundled SFT data packed into rows of 128 tokens (several documents per row), SDPA,
which on CPU attends one SDPA call per document on padding-free [1, T] micro-batches.

- At one world size, the default path and the dense-mask reference ([B, 1, S, S], padded rows)
  train the same curve within 1e-5 relative, and on one process the same weights within 1e-5;
  on 2 ranks their weights differ by what the all-reduced rounding floor grows into under AdamW
  (below; with torch 2.13, transformers 5.24 and datasets 5.2: 2.6e-4 in the embedding, 5e-5 in
  the layers, where the test keeps the across-world bounds 2e-3 and 3e-4). Every strategy on 2
  gloo ranks matches 2-rank DDP within 1e-5.
- Across world sizes (2 ranks vs 1 process) the loss curves agree within 1e-5, but on SFT data
  the weights do not, on either path: embedding rows of tokens the data holds once or twice get
  gradients at the rounding floor in some elements, which AdamW's per-element normalisation turns
  into lr-sized steps (~1e-3 relative after 8 steps, ~3e-4 in the layers it feeds; synthetic
  data, every token frequent, stays within 1e-5: tests/train/test_parity.py). The default path's
  gap equals the dense path's tensor by tensor within 10% (7% today, in the embedding): packing
  without the mask adds nothing beyond that noise.
- Qwen's k_proj bias is left out of the 1e-5 check: its gradient is zero in exact arithmetic (it
  adds q·b to every score of a query, which softmax ignores), so AdamW steps on rounding noise.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_parity import RTOL, initial_weights, rel_loss_diff, rel_weight_diff

pytestmark = pytest.mark.distributed

ONE = ["tiny-llama:ddp:1:sft", "tiny-llama:ddp:1:sft:dense"]
TWO = ["tiny-llama:ddp:1:sft", "tiny-llama:ddp:1:sft:dense", "tiny-llama:zero2:1:sft", "tiny-llama:zero3:1:sft",
       "tiny-llama:fsdp:1:sft", "tiny-qwen:ddp:1:sft", "tiny-qwen:zero3:1:sft", "tiny-qwen:fsdp:1:sft"]
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def one_rank(ranks_runner):
    return ranks_runner(ONE, nproc=1)


@pytest.fixture(scope="module")
def two_ranks(ranks_runner):
    return ranks_runner(TWO, nproc=2)


def result(out, run: str, world: int) -> dict:
    return torch.load(out / f"{run.replace(':', '-')}-w{world}.pt")


def diffs(a: dict, b: dict) -> tuple[float, dict[str, float]]:
    return rel_loss_diff(a["losses"], b["losses"]), rel_weight_diff(a["weights"], b["weights"])


def record(shared_dir, name: str, loss: float, w: dict[str, float]) -> None:
    (shared_dir / f"packed-parity-{name}.json").write_text(
        json.dumps({"loss_rel": loss, "weight_rel_fro": max(w.values()), "worst": max(w, key=w.get)}))


@pytest.mark.parametrize("world", [1, 2])
def test_the_default_packed_path_equals_the_dense_mask(world, one_rank, two_ranks, shared_dir):
    out = one_rank if world == 1 else two_ranks
    varlen, dense = result(out, ONE[0], world), result(out, ONE[1], world)
    loss, w = diffs(varlen, dense)
    record(shared_dir, f"dense-w{world}", loss, w)
    assert loss <= RTOL, loss
    if world == 1:
        assert max(w.values()) <= RTOL, (max(w, key=w.get), max(w.values()))
    else:  # the all-reduced rounding floor, amplified by AdamW (module doc): the across-world bounds
        assert w[EMBED] <= 2e-3 and max(v for k, v in w.items() if k != EMBED) <= 3e-4, \
            (max(w, key=w.get), max(w.values()))
    init = initial_weights()
    moved = rel_weight_diff({k: init[k] for k in varlen["weights"]}, varlen["weights"])
    assert min(v for k, v in moved.items() if "norm" not in k) > 100 * RTOL  # it trained


@pytest.mark.parametrize("run", [r for r in TWO if ":ddp:" not in r])
def test_every_strategy_matches_ddp_with_packed_rows(run, two_ranks, shared_dir):
    ref = result(two_ranks, f"{run.split(':')[0]}:ddp:1:sft", 2)
    got = result(two_ranks, run, 2)
    loss, w = diffs(got, ref)
    w = {k: v for k, v in w.items() if not k.endswith("k_proj.bias")}  # zero gradient: see the docstring
    record(shared_dir, run.replace(":", "-"), loss, w)
    assert len(got["losses"]) == 8
    assert loss <= RTOL, f"{run}: loss curve off by {loss:.2e} relative"
    assert max(w.values()) <= RTOL, f"{run}: {max(w, key=w.get)} off by {max(w.values()):.2e} relative"


def test_two_ranks_match_one_process_as_the_dense_path_does(one_rank, two_ranks, shared_dir):
    loss, w = diffs(result(two_ranks, ONE[0], 2), result(one_rank, ONE[0], 1))
    dense_loss, dense_w = diffs(result(two_ranks, ONE[1], 2), result(one_rank, ONE[1], 1))
    record(shared_dir, "world", loss, w)
    record(shared_dir, "world-dense", dense_loss, dense_w)
    assert loss <= RTOL and dense_loss <= RTOL
    assert w[EMBED] <= 2e-3
    off = {k: abs(v - dense_w[k]) / (dense_w[k] + RTOL) for k, v in w.items()}
    assert max(off.values()) <= 0.10, (max(off, key=off.get), max(off.values()))
