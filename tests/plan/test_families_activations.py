"""Activation-model facts that the measured totals (tests/accuracy/test_measured_memory.py) do not pin
down on their own: the matmul order torchtitan's selective policy counts, per family, as the
real transformers layer dispatches it; the layer kinds of MoE models; sequence parallelism."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.plan.activations import (
    activation_bytes,
    final_norm_saved,
    layer_saved_per_token,
    recompute_bytes,
    selective_saved_per_token,
)
from shardwise.plan.selective import mm_order
from shardwise.specs import ModelSpec, TrainSpec


def test_sequence_parallel_splits_what_tp_alone_replicates() -> None:
    """Korthikanti et al. 2022: sbh(10 + 24/t + 5as/(ht)) per layer under TP, sbh(34 + 5as/h)/t
    with sequence parallelism. For a dense Llama with SDPA every saved tensor is split by t
    under SP; without SP the norms and residual inputs (the "10") stay whole."""
    m = catalog.get_model("llama-2-7b")
    t, tokens = 8, 4096
    sp = TrainSpec(seq_len=tokens, sequence_parallel=True)
    no_sp = sp.model_copy(update={"sequence_parallel": False})
    one = activation_bytes(m, sp, tp=1)
    assert activation_bytes(m, sp, tp=t) == pytest.approx(one / t)
    norms = layer_saved_per_token(m, no_sp, tp=t) - layer_saved_per_token(m, sp, tp=t)
    assert norms == pytest.approx((1 - 1 / t) * 2 * ((4 + 2 * 2) * m.hidden_size + 4))  # two RMSNorms
    replicated = (1 - 1 / t) * tokens * (m.num_layers * 2 * ((4 + 2 * 2) * m.hidden_size + 4)
                                         + final_norm_saved(m, no_sp))
    assert activation_bytes(m, no_sp, tp=t) - activation_bytes(m, sp, tp=t) == pytest.approx(replicated)
    # full checkpointing keeps each layer's (sequence-sharded) input
    full = sp.model_copy(update={"checkpointing": "full"})
    assert activation_bytes(m, full, tp=t) == pytest.approx(activation_bytes(m, full, tp=1) / t)
    # no effect at tp 1
    assert activation_bytes(m, no_sp) == one


def test_selective_keeps_every_other_matmul() -> None:
    """Llama: q(1) k(2) v(3) o(4) gate(5) up(6) down(7): q, v, gate and down outputs are kept,
    with SDPA's output and logsumexp and the layer input."""
    m = catalog.get_model("llama-2-7b")
    train = TrainSpec(checkpointing="selective")
    h, i, c = m.hidden_size, m.intermediate_size, 2
    kept = c * (m.q_dim + m.kv_dim + i + h) + c * m.q_dim + 4 * m.num_heads + c * h
    assert selective_saved_per_token(m, train) == kept
    assert [name for name, *_ in mm_order(m)] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]
    # none >= selective >= full, and the replayed layer is bounded by the full one
    none, full = train.model_copy(update={"checkpointing": "none"}), train.model_copy(update={"checkpointing": "full"})
    acts = [activation_bytes(m, t) for t in (none, train, full)]
    assert acts[0] > acts[1] > acts[2]
    assert recompute_bytes(m, train) <= recompute_bytes(m, full)


def test_selective_replays_the_other_matmuls() -> None:
    """FLOPs side of the same policy: Llama replays k, o and up; Qwen2 (biased q/k/v run addmm,
    not in the save list) keeps o and up and replays q, k, v, gate and down; Mixtral replays its
    routed experts (grouped_mm) and keeps q, v and the router."""
    from shardwise.plan.selective import selective_replayed_params

    m = catalog.get_model("llama-2-7b")
    h, i = m.hidden_size, m.intermediate_size
    assert selective_replayed_params(m) == h * m.kv_dim + m.q_dim * h + h * i
    q = catalog.get_model("qwen2.5-7b")
    h, i = q.hidden_size, q.intermediate_size
    assert selective_replayed_params(q) == h * (q.q_dim + 2 * q.kv_dim) + 2 * h * i
    x = catalog.get_model("mixtral-8x7b")
    h, i = x.hidden_size, x.intermediate_size
    assert selective_replayed_params(x) == h * x.kv_dim + x.q_dim * h + x.experts_per_token * 3 * i * h


