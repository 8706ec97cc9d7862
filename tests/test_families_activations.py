"""Activation-model facts that the measured totals (tests/test_measured_memory.py) do not pin
down on their own: the matmul order torchtitan's selective policy counts, per family, as the
real transformers layer dispatches it; the layer kinds of MoE models; sequence parallelism."""

from __future__ import annotations

import pytest

from shardwise import catalog
from shardwise.plan.activations import (
    activation_bytes,
    final_norm_saved,
    layer_saved_per_token,
    mm_order,
    recompute_bytes,
    selective_saved_per_token,
)
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
    from shardwise.plan.activations import selective_replayed_params

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
    """DeepSeek-V3: 3 dense layers, 58 MoE layers; the plan sums each kind, and a pipeline's
    worst stage is the one with the most MoE layers."""
    m = catalog.get_model("deepseek-v3")
    train = TrainSpec(seq_len=1024)
    dense = layer_saved_per_token(m, train, moe=False)
    moe = layer_saved_per_token(m, train, moe=True)
    assert moe > dense
    final = final_norm_saved(m, train)
    assert activation_bytes(m, train) == pytest.approx(1024 * (3 * dense + 58 * moe + final))
    # pp 2: stages of 31 and 30 layers (3 dense + 28 MoE, 30 MoE); the larger, 2 micro-batches in flight
    worst = max(3 * dense + 28 * moe, 30 * moe)
    assert activation_bytes(m, train, pp=2) == pytest.approx(2 * 1024 * (worst + final))


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe",
                                   "tiny-gemma", "tiny-phi3", "tiny-olmo2", "tiny-deepseek-v3", "tiny-mixtral"])
def test_mm_order_is_what_the_layer_dispatches(shape: str) -> None:
    """The aten.mm calls of the last decoder layer (a MoE layer where there are any), in order,
    have the output widths `mm_order` lists: biased linears (addmm) and fused experts
    (grouped_mm) are not among them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.bench import saved

    torch.set_num_threads(1)
    model = saved.build_model(shape, 2, "fp32", "sdpa", "none")
    layer = model.model.layers[-1]
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
