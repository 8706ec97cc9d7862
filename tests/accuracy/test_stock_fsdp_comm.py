"""Stock FSDP2 wrapping, written as users write it (no shardwise engine): `fully_shard` on each
decoder layer, then on the root, on 2 gloo ranks (torch on CPU), the bench model (tiny Llama
from its LlamaConfig, fp32, untied). The bytes handed to all-gather in one forward + backward
(shardwise.bench.comm_worker.measure_fsdp_wrapping, counted by shardwise.bench.comm) against
the plan for one micro-batch, exactly:

- "stock": reshard_after_forward=True everywhere, the root too (torchtune's `shard_model`).
  torch reshards an explicitly resharding root after forward and gathers it again in backward,
  so every parameter is gathered twice: 2Ψ per micro-batch (planned as `reshard_after_forward:
  all`, Strategy.reshards_root).
- "trainer": the layout train/engines/fsdp.py runs by default (the last layer and the root kept
  gathered; planned as "not-last").

The trainer's own engines on the same counts are tests/accuracy/test_measured_comm.py's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardwise.bench import comm_worker as w


@pytest.fixture(scope="module")
def counted() -> dict[str, list[dict]]:
    runs = w.measure_fsdp_wrapping(tuple(w.WRAPPINGS), timeout_s=300)
    assert set(runs) == set(w.WRAPPINGS), runs.keys()
    for ranks in runs.values():
        for r in ranks:
            assert "error" not in r, r
    return runs


def _plan(variant: str):
    from shardwise.plan.comm import plan_comm

    run = w.bench_run(variant, 1)  # one micro-batch per step: the plan's step is the forward + backward counted
    return plan_comm(run.model, run.hardware, run.train, run.strategy)


def _sizes() -> tuple[int, int, int]:
    """(Ψ, the root's parameters, the last decoder layer's), from a meta build of the model."""
    sizes = w.param_sizes()
    last = f"model.layers.{w.TINY_LLAMA['num_hidden_layers'] - 1}."
    root = sum(v for n, v in sizes.items() if not n.startswith("model.layers."))
    return sum(sizes.values()), root, sum(v for n, v in sizes.items() if n.startswith(last))


@pytest.mark.distributed
def test_stock_fully_shard_gathers_every_parameter_twice(counted) -> None:
    psi, _, _ = _sizes()
    units = w.TINY_LLAMA["num_hidden_layers"] + 1
    for r in counted["stock"]:
        got = r["second"]
        assert got["bytes"]["all_gather"] == 2 * 4 * psi  # fp32, forward and backward: 2Ψ
        assert got["calls"]["all_gather"] == 2 * units
        assert r["first"]["bytes"]["all_gather"] == got["bytes"]["all_gather"]  # lazy init gathers nothing more


@pytest.mark.distributed
def test_stock_fully_shard_all_gather_equals_the_plan(counted) -> None:
    comm = _plan("fsdp-stock")  # reshard_after_forward: all
    for r in counted["stock"]:
        got = r["second"]
        assert got["bytes"]["all_gather"] == comm.all_gather
        assert got["bytes"]["reduce_scatter"] == comm.reduce_scatter
        assert sum(got["calls"].values()) == comm.calls


@pytest.mark.distributed
def test_trainer_wrapping_all_gather_equals_the_plan(counted) -> None:
    psi, root, last = _sizes()
    comm = _plan("fsdp")  # the trainer's default, not-last
    for r in counted["trainer"]:
        got = r["second"]
        # backward gathers again every decoder layer but the last; neither the last nor the root
        assert got["bytes"]["all_gather"] == 4 * (psi + psi - root - last)
        assert got["bytes"]["all_gather"] == comm.all_gather
        assert got["bytes"]["reduce_scatter"] == comm.reduce_scatter
        assert sum(got["calls"].values()) == comm.calls