def test_mixed_layers_are_summed_per_kind() -> None:
    """DeepSeek-V3: 3 dense layers, 58 MoE layers; the plan sums each kind, and a pipeline rank
    holds its own layers' (the final norm on the last stage's rank) for each micro-batch 1F1B
    keeps in flight there: min(grad_accum, pp − r)."""
    m = catalog.get_model("deepseek-v3")
    train = TrainSpec(seq_len=1024)
    dense = layer_saved_per_token(m, train, moe=False)
    moe = layer_saved_per_token(m, train, moe=True)
    assert moe > dense
    final = final_norm_saved(m, train)
    assert activation_bytes(m, train) == pytest.approx(1024 * (3 * dense + 58 * moe + final))
    # pp 2: stages of 31 and 30 layers (3 dense + 28 MoE; 30 MoE and the final norm)
    first, last = 3 * dense + 28 * moe, 30 * moe + final
    # grad_accum 1: one micro-batch in flight on either rank
    assert activation_bytes(m, train, pp=2) == pytest.approx(1024 * max(first, last))
    # grad_accum 4: two on rank 0, one on rank 1
    four = train.model_copy(update={"grad_accum": 4})
    assert activation_bytes(m, four, pp=2) == pytest.approx(1024 * max(2 * first, last))
    # GPipe: all four on both
    assert activation_bytes(m, four, pp=2, schedule="gpipe") == pytest.approx(4 * 1024 * max(first, last))


def _gpt(family: str = "mpt", **over) -> ModelSpec:
    cfg = {"mpt": dict(model_type="mpt", d_model=4096, n_heads=32, n_layers=32, vocab_size=50368),
           "gpt2": dict(model_type="gpt2", n_embd=4096, n_head=32, n_layer=32, vocab_size=51200,
                        activation_function="gelu")}[family]
    return ModelSpec.from_hf_dict({**cfg, **over})


@pytest.mark.parametrize("family", ["mpt", "gpt2"])
def test_gpt_block_is_korthikanti_without_dropout(family: str) -> None:
    """Korthikanti et al. 2022 (Table 2) count 34·sbh + 5·as²b per GPT layer in 16-bit: LayerNorm
    inputs 4, QKV input 2, Q and K 4, V 2, attention output 2, fc1 input 2, GeLU input 8, fc2
    input 8, and three dropout masks (2 of them sbh-wide) plus the s² scores, softmax and its
    mask. With the fused kernel (sdpa/flash) and no dropout the planner derives exactly
    32·sbh, plus LayerNorm's fp32 mean/rstd (2 × 8 bytes) and the fp32 logsumexp (4·a) per
    token — no s² term."""
    m = _gpt(family)
    h, a, s = m.hidden_size, m.num_heads, 2048
    train = TrainSpec(seq_len=s, attention="flash")
    assert layer_saved_per_token(m, train) == 32 * h + 16 + 4 * a
    assert layer_saved_per_token(m, train.model_copy(update={"attention": "sdpa"})) == 32 * h + 16 + 4 * a
    # eager: q, k, v copies (6h) and the output copy (2h) replace the kernel's q/k/v + output
    # (8h) and logsumexp; MPT saves the fp32 softmax and its bf16 cast (6·a·s), GPT-2 the bf16 softmax
    eager = layer_saved_per_token(m, train.model_copy(update={"attention": "eager"}))
    assert eager - (32 * h + 16 + 4 * a) == (6 if family == "mpt" else 2) * a * s - 4 * a
    # full checkpointing keeps the layer input; sequence parallelism splits the LayerNorms
    full = train.model_copy(update={"checkpointing": "full"})
    assert activation_bytes(m, full) == s * (m.num_layers * 2 * h + final_norm_saved(m, full))
    assert final_norm_saved(m, train) == 2 * h + 8 + 2 * h
    sp = train.model_copy(update={"sequence_parallel": True})
    assert activation_bytes(m, sp, tp=8) == pytest.approx(activation_bytes(m, sp) / 8)


def test_gpt_block_against_the_llama_mapping() -> None:
    """The published MPT/GPT runs were mapped to a Llama shape (SwiGLU, I = 8h/3, RMSNorm): the
    GPT block saves 32·sbh where that mapping saved ~45·sbh (RMSNorm's fp32 upcasts, SwiGLU's
    four I-wide tensors)."""
    m = _gpt("mpt")
    h = m.hidden_size
    llama = ModelSpec.from_hf_dict({"model_type": "llama", "hidden_size": h, "num_hidden_layers": 32,
                                    "num_attention_heads": 32, "intermediate_size": round(8 * h / 3),
                                    "vocab_size": 50368})
    train = TrainSpec(seq_len=2048)
    ratio = layer_saved_per_token(llama, train) / layer_saved_per_token(m, train)
    assert 1.35 < ratio < 1.45


