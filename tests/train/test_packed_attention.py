"""Packed attention without a dense mask ( shardwise.train.model.packed_attention).

The trainer's default packed path on CPU (one SDPA call per document, padding-free [1, T]
batches) allocates no [B, 1, S, S] or T×T tensor in forward and backward, and trains the same
loss and gradients as the dense additive mask (fp32, several documents per row, MHA and GQA);
FlexAttention (forward on CPU: torch 2.13 has no CPU backward for it) agrees too, and a
FlexAttention compile failure falls back with one warning and the plan re-priced.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.config.schema import TrainConfig
from shardwise.data.labels import count_target_tokens
from shardwise.errors import ShardwiseError
from shardwise.run import resolve, run_spec
from shardwise.train.model import packed_attention as pa

TOL = 1e-5
CPU = torch.device("cpu")


def config(model: str = "tiny-llama", packed: str = "auto", **sft) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"name": model}, "precision": "fp32", "run": {"micro_batch": 2, "seed": 3, "device": "cpu", "compile": False},
        "data": {"sft": {"max_length": 512, "packed_attention": packed, **sft}},
    })


def built(cfg: TrainConfig, device: str = "cpu", mode: TorchDispatchMode | None = None):
    """(run, model, one micro-batch) as the trainer builds them: the two rows with most documents,
    collated under `mode`."""
    from contextlib import nullcontext

    from shardwise.train.model.build import build_model
    from shardwise.train.sft_data import build_sft_split

    run = run_spec(cfg, 1, device)
    ds, collate = build_sft_split(run, "train")
    rows = sorted(range(len(ds)), key=lambda i: (-len(ds[i]["seq_lens"]), i))[:2]
    model = build_model(run)
    with mode or nullcontext():
        return run, model, collate([ds[i] for i in rows])


@pytest.fixture(autouse=True)
def _fresh_state():
    pa._STATE.update(fallback=False, warned=False, run=None)
    yield
    pa._STATE.update(fallback=False, warned=False, run=None)


def loss_and_grads(run, model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss contract's mean loss (token-loss sum / target tokens) and its gradients."""
    from shardwise.train.engines.base import forward_loss_sum

    model.zero_grad()
    loss = forward_loss_sum(model, model, batch, CPU, run.train) / count_target_tokens(batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


class Shapes(TorchDispatchMode):
    """The shape of every tensor any op returns (forward and backward, autograd included)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def square(shapes, n: int) -> list:
    """Outputs with two dimensions of the row's length: an [.., n, n] mask or score matrix."""
    return [(f, s) for f, s in shapes if sum(d == n for d in s) >= 2]


def test_cpu_default_runs_one_sdpa_call_per_document_on_a_padding_free_batch():
    run, model, batch = built(config())
    assert run.train.packed_attention == "sdpa_varlen"
    assert model.config._attn_implementation == pa.SDPA_VARLEN
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    assert len(batch["cu_seq_lens_q"]) - 1 >= 8  # several documents in each of the two rows


def test_default_packed_path_allocates_no_dense_mask():
    """Every op's output from collation through forward and backward: none is [.., T, T] (T the
    micro-batch's tokens, the row length of the dense layout being at most T), none holds T²
    elements outside the vocabulary's [T, V] (logits, their gradient)."""
    seen = Shapes()
    run, model, batch = built(config(), mode=seen)
    t = batch["input_ids"].shape[1]
    with seen:
        loss_and_grads(run, model, batch)
    assert len(seen.shapes) > 500  # the forward and the backward were watched
    assert square(seen.shapes, t) == [] and square(seen.shapes, 512) == []
    vocab = model.config.vocab_size
    assert max(s[-1] * s[-2] for _, s in seen.shapes if len(s) >= 2 and vocab not in s) < t * t
    # control: the same watch sees the dense fallback's [B, 1, S, S] mask
    dense = Shapes()
    drun, dmodel, dbatch = built(config(packed="dense"), mode=dense)
    with dense:
        loss_and_grads(drun, dmodel, dbatch)
    s = dbatch["input_ids"].shape[1]
    assert (2, 1, s, s) in [sh for _, sh in square(dense.shapes, s)]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen"])  # MHA; GQA with tied embeddings and qkv bias
def test_losses_and_gradients_equal_the_dense_mask_reference(model):
    run, m, batch = built(config(model))
    drun, d, dbatch = built(config(model, packed="dense"))
    d.load_state_dict(m.state_dict())
    assert count_target_tokens(batch) == count_target_tokens(dbatch)  # the same targets: the loss contract
    loss, grads = loss_and_grads(run, m, batch)
    ref, ref_grads = loss_and_grads(drun, d, dbatch)
    assert abs(loss - ref) <= TOL * abs(ref), (loss, ref)
    worst = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
    assert worst <= TOL, worst
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 100 * TOL  # not vacuous


def test_sliding_window_layers_keep_their_window_per_document():
    """Mistral-style layers: a document longer than the window attends within it, as the model
    attends to that document alone."""
    from transformers import MistralConfig, MistralForCausalLM

    pa.register()
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, sliding_window=8, use_cache=False)
    torch.manual_seed(0)
    packed = MistralForCausalLM(MistralConfig(**cfg, attn_implementation=pa.SDPA_VARLEN)).eval()
    alone = MistralForCausalLM(MistralConfig(**cfg, attn_implementation="sdpa")).eval()
    alone.load_state_dict(packed.state_dict())
    lens = [20, 5, 13]
    ids = torch.randint(0, 97, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 20, 25, 38], dtype=torch.int32)
    with torch.no_grad():
        got = packed(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu).logits
        want = torch.cat([alone(input_ids=ids[:, a:b]).logits for a, b in ((0, 20), (20, 25), (25, 38))], 1)
        unwindowed = MistralForCausalLM(MistralConfig(**cfg | {"sliding_window": None},
                                                      attn_implementation="sdpa")).eval()
        unwindowed.load_state_dict(packed.state_dict())
        wide = unwindowed(input_ids=ids[:, :20]).logits
    assert float((got - want).abs().max()) <= TOL
    assert float((wide - want[:, :20]).abs().max()) > 1e-3  # the window did matter


