"""Context parallelism (`plan --cp`): each sequence split over cp GPUs of the data-parallel group.
Expected figures are derived here by hand from Llama 3.1 8B's config (hidden 4096, 32 layers, 32
query heads and 8 K/V heads of 128) and from what each implementation moves (plan/context.py's
sources: torch 2.13 `_context_parallel/_attention.py`, Megatron-Core's p2p ring, ring-flash-attn's
llama3 varlen, DeepSpeed Ulysses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.errors import ShardwiseError
from shardwise.plan.evaluate import evaluate
from shardwise.plan.planner import build_specs
from shardwise.specs import Strategy

H, Q, KV, LAYERS = 4096, 4096, 1024, 32
BF16 = 2


def _eval(strategy: str = "fsdp", seq: int = 65536, cp: int = 2, gpus: int = 8, **kw):
    knobs = {k: kw.pop(k) for k in ("cp_impl", "cp_load_balance") if k in kw}
    m, hw, t = build_specs(model="llama-3.1-8b", gpu="h100-sxm", gpus=gpus, seq_len=seq, micro_batch=1,
                           precision="bf16-mixed", checkpointing=kw.pop("checkpointing", "full"),
                           packed_attention=kw.pop("packed_attention", "none"), **kw)
    fsdp = {"reduce_every_micro_batch": True} if strategy.startswith("fsdp") else {}
    s = Strategy.from_name(strategy, cp=cp, **knobs, **({"fsdp": fsdp} if fsdp else {}))
    return evaluate(m, hw, t, s)


def test_a_cp_rank_runs_its_layers_on_a_seq_over_cp_sequence():
    """Everything but attention sees seq/cp tokens: the saved activations and the logits at seq
    65,536 over cp 2 are those of seq 32,768 without CP, and so is each GPU's share of the tokens."""
    cp2, whole = _eval(seq=65536, cp=2), _eval(seq=32768, cp=1)
    assert cp2.memory.gpu.activations == whole.memory.gpu.activations
    assert cp2.memory.gpu.logits == whole.memory.gpu.logits
    # model states are sharded over all 8 data-parallel ranks, cp ranks included
    assert cp2.memory.layout.dp_shard == 8 and cp2.memory.gpu.params == whole.memory.gpu.params
    assert cp2.memory.layout.batch_ranks == 4


def test_each_rank_attends_over_the_whole_sequence():
    """A rank's queries see all 65,536 keys: its attention FLOPs are 1/cp of the whole causal
    sequence's, twice those of a 32,768-token sequence of its own (3·L·s·(q+o) per token, linear in s)."""
    cp2, whole = _eval(seq=65536, cp=2), _eval(seq=32768, cp=1)
    assert cp2.time.attention_s == pytest.approx(2 * whole.time.attention_s, rel=1e-12)
    assert cp2.time.gemm_s == pytest.approx(whole.time.gemm_s, rel=1e-12)


def test_torch_sdpa_all_gathers_expanded_kv_and_passes_fp32_gradients():
    """torch's ring over SDPA: forward all-gathers the other rank's K and V, expanded to the 32 query
    heads (torchtitan repeats K/V before SDPA): (cp−1)·32,768 tokens·(4096+4096)·2 bytes; backward
    gathers them again and permutes dK/dV in fp32 at each of its cp iterations: + cp·32,768·8192·4.
    Full checkpointing replays the forward (a second gather), per layer, 32 layers."""
    local = 65536 // 2
    fwd = 1 * local * (Q + Q) * BF16
    bwd = fwd + 2 * local * (Q + Q) * 4
    e = _eval(seq=65536, cp=2, cp_impl="torch")
    assert e.comm.context == LAYERS * (2 * fwd + bwd)
    assert e.comm.context_calls == LAYERS * (2 * 1 + (1 + 2))


def test_ring_allgather_and_ulysses_move_what_their_kernels_move():
    local = 65536 // 4
    kv = local * (KV + KV) * BF16  # grouped K/V: 8 heads of 128 each
    ring = _eval(seq=65536, cp=4, cp_impl="ring", checkpointing="none")
    assert ring.comm.context == LAYERS * (3 * kv + 2 * 3 * kv)  # cp−1 sends forward; K/V and dK/dV backward
    gather = _eval(seq=65536, cp=4, cp_impl="allgather", checkpointing="none")
    assert gather.comm.context == LAYERS * (3 * kv + 2 * 3 * kv)  # gathered again in backward, grads reduce-scattered
    assert gather.comm.context_calls == LAYERS * (8 + 16)  # one gather per K/V head; gather + reduce-scatter back
    uly = _eval("zero3", seq=65536, cp=4, checkpointing="none")  # DeepSpeed's own: Ulysses
    a2a = 3 / 4 * local * (Q + KV + KV + Q) * BF16  # q, k, v in; out back; (cp−1)/cp of each leaves
    assert uly.memory.strategy.cp_scheme == "ulysses"
    assert uly.comm.context == pytest.approx(LAYERS * 2 * a2a, rel=1e-12)