def test_gpt_selective_and_activation_variants() -> None:
    """torchtitan's selective policy keeps every other aten.mm: MPT without biases runs
    Wqkv, out_proj, up_proj, down_proj as mm (Wqkv and up_proj kept); with llm-foundry's biases,
    and GPT-2 always, every linear runs addmm (nothing kept, every matmul replayed). The
    activation's saved tensors follow `GPT_ACT_SAVED` (gelu_new: 5 I-wide tensors)."""
    from shardwise.plan.activations import GPT_ACT_SAVED, mlp_saved
    from shardwise.plan.selective import selective_replayed_params
    from shardwise.specs.families import GPT_ACTIVATIONS

    m = _gpt("mpt")
    h, i, c = m.hidden_size, m.intermediate_size, 2
    assert [n for n, *_ in mm_order(m)] == ["attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj"]
    train = TrainSpec(seq_len=2048, checkpointing="selective")
    assert selective_saved_per_token(m, train) == c * (3 * h + i) + c * h + 4 * m.num_heads + c * h
    assert selective_replayed_params(m) == h * h + i * h
    for biased in (_gpt("mpt", no_bias=False), _gpt("gpt2")):
        assert mm_order(biased) == []
        assert selective_replayed_params(biased) == 12 * h * h
        assert selective_saved_per_token(biased, train) == c * h + 4 * m.num_heads + c * h
    assert set(GPT_ACT_SAVED) == set(GPT_ACTIVATIONS)
    new = _gpt("gpt2", activation_function="gelu_new")
    assert mlp_saved(new, train, 1) == 5 * c * i and mlp_saved(_gpt("gpt2"), train, 1) == 2 * c * i


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("shape,act,prec,attn", [
    ("tiny-mpt", "gelu", "bf16", "eager"), ("tiny-mpt", "gelu", "fp32", "eager"),
    ("tiny-gpt2", "gelu", "bf16", "sdpa"), ("tiny-gpt2", "gelu", "bf16", "eager"),
    ("tiny-gpt2", "gelu", "fp32", "eager"), ("tiny-gpt2", "gelu_new", "bf16", "sdpa"),
])
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_gpt_block_per_layer_matches_measurement(shape: str, act: str, prec: str, attn: str, ckpt: str,
                                                 monkeypatch) -> None:
    """One decoder layer's saved-for-backward bytes (difference of 4- and 2-layer models, so the
    embeddings, final norm and masks cancel) against `layer_saved_per_token`: within 0.25%
    (CPU keeps LayerNorm's mean/rstd in bf16, 8 bytes per token under the plan's fp32), and
    exactly the layer input with full checkpointing. HF's MPT runs eager only."""
    from shardwise.bench import saved

    torch.set_num_threads(1)
    cfg = dict(saved.SHAPES[shape])
    if act != cfg.get("activation_function", act):
        cfg["activation_function"] = act
        monkeypatch.setitem(saved.SHAPES, shape, cfg)
    measured = saved.measure_case(shape, prec, attn, ckpt)["per_layer"]
    spec = ModelSpec.from_hf_dict({**cfg, "num_hidden_layers": 4})
    train = TrainSpec(precision="fp32" if prec == "fp32" else "bf16-mixed", seq_len=saved.SEQ,
                      micro_batch=saved.BATCH, attention=attn, checkpointing=ckpt)
    per_token = layer_saved_per_token(spec, train) if ckpt == "none" else train.compute_bytes * spec.hidden_size
    planned = per_token * saved.SEQ * saved.BATCH
    assert abs(planned / measured - 1) <= 0.0025, (planned, measured)


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe",
                                   "tiny-gemma", "tiny-phi3", "tiny-olmo2", "tiny-deepseek-v3", "tiny-mixtral",
                                   "tiny-mpt", "tiny-gpt2"])
def test_mm_order_is_what_the_layer_dispatches(shape: str) -> None:
    """The aten.mm calls of the last decoder layer (a MoE layer where there are any), in order,
    have the output widths `mm_order` lists: biased linears (addmm) and fused experts
    (grouped_mm) are not among them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.bench import saved
    from shardwise.specs.hf_meta import decoder_layers

    torch.set_num_threads(1)
    model = saved.build_model(shape, 2, "fp32", saved.attentions(shape)[0], "none")
    layer = decoder_layers(model)[-1]
    seen: list[int] = []
    inside = [False]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if inside[0] and func == torch.ops.aten.mm.default:
                seen.append(out.shape[-1])
            return out

    with torch.no_grad(), Record():
        model(**saved.make_batch(saved.SHAPES[shape]["vocab_size"], seq=16, batch=1))
    spec = ModelSpec.from_hf_dict({**saved.SHAPES[shape], "num_hidden_layers": 2})
    assert seen == [int(width) for _, width, _, _ in mm_order(spec, moe=spec.moe_layers[-1])]


def test_gpt_activation_table_is_what_autograd_saves() -> None:
    """`GPT_ACT_SAVED`: I-wide tensors saved by transformers' ACT2FN activation and the linear
    after it (fc2 saves its input), counted by storage through saved-tensor hooks."""
    from transformers.activations import ACT2FN

    from shardwise.bench.census import storage_key
    from shardwise.plan.activations import GPT_ACT_SAVED

    fc2 = torch.nn.Linear(64, 8).to(torch.bfloat16)
    skip = {storage_key(p)[0] for p in fc2.parameters()}
    for name, want in GPT_ACT_SAVED.items():
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True) * 1.0  # a non-leaf input
        seen: dict[int, int] = {}

        def pack(t, seen=seen):
            k = storage_key(t)
            if k and k[0] not in skip:
                seen[k[0]] = max(seen.get(k[0], 0), k[1])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fc2(ACT2FN[name](x))
        assert sum(seen.values()) == want * x.numel() * 2, name