def test_flex_attention_forward_equals_the_dense_mask_on_cpu():
    """transformers' FlexAttention with the document BlockMask built from the position ids,
    compiled (inductor's CPU kernel, forward only on CPU): the dense loss within 1e-5."""
    from shardwise.train.engines.base import forward_loss_sum

    run, m, batch = built(config(), device="cuda")  # planned for CUDA, built on this CPU
    assert run.train.packed_attention == "flex" and m.config._attn_implementation == pa.FLEX
    drun, d, dbatch = built(config(packed="dense"))
    d.load_state_dict(m.state_dict())
    with torch.no_grad():
        loss = forward_loss_sum(m, m, batch, CPU, run.train) / count_target_tokens(batch)
        ref = forward_loss_sum(d, d, dbatch, CPU, drun.train) / count_target_tokens(dbatch)
    assert not pa._STATE["fallback"]
    assert abs(float(loss) - float(ref)) <= TOL * float(ref)


BACKEND = "shardwise_test_failing_flex_backend"


def _failing_backend(gm, example_inputs):
    raise RuntimeError("inductor cannot build the flex kernel here (a stand-in for a broken toolchain)")


def test_a_flex_compile_failure_falls_back_with_one_warning(monkeypatch, capfd):
    """Item 7: the BlockMask's compile fails; FlexAttention falls back to one SDPA call per
    document (no dense mask either) for the rest of the run: the same loss and gradients as
    that path, one warning naming the error and the plan re-priced, and no crash."""
    import transformers.masking_utils as mu
    from torch._dynamo import list_backends, register_backend

    if BACKEND not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=_failing_backend, name=BACKEND)
    raw = mu.create_block_mask
    monkeypatch.setattr(mu, "create_block_mask",
                        lambda *a, **k: torch.compile(raw, backend=BACKEND)(*a, **k | {"_compile": False}))
    torch._dynamo.reset()
    run, m, batch = built(config(), device="cuda")
    vrun, v, vbatch = built(config(packed="varlen"))
    v.load_state_dict(m.state_dict())
    capfd.readouterr()
    first = loss_and_grads(run, m, batch)
    second = loss_and_grads(run, m, batch)  # later steps: straight to the fallback
    err = capfd.readouterr().err
    ref = loss_and_grads(vrun, v, vbatch)
    for got in (first, second):
        assert got[0] == ref[0] and all(torch.equal(got[1][n], g) for n, g in ref[1].items())
    assert err.count("FlexAttention failed") == 1, err
    assert "BackendCompilerFailed" in err and "inductor cannot build the flex kernel" in err
    assert "re-planned with one SDPA call per document:" in err and "(FlexAttention:" in err


def test_flex_attention_compile_failure_in_the_kernel_falls_back(monkeypatch, capfd):
    """The BlockMask compiles but flex_attention's compile fails (forward: CPU has no flex
    backward): the evaluation's loss is sdpa_varlen's."""
    import transformers.integrations.flex_attention as fa
    from torch.nn.attention.flex_attention import flex_attention

    from shardwise.train.engines.base import forward_loss_sum

    if BACKEND not in list(torch._dynamo.list_backends(exclude_tags=())):
        torch._dynamo.register_backend(compiler_fn=_failing_backend, name=BACKEND)
    monkeypatch.setattr(fa, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: torch.compile(flex_attention, backend=BACKEND)(q, k, v,
                                                                                                            **kw))
    torch._dynamo.reset()
    run, m, batch = built(config(), device="cuda")
    vrun, v, vbatch = built(config(packed="varlen"))
    v.load_state_dict(m.state_dict())
    with torch.no_grad():
        got = forward_loss_sum(m, m, batch, CPU, run.train)
        ref = forward_loss_sum(v, v, vbatch, CPU, vrun.train)
    assert torch.equal(got, ref)
    assert capfd.readouterr().err.count("FlexAttention failed while compiling flex_attention") == 1