def test_flex_over_packed_documents_gathers_grouped_kv_and_keeps_it_for_backward():
    """torch's CP over FlexAttention: K/V all-gathered whole (grouped: 8 heads), gradients
    reduce-scattered; the gathered K/V are the kernel's saved inputs: without checkpointing every
    layer keeps the other rank's (cp−1)·32,768·2048·2 bytes beside its own."""
    local = 65536 // 2
    extra = 1 * local * (KV + KV) * BF16
    flex = _eval(seq=65536, cp=2, packed_attention="flex", checkpointing="none")
    sdpa_rows = _eval(seq=65536, cp=2, packed_attention="none", checkpointing="none")
    assert flex.comm.context == LAYERS * (extra + extra)
    # the same layers otherwise (flex's saved tensors are SDPA's where no mask is held): what
    # the other rank's K/V adds, 32 layers
    delta = flex.memory.gpu.activations - sdpa_rows.memory.gpu.activations
    assert delta >= LAYERS * extra


def test_consecutive_chunks_leave_the_last_rank_the_most_attention():
    """axolotl cuts each row into cp consecutive chunks: the last rank's queries attend over all cp
    chunks, the mean over (cp+1)/2, so its attention is (2·cp−1)/cp of the balanced one: 7/4 at cp 4."""
    balanced = _eval(seq=65536, cp=4, cp_impl="ring")
    skewed = _eval(seq=65536, cp=4, cp_impl="ring", cp_load_balance=False)
    assert skewed.time.attention_s == pytest.approx(7 / 4 * balanced.time.attention_s, rel=1e-12)


@pytest.mark.parametrize("kw, words", [
    ({"seq": 65538, "cp": 2}, "does not split into 4 equal chunks"),
    ({"cp": 2, "attention": "eager"}, "eager attention"),
    ({"cp": 2, "packed_attention": "dense"}, "dense [S, S] mask"),
    ({"cp": 2, "packed_attention": "flash_varlen", "attention": "flash"}, "packed_attention flex"),
    ({"cp": 3}, "cp 3 × tp 1 × pp 1 = 3 does not divide the 8 GPUs"),
])
def test_what_context_parallelism_refuses(kw, words):
    with pytest.raises(ShardwiseError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _eval(**kw)


def test_strategy_refusals():
    with pytest.raises(ShardwiseError, match="cp_impl 'torch' with strategy 'zero2'"):
        Strategy.from_name("zero2", cp=2, cp_impl="torch")
    assert Strategy.from_name("zero2", cp=2).cp_scheme == "ulysses"
    assert Strategy.from_name("fsdp", cp=2).cp_scheme == "torch"
    assert not Strategy.from_name("fsdp", cp=2).trainable  # planned only


def test_the_trainer_refuses_cp_before_any_rank_starts(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {name: tiny-llama}\nstrategy: {name: fsdp, cp: 2}\nrun: {nproc: 2, device: cpu}\n")
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "strategy.cp 2: context parallelism is planned only" in " ".join((r.stdout + r.stderr).split())


def test_plan_cp_as_the_user_runs_it():
    """`shardwise plan --cp 2` as a subprocess: every row and the recommendation keep to cp 2."""
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--model", "llama-3.1-8b", "--gpus", "8",
                        "--gpu", "h100-sxm", "--seq-len", "65536", "--micro-batch", "1", "--checkpointing", "full",
                        "--cp", "2", "-s", "fsdp", "-s", "zero3", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(s["name"], s["cp"], s["cp_impl"]) for s in doc["strategies"]] == [("fsdp", 2, "torch"),
                                                                               ("zero3", 2, "ulysses")]
    assert doc["recommended_setting"]["cp"] == 2


def test_plan_from_shardwise_yaml_reads_cp(tmp_path):
    """The trainer refuses strategy.cp > 1; `plan CONFIG` plans the rest as the trainer would and
    the context parallelism as --cp, as a subprocess."""
    cfg = tmp_path / "long.yaml"
    cfg.write_text("model:\n  name: llama-3.1-8b\nstrategy:\n  name: fsdp\n  cp: 2\n  cp_impl: ring\n")
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", str(cfg), "--gpus", "8", "--gpu", "h100-sxm",
                        "--seq-len", "32768", "--json"], capture_output=True, text=True)
    assert r.returncode in (0, 3), r.stderr + r.stdout
    doc = json.loads(r.stdout)
    assert [(s["cp"], s["cp_impl"]) for s in doc["strategies"]] == [(2, "ring")]
    assert any(x["key"] == "strategy.cp" and x["as"].startswith("--cp 2 --cp-impl ring") for x in doc["from"]["read"])
