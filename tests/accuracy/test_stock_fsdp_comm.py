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
- "torchtitan": every layer but the last resharded, and the root (torchtitan's apply_fsdp at pp 1):
  planned as "not-last" with `fsdp.reshard_root` true; and the trainer's own `shard_model` with
  that knob ("trainer-root").
- The embedding and the head as units of their own (`fsdp.wrap_embeddings`): torchtune's full
  fine-tuning configs (`custom_sharded_layers`, True everywhere: planned as "all"), accelerate
  1.16's `fsdp2_prepare_model` (the head and the root kept: planned as "layers"), and the
  trainer's own `shard_model` on that plan's run.

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


def _plan(variant: str, **fsdp):
    from shardwise.plan.comm import plan_comm

    run = w.bench_run(variant, 1)  # one micro-batch per step: the plan's step is the forward + backward counted
    strategy = run.strategy.model_copy(update={"fsdp": run.strategy.fsdp.model_copy(update=fsdp)})
    return plan_comm(run.model, run.hardware, run.train, strategy)


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


def _part(prefix: str) -> int:
    return sum(v for n, v in w.param_sizes().items() if n.startswith(prefix))


@pytest.mark.distributed
def test_carved_units_all_gather_equals_the_plan(counted) -> None:
    psi, root, _ = _sizes()
    embedding, lm_head, norm = _part("model.embed_tokens."), _part("lm_head."), _part("model.norm.")
    assert embedding + lm_head + norm == root  # nothing else outside the layers: the carved root is empty
    layers = w.TINY_LLAMA["num_hidden_layers"]
    # torchtune: one value for every unit, so every parameter twice, as stock; its root keeps the
    # final norm (lm_head alone is the head unit) where the plan puts the norm with lm_head
    tt = _plan("fsdp-stock", wrap_embeddings=True)
    assert tt.all_gather == 2 * 4 * psi
    for r in counted["torchtune-carved"]:
        assert r["second"]["bytes"]["all_gather"] == tt.all_gather
        assert r["second"]["bytes"]["reduce_scatter"] == tt.reduce_scatter
        assert r["second"]["calls"]["all_gather"] == 2 * (layers + 3)  # layers, embedding, lm_head, root (norm)
    # accelerate 1.16 and the trainer carving: backward gathers every layer and the embedding
    # again, neither the head unit nor the (empty) root
    acc = _plan("fsdp-carved")
    assert acc.all_gather == 4 * (psi + psi - root + embedding)
    for name in ("accelerate", "trainer-carved"):
        for r in counted[name]:
            got = r["second"]
            assert got["bytes"]["all_gather"] == acc.all_gather, name
            assert got["bytes"]["reduce_scatter"] == acc.reduce_scatter, name
            assert got["calls"]["all_gather"] == (layers + 2) + (layers + 1), name
            assert sum(got["calls"].values()) == acc.calls, name


@pytest.mark.distributed
def test_a_resharded_root_beside_not_last_layers_all_gather_equals_the_plan(counted) -> None:
    """torchtitan's layout, wrapped by hand and by the trainer with `fsdp.reshard_root` true:
    backward gathers every decoder layer but the last again, and the root."""
    psi, _, last = _sizes()
    comm = _plan("fsdp", reshard_root=True)
    assert comm.all_gather == 4 * (psi + psi - last)
    layers = w.TINY_LLAMA["num_hidden_layers"]
    for name in ("torchtitan", "trainer-root"):
        for r in counted[name]:
            got = r["second"]
            assert got["bytes"]["all_gather"] == comm.all_gather, name
            assert got["bytes"]["reduce_scatter"] == comm.reduce_scatter, name
            assert got["calls"]["all_gather"] == (layers + 1) + layers, name
            assert sum(got["calls"].values()) == comm.calls, name