@pytest.mark.parametrize(("choice", "device", "attention", "family", "precision", "flash", "runs"), [
    ("auto", "cpu", "sdpa", "llama", "bf16-mixed", False, "sdpa_varlen"),
    ("auto", "cuda", "sdpa", "llama", "bf16-mixed", False, "flex"),
    ("auto", "cuda", "sdpa", "llama", "bf16-mixed", True, "flash_varlen"),
    ("auto", "cuda", "sdpa", "llama", "fp32", True, "flex"),  # flash-attn has no fp32 kernel
    ("auto", "cuda", "sdpa", "gpt2", "bf16-mixed", False, "sdpa_varlen"),  # no flex path in transformers
    ("auto", "cuda", "eager", "llama", "bf16-mixed", True, "dense"),
    ("auto", "cuda", "sdpa", "gemma2", "bf16-mixed", True, "dense"),  # runs eager (softcapping)
    ("varlen", "cuda", "sdpa", "llama", "bf16-mixed", False, "sdpa_varlen"),
    ("varlen", "cpu", "sdpa", "qwen2", "fp32", False, "sdpa_varlen"),
    ("flex", "cuda", "sdpa", "qwen2", "fp32", True, "flex"),
    ("dense", "cpu", "sdpa", "llama", "fp32", False, "dense"),
])
def test_resolve(choice, device, attention, family, precision, flash, runs):
    assert resolve.packed_attention(choice, data_kind="sft", device=device, attention=attention, family=family,
                      precision=precision, flash_attn=flash) == runs
    assert resolve.packed_attention(choice, data_kind="synthetic", device=device, attention=attention, family=family,
                      precision=precision, flash_attn=flash) == "none"


@pytest.mark.parametrize(("choice", "device", "attention", "family", "says"), [
    ("flex", "cpu", "sdpa", "llama", "no backward on cpu"),
    ("flex", "cuda", "sdpa", "gpt2", "no FlexAttention path for gpt2"),
    ("varlen", "cuda", "eager", "llama", "model.attention is 'eager'"),
    ("flex", "cuda", "sdpa", "mpt", "mpt runs eager attention"),
])
def test_resolve_refuses_what_cannot_run(choice, device, attention, family, says):
    with pytest.raises(ShardwiseError, match=r"data\.sft\.packed_attention") as e:
        resolve.packed_attention(choice, data_kind="sft", device=device, attention=attention, family=family, precision="fp32",
                   flash_attn=False)
    assert says in str(e.value)


def test_the_family_lists_match_the_installed_transformers():
    from shardwise.specs.families import ANALYTIC_FAMILIES
    from shardwise.train.model.hf import causal_lm_class

    for family in ANALYTIC_FAMILIES:
        cls = causal_lm_class(family)
        if cls is None:
            continue
        assert (family in resolve.NO_FLEX) == (not cls._supports_flex_attn), family
        assert cls._supports_attention_backend or family in resolve.NO_SDPA, family


def test_dense_is_noted_with_its_cost_and_the_planned_value_round_trips():
    from shardwise.run import to_config
    from shardwise.train.model.build import attention_note

    run = run_spec(config(packed="dense"), 1, "cpu")
    note = attention_note(run)
    assert "dense [B, 1, S, S] mask (asked for)" in note and f"{2 * 512 * 512 * 4 / 2**20:,.0f} MiB" in note
    assert attention_note(run_spec(config(), 1, "cpu")) is None
    for cfg, device in ((config(packed="dense"), "cpu"), (config(packed="varlen"), "cuda"), (config(), "cuda")):
        r = run_spec(cfg, 1, device)
        back, _ = to_config(r.model, r.hardware, r.train, r.strategy, device=device)
        assert run_spec(back, 1, device).train.packed_attention == r.train.packed_attention


@pytest.mark.parametrize(("kind", "model_type", "need"), [("sdpa_varlen", "mpt", "_supports_attention_backend"),
                                                          ("flex", "gpt2", "_supports_flex_attn")])
def test_a_class_that_cannot_take_the_packed_attention_is_refused(kind, model_type, need):
    """A meta-path architecture (family hf, its class read from transformers) whose class lacks
    the attention backend: refused at preflight naming the field, not failed in the build."""
    from types import SimpleNamespace as NS

    run = NS(config=NS(source="run.yaml", data=NS(sft=NS(packed_attention="auto"))),
             train=NS(packed_attention=kind), model=NS(inventory=NS(model_type=model_type)))
    with pytest.raises(ShardwiseError, match=r"run\.yaml: data\.sft\.packed_attention 'auto'") as e:
        pa.note(run)
    assert need in str(e.value) and "set data.sft.packed_attention: dense" in str(e.value)
