"""`strategy.fsdp.wrap_embeddings`: the token embedding and the head (final norm + lm_head) as
FSDP2 units of their own (torchtune's `custom_sharded_layers`, accelerate 1.16's layout). The
planner's bytes against hand arithmetic on Llama 3.1 70B's shape (untied, 128,256 × 8,192
embedding and lm_head, 80 layers), its refusals in the trainer, and the 70B CPU-offload run of
torchtune's README. The counts of live 2-rank runs are tests/accuracy/test_stock_fsdp_comm.py's;
the trainer's loss and weights with the carved units, tests/train/test_parity.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardwise import catalog
from shardwise.config.strategy import FSDPKnobs
from shardwise.errors import ShardwiseError
from shardwise.plan.comm import plan_comm
from shardwise.plan.memory import plan_memory
from shardwise.specs import Strategy, TrainSpec

M70 = catalog.get_model("llama-3.1-70b")
H, V, FFN, N = 8192, 128256, 28672, 80  # hidden, vocabulary, MLP width, layers (config.json of Llama 3.1 70B)
LAYER = 2 * H * H + 2 * H * (8 * 128) + 3 * H * FFN + 2 * H  # q, o; k, v (8 kv heads of 128); MLP; 2 norms
EMB = V * H
PSI = N * LAYER + 2 * EMB + H  # layers, embedding, lm_head, final norm
HW8 = catalog.build_hardware(gpu="a100-80g", gpus=8)
PURE = TrainSpec(micro_batch=2, seq_len=2048, precision="bf16-pure", checkpointing="full")


def fsdp(name: str = "fsdp", pp: int = 1, **knobs) -> Strategy:
    return Strategy.from_name(name, pp=pp, fsdp=FSDPKnobs(**knobs))


def test_hand_shape_is_the_catalogs():
    assert M70.params_per_layer == LAYER and M70.params == PSI


@pytest.mark.parametrize("reshard", ["all", "layers", "not-last"])
def test_carved_units_gather_two_units_and_no_root(reshard):
    root = plan_memory(M70, HW8, PURE, fsdp(reshard_after_forward=reshard)).gpu
    carved = plan_memory(M70, HW8, PURE, fsdp(reshard_after_forward=reshard, wrap_embeddings=True)).gpu
    # the root (embedding, norm, lm_head) held through forward and backward beside two layers, or
    # two units in flight: the head (final norm + lm_head, the largest) and a layer, and nothing
    # left in the root
    assert root.gathered_params == 2 * (2 * LAYER + 2 * EMB + H)
    assert carved.gathered_params == 2 * (LAYER + EMB + H)
    # bf16-pure reduce-scatters in bf16 from a copy: a layer's grads and their copy, and lm_head's
    # unsharded grad waiting for the root; carved, lm_head's unit reduces as its backward ends
    assert root.grad_buffers == (2 + 2) * LAYER + 2 * EMB
    assert carved.grad_buffers == (2 + 2) * (EMB + H)
    # the embedding's reduce-scatter at the end of backward, as the root's was
    assert carved.step_buffers >= (2 + 2) * EMB


def test_carved_comm_regathers_as_each_unit_reshards():
    k = 2
    train = TrainSpec(grad_accum=k)  # bf16-mixed: gathers of 2 bytes, fp32 reduce-scatter
    held = {"reduce_every_micro_batch": False}
    layers = plan_comm(M70, HW8, train, fsdp(reshard_after_forward="layers", wrap_embeddings=True, **held))
    # forward: every unit; backward: the layers and the embedding; the head ([norm, lm_head])
    # and the empty root are kept: accelerate 1.16's counts
    assert layers.all_gather == 2 * k * (PSI + N * LAYER + EMB)
    assert layers.calls == k * ((N + 2) + (N + 1)) + (N + 2)
    stock = plan_comm(M70, HW8, train, fsdp(reshard_after_forward="all", wrap_embeddings=True, **held))
    assert stock.all_gather == 2 * k * 2 * PSI  # torchtune: every unit resharded, every parameter twice
    assert stock.calls == k * 2 * (N + 2) + (N + 2)
    assert stock.reduce_scatter == layers.reduce_scatter == 4 * PSI


def test_tied_embeddings_and_pipeline_stages_keep_their_root():
    tied = catalog.get_model("llama-3.2-3b")
    assert tied.tie_embeddings
    for model, strategy in ((tied, "fsdp"), (M70, "fsdp")):
        pp = 2 if model is M70 else 1
        hw = catalog.build_hardware(gpu="a100-80g", gpus=8)
        on = plan_memory(model, hw, PURE, fsdp(strategy, pp=pp, wrap_embeddings=True)).gpu
        off = plan_memory(model, hw, PURE, fsdp(strategy, pp=pp)).gpu
        assert on == off, model.name


def test_torchtune_70b_cpu_offload_row_is_planned_with_its_configs_units():
    """torchtune's README (pytorch/torchtune@1814feb): Llama 3.1 70B full fine-tuning on 8 A100s
    with CPU offload, 13.9 GiB a GPU; its config shards the embedding and the output projection
    apart (recipes/configs/llama3_1/70B_full.yaml: custom_sharded_layers). Every unit reshards
    after forward and the loss runs on the output chunks after it, holding nothing gathered; the
    peak is backward's start (nothing resident on the GPU). The units lower it by the root's
    gathered bytes less the head's, 2 bytes × (a layer + the embedding), and by the backward
    buffers: the whole root waits with lm_head's unsharded grad (2·V·H) beside a layer's bf16
    grad and its reduce copy (4 × layer), the head unit's are 4 × (V·H + H): 6 × layer − 4·H in
    all. They bring it nearer the published figure (docs/accuracy.md lists both errors)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import accuracy

    row = next(r for r in accuracy.load_runs() if r["name"] == "llama3.1-70b full a100x8 fsdp cpu-offload b2 seq2048")
    assert row["knobs"]["fsdp"]["wrap_embeddings"] is True
    root = {**row, "knobs": {"fsdp": {"wrap_embeddings": False}}}
    carved, whole = accuracy.compare(row), accuracy.compare(root)
    assert (whole["predicted_allocated_gib"] - carved["predicted_allocated_gib"]) * 2**30 == pytest.approx(
        2 * (LAYER + EMB) + (4 * LAYER + 2 * EMB - 4 * (EMB + H)), abs=0.01 * 2**30)
    assert abs(carved["memory_rel_err"]) < abs(whole["memory_rel_err"])


def _train_refusal(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    demo = Path(__file__).parents[2] / "examples" / "demo.yaml"
    argv = [sys.executable, "-m", "shardwise.cli", "train", str(demo), "--set", f"checkpointing.output_dir={tmp_path}",
            "--set", "strategy.fsdp.wrap_embeddings=true", *(a for s in sets for a in ("--set", s))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_trainer_refuses_carving_a_tied_model_before_any_rank_starts(tmp_path):
    r = _train_refusal(tmp_path, "model.name=tiny-qwen")
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "strategy.fsdp.wrap_embeddings" in out and "ties lm_head" in out, out[-2000:]
    assert not list(tmp_path.glob("**/*.safetensors"))


def test_trainer_refuses_carving_pipeline_stages():
    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec

    cfg = TrainConfig.model_validate({
        "model": {"name": "tiny-llama"}, "data": {"kind": "synthetic"},
        "strategy": {"name": "fsdp", "pp": 2, "fsdp": {"wrap_embeddings": True}},
        "run": {"device": "cpu", "grad_accum": 2}})
    with pytest.raises(ShardwiseError, match=r"strategy.fsdp.wrap_embeddings with strategy.pp 2"):
        run_spec(cfg, 2, "cpu", environ={})
