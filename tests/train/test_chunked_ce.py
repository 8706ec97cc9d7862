"""The chunked cross-entropy (shardwise.train.model.loss) against the standard fp32 one, and the
planner's description of it.

- Math, fp32 on CPU: loss within 1e-6 relative, gradients of h, W (and a bias) within 1e-5 of
  max |standard| elementwise; packed rows (several documents, prompt masks), ignore-index
  targets, a row that is all ignore, chunk sizes that do not divide the token count; tied
  weights, a frozen lm_head, Gemma's soft-cap, autocast, no_grad.
- Through the trainer's model (build_model, forward_loss_sum) on a packed SFT batch: tiny Llama,
  tiny Qwen2 (tied), Gemma2 (soft-capped), LoRA (frozen lm_head; lm_head in modules_to_save).
- Engines: 2 gloo ranks, chunked vs standard (DDP, ZeRO-3, FSDP2) over 8 steps.
- Planner: the logits term and the time model follow the implementation, and the measured peak
  of forward + backward (CPU, torch's MemTracker) is the planned term.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardwise.data.labels import IGNORE_INDEX
from shardwise.errors import ShardwiseError
from shardwise.specs.families import ANALYTIC_FAMILIES
from shardwise.train.engines.base import forward_loss_sum, token_loss_sum
from shardwise.train.model.hf import causal_lm_class, causal_lm_name, forward_source
from shardwise.train.model.loss import (
    LossHead,
    install_loss_heads,
    linear_cross_entropy_sum,
    output_heads,
    shifted_targets,
)
from shardwise.train.model.loss_support import check_run, forward_support, head_support

LOSS_RTOL = 1e-6
GRAD_TOL = 1e-5
CPU = torch.device("cpu")


def _close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours − ref| / max |ref|: elementwise, scaled by the tensor's largest entry (a zero
    reference, e.g. LoRA's A before B moves, must be matched exactly)."""
    scale = ref.double().abs().max()
    return float((ours.double() - ref.double()).abs().max() / (scale if scale > 0 else 1.0))


def packed_labels(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Rows of several documents each (prompt masked, the first label of a document ignored so
    no target crosses a boundary); with several rows, row 1 entirely ignored."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    for r in range(batch):
        start = 0
        while start < seq:
            length = int(torch.randint(5, 20, (1,), generator=g))
            prompt = int(torch.randint(1, max(2, length // 2), (1,), generator=g))
            labels[r, start : start + prompt] = IGNORE_INDEX
            start += length
    if batch > 1:
        labels[1] = IGNORE_INDEX
    return labels


def _both(h, w, b, labels, chunk, softcap=None, scale=0.37):
    """(loss, grads) of the standard path (logits, token_loss_sum) and of the chunked one."""
    params = [t for t in (h, w, b) if t is not None and t.requires_grad]
    z = F.linear(h, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    ref = token_loss_sum(z, labels)
    ref_grads = torch.autograd.grad(ref * scale, params)
    ours = linear_cross_entropy_sum(h.reshape(-1, h.size(-1)), w, b, shifted_targets(labels), chunk, softcap)
    our_grads = torch.autograd.grad(ours * scale, params)
    return (ref.detach(), ref_grads), (ours.detach(), our_grads)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_grads_equal_standard_fp32(chunk: int, bias: bool) -> None:
    torch.manual_seed(0)
    batch, seq, hidden, vocab = 3, 50, 24, 301  # 150 tokens: 7 and 64 do not divide it
    h = torch.randn(batch, seq, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    labels = packed_labels(batch, seq, vocab)
    (ref, ref_g), (ours, our_g) = _both(h, w, b, labels, chunk)
    assert abs(float(ours - ref)) / abs(float(ref)) <= LOSS_RTOL, (float(ours), float(ref))
    for name, r, o in zip(("h", "W", "b"), ref_g, our_g, strict=False):
        assert _close(o, r) <= GRAD_TOL, (name, _close(o, r))
    # the all-ignore row gets no gradient, as in the standard path
    assert float(our_g[0][1].abs().max()) == 0.0


def test_all_targets_ignored_gives_zero_loss_and_zero_weight_grad() -> None:
    h = torch.randn(2, 9, 8, requires_grad=True)
    w = torch.randn(31, 8, requires_grad=True)
    labels = torch.full((2, 9), IGNORE_INDEX)
    loss = linear_cross_entropy_sum(h.reshape(-1, 8), w, None, shifted_targets(labels), 4)
    loss.backward()
    assert float(loss.detach()) == 0.0
    # a zero gradient, not None: every rank's gradient hooks (DDP, ZeRO) fire alike
    assert w.grad is not None and float(w.grad.abs().max()) == 0.0 and float(h.grad.abs().max()) == 0.0


def test_tied_weights_accumulate_both_uses() -> None:
    """lm_head shares the embedding matrix: its gradient sums the lookup's and the head's."""
    torch.manual_seed(1)
    vocab, hidden = 97, 16
    ids = torch.randint(0, vocab, (2, 33))
    labels = packed_labels(2, 33, vocab, seed=3)
    grads = {}
    for impl in ("standard", "chunked"):
        emb = torch.nn.Embedding(vocab, hidden)
        torch.nn.init.normal_(emb.weight, generator=torch.Generator().manual_seed(5))
        h = torch.tanh(emb(ids) * 1.5)
        if impl == "standard":
            loss = token_loss_sum(h @ emb.weight.t(), labels)
        else:
            loss = linear_cross_entropy_sum(h.reshape(-1, hidden), emb.weight, None, shifted_targets(labels), 10)
        (loss * 0.1).backward()
        grads[impl] = (float(loss.detach()), emb.weight.grad.clone())
    assert abs(grads["chunked"][0] - grads["standard"][0]) / grads["standard"][0] <= LOSS_RTOL
    assert _close(grads["chunked"][1], grads["standard"][1]) <= GRAD_TOL


def test_frozen_head_gets_no_gradient() -> None:
    torch.manual_seed(2)
    h = torch.randn(2, 40, 12, requires_grad=True)
    w = torch.randn(53, 12)  # requires_grad False: LoRA's frozen lm_head
    labels = packed_labels(2, 40, 53)
    (ref, ref_g), (ours, our_g) = _both(h, w, None, labels, 9)
    assert len(our_g) == 1 and _close(our_g[0], ref_g[0]) <= GRAD_TOL
    assert abs(float(ours - ref)) / abs(float(ref)) <= LOSS_RTOL


def test_softcap_equals_the_capped_standard_loss() -> None:
    torch.manual_seed(3)
    h = torch.randn(2, 30, 16, requires_grad=True)
    w = (torch.randn(67, 16) * 3).requires_grad_()  # logits well past the cap: tanh saturates
    labels = packed_labels(2, 30, 67)
    (ref, ref_g), (ours, our_g) = _both(h, w, None, labels, 11, softcap=5.0)
    assert abs(float(ours - ref)) / abs(float(ref)) <= LOSS_RTOL
    for r, o in zip(ref_g, our_g, strict=True):
        assert _close(o, r) <= GRAD_TOL


def test_no_grad_computes_the_loss_only() -> None:
    h, w = torch.randn(1, 20, 8, requires_grad=True), torch.randn(41, 8, requires_grad=True)
    labels = packed_labels(1, 20, 41)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h.reshape(-1, 8), w, None, shifted_targets(labels), 6)
        ref = token_loss_sum(F.linear(h, w), labels)
    assert not loss.requires_grad and abs(float(loss - ref)) <= LOSS_RTOL * abs(float(ref))


def test_autocast_casts_like_autocast_and_matches_within_bf16() -> None:
    """DDP's mixed precision: fp32 weights under torch.autocast. The chunked path casts h and W
    as autocast casts F.linear's inputs; grads come back fp32 through the casts."""
    torch.manual_seed(4)
    h = torch.randn(2, 64, 32, requires_grad=True)
    w = (torch.randn(257, 32) * 0.2).requires_grad_()
    labels = packed_labels(2, 64, 257)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (ref, ref_g), (ours, our_g) = _both(h, w, None, labels, 40)
    assert ours.dtype == torch.float32 and our_g[1].dtype == torch.float32
    assert abs(float(ours - ref)) / abs(float(ref)) <= 1e-5  # same bf16 logits, fp32 log-softmax
    for r, o in zip(ref_g, our_g, strict=True):
        assert _close(o, r) <= 2e-2  # bf16 gradients: rounding of the chunk partial sums


# --------------------------------------------------------------- through the trainer's model
def _run(model: str, impl: str, chunk: int = 37, precision: str = "fp32", lora: dict | None = None):
    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec

    cfg = TrainConfig.model_validate({
        "model": {"name": model, "attention": "eager"}, "run": {"seed": 0}, "precision": precision,
        "loss": {"implementation": impl, "chunk_tokens": chunk}, "lora": lora})
    return run_spec(cfg, 1, "cpu")


@pytest.fixture(scope="module")
def sft_batch() -> dict[str, torch.Tensor]:
    """Three packed rows of the bundled SFT sample (4-D isolation mask, restarting positions)."""
    from shardwise.config.data import DataConfig
    from shardwise.data import SFTCollator, build_dataset, load_tokenizer, sample_data_path

    tok = load_tokenizer()
    ds = build_dataset(DataConfig(train_files=[str(sample_data_path())], max_length=128), tok)
    batch = SFTCollator(tok.pad_token_id)([ds[i] for i in range(3)])
    assert batch["attention_mask"].dim() == 4 and int(batch["labels"].max()) < 2048
    return batch


def _grads(run, batch, build=None):
    from shardwise.train.model.build import build_model

    torch.manual_seed(0)
    model = build(run) if build else build_model(run)
    loss = forward_loss_sum(model, model, batch, CPU, run.train)
    (loss * 0.01).backward()
    return model, float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen"])
def test_trainer_model_on_packed_batch_matches_standard(model: str, sft_batch) -> None:
    torch.set_num_threads(1)
    _, ref_loss, ref = _grads(_run(model, "standard"), sft_batch)
    m, loss, ours = _grads(_run(model, "chunked"), sft_batch)
    assert abs(loss - ref_loss) / ref_loss <= LOSS_RTOL
    assert ours.keys() == ref.keys()
    worst = max(ref, key=lambda k: _close(ours[k], ref[k]))
    assert _close(ours[worst], ref[worst]) <= GRAD_TOL, (worst, _close(ours[worst], ref[worst]))
    if model == "tiny-qwen":
        assert m.config.tie_word_embeddings and m.lm_head.weight is m.model.embed_tokens.weight
    # the loss head is the model's own output layer: a named module, the standard build's names
    assert type(m.lm_head) is LossHead and m.get_output_embeddings() is m.lm_head
    assert "LossHead(in_features=64" in repr(m)
    # outside a `computing` call the LossHead returns logits
    with torch.no_grad():
        out = m(input_ids=sft_batch["input_ids"][:1]).logits
    assert out.shape == (1, sft_batch["input_ids"].size(1), 2048)


def test_gemma2_softcap_through_the_model(sft_batch) -> None:
    """Gemma2 soft-caps the logits in its CausalLM forward: the chunked path folds the cap into
    the loss and turns the model's own off for the call (and back on after)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.set_num_threads(1)
    cfg = Gemma2Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=3.0,
                       attn_implementation="eager")

    def build(run):
        torch.manual_seed(0)
        m = Gemma2ForCausalLM(cfg).float()
        if run.train.cross_entropy == "chunked":  # as build_model does
            install_loss_heads(m)
        return m

    batch = {k: v for k, v in sft_batch.items() if k != "attention_mask"}  # Gemma2 builds its own masks
    run = _run("tiny-llama", "standard")
    _, ref_loss, ref = _grads(run, batch, build)
    chunked = dataclasses.replace(run, train=run.train.model_copy(update={"cross_entropy": "chunked"}))
    m, loss, ours = _grads(chunked, batch, build)
    assert head_support(type(m)) == (True, None)
    assert m.config.final_logit_softcapping == 3.0
    assert abs(loss - ref_loss) / ref_loss <= LOSS_RTOL
    worst = max(ref, key=lambda k: _close(ours[k], ref[k]))
    assert _close(ours[worst], ref[worst]) <= GRAD_TOL, worst


@pytest.mark.parametrize("save_head", [False, True])
def test_lora_frozen_head_and_modules_to_save(save_head: bool, sft_batch) -> None:
    """LoRA freezes lm_head (no weight gradient computed); modules_to_save: [lm_head] wraps it in
    PEFT's ModulesToSaveWrapper, whose trainable copy computes the loss."""
    torch.set_num_threads(1)
    lora = {"rank": 4, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"] if save_head else []}
    _, ref_loss, ref = _grads(_run("tiny-llama", "standard", lora=lora), sft_batch)
    m, loss, ours = _grads(_run("tiny-llama", "chunked", lora=lora), sft_batch)
    assert len(output_heads(m)) == (2 if save_head else 1)
    assert any("lm_head" in k for k in ours) == save_head
    assert abs(loss - ref_loss) / ref_loss <= LOSS_RTOL
    assert ours.keys() == ref.keys()
    for k in ref:
        assert _close(ours[k], ref[k]) <= GRAD_TOL, k


def test_models_that_change_their_logits_are_refused() -> None:
    from transformers import CohereForCausalLM, GraniteForCausalLM, LlamaForCausalLM

    assert head_support(LlamaForCausalLM) == (False, None)
    for cls in (CohereForCausalLM, GraniteForCausalLM):
        capped, refusal = head_support(cls)
        assert not capped and refusal and "logits" in refusal
    run = _run("tiny-llama", "chunked", lora={"rank": 4, "target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(ShardwiseError, match=r"loss\.implementation: standard"):
        check_run(run)
    check_run(_run("tiny-llama", "chunked"))  # supported: no refusal


@pytest.mark.parametrize("model_type", [*ANALYTIC_FAMILIES, "cohere", "granite"])
def test_the_launchers_read_of_transformers_files_judges_as_the_imported_class(model_type) -> None:
    """The launcher's check (the class's name and forward read from transformers' files, torch
    never imported) says what the rank's check of the imported class says, for every family
    the planner models and two that change their logits."""
    name = causal_lm_name(model_type)
    cls = causal_lm_class(model_type)
    assert cls is not None and name == cls.__name__
    src = forward_source(model_type, name)
    assert src is not None, f"{name}.forward not found in transformers' files: the launcher would import it"
    assert forward_support(name, src) == head_support(cls)


# --------------------------------------------------------------- engines (2 gloo ranks)
ENGINE_RUNS = ["tiny-llama:ddp:1:std", "tiny-llama:ddp:1:ce5", "tiny-llama:zero3:2:ce5", "tiny-llama:fsdp:2:ce5",
               "tiny-llama:fsdp:1:bf16:std", "tiny-llama:fsdp:1:bf16"]


@pytest.mark.distributed
def test_engines_train_alike_with_either_implementation(ranks_runner) -> None:
    """8 steps on 2 ranks: the chunked loss (5-token chunks: 16 tokens per micro-batch row) under
    DDP, ZeRO-3 and FSDP2 against the standard one under DDP, fp32 (1e-5); FSDP2 bf16-mixed
    chunked vs standard: losses within 1e-3, weights within 3e-2 (the gradients differ by bf16
    roundings, which AdamW's normalised update carries into the weights: measured 3e-5 / 1.2e-2)."""
    out = ranks_runner(ENGINE_RUNS, nproc=2)
    runs = {r: torch.load(out / f"{r.replace(':', '-')}-w2.pt") for r in ENGINE_RUNS}

    def diff(a: str, b: str) -> tuple[float, float]:
        ra, rb = runs[a], runs[b]
        loss = max(abs(x - y) / abs(y) for x, y in zip(ra["losses"], rb["losses"], strict=True))
        weights = max(float((ra["weights"][k].double() - v.double()).norm() / v.double().norm())
                      for k, v in rb["weights"].items())
        return loss, weights

    for r in ENGINE_RUNS[1:4]:
        loss, weights = diff(r, "tiny-llama:ddp:1:std")
        assert loss <= 1e-5 and weights <= 1e-5, (r, loss, weights)
    loss, weights = diff("tiny-llama:fsdp:1:bf16", "tiny-llama:fsdp:1:bf16:std")
    assert loss <= 1e-3 and weights <= 3e-2, (loss, weights)


# --------------------------------------------------------------- the planner
def _plan_specs(model: str = "qwen2.5-0.5b", **train):
    from shardwise.catalog import build_hardware, get_model
    from shardwise.specs import Strategy, TrainSpec

    return get_model(model), build_hardware(gpu="h200", gpus=1), TrainSpec(**train), Strategy.from_name("fsdp")


def test_planned_logits_follow_the_implementation() -> None:
    from shardwise.plan.loss import logits_bytes

    m, _, _, _ = _plan_specs()

    def logits(**kw):
        return logits_bytes(m, _plan_specs(**kw)[2])

    base = {"micro_batch": 4, "seq_len": 2048}
    # standard: the whole micro-batch's logits; chunked: one chunk's working set + held grad_W
    std = logits(**base, cross_entropy="standard")
    assert logits(micro_batch=4, seq_len=4096, cross_entropy="standard") == pytest.approx(2 * std)
    ch = logits(**base, cross_entropy="chunked", ce_chunk=1024)
    assert logits(micro_batch=4, seq_len=4096, cross_entropy="chunked", ce_chunk=1024) == ch  # not the sequence
    more = logits(**base, cross_entropy="chunked", ce_chunk=2048)
    held = 2 * m.vocab_size * m.hidden_size  # bf16 grad_W
    assert more - held == pytest.approx(2 * (ch - held))  # the working set scales with the chunk
    assert ch < std / 10
    # LoRA freezes lm_head: no weight gradient held; modules_to_save: [lm_head] trains it again
    lora = logits(**base, cross_entropy="chunked", lora_rank=8)
    assert ch - lora == pytest.approx(held)
    assert logits(**base, cross_entropy="chunked", lora_rank=8, lora_modules_to_save=("lm_head",)) == ch


def test_planned_time_follows_the_implementation() -> None:
    from shardwise.plan.kernels import ce_chunks, head_gemm_time, loss_bytes_per_token
    from shardwise.plan.planner import evaluate
    from shardwise.plan.timing import compute_time
    from shardwise.specs import ParallelLayout

    m, hw, std, s = _plan_specs(micro_batch=4, seq_len=2048, cross_entropy="standard")
    ch = std.model_copy(update={"cross_entropy": "chunked", "ce_chunk": 1000})
    assert (ce_chunks(std), ce_chunks(ch)) == (0, 9)  # 8192 tokens: 8 full chunks and 192 tokens
    # fewer bytes over the vocabulary (no NLL gradient, no log-softmax backward) ...
    assert loss_bytes_per_token(m, ch) < loss_bytes_per_token(m, std)
    # ... the same GEMM FLOPs in smaller GEMMs, each re-reading the weight: a little more GEMM time
    flops_s, bytes_s = 700e12, 4.0e12
    g_std, g_ch = head_gemm_time(m, std, 1, flops_s, bytes_s), head_gemm_time(m, ch, 1, flops_s, bytes_s)
    assert g_std < g_ch < 1.1 * g_std
    layout = ParallelLayout.for_strategy(s, 1, 1)
    t_std, t_ch = (compute_time(m, hw, t, s, layout, m.params) for t in (std, ch))
    assert t_ch.memory_bound_s < t_std.memory_bound_s and t_ch.gpu_s < t_std.gpu_s
    # the step the planner reports: chunked at least as fast for the catalog's large-vocabulary models
    for name in ("qwen2.5-0.5b", "llama-3.1-8b", "gemma-2-9b"):
        m, hw, std, s = _plan_specs(name, micro_batch=2, seq_len=4096, cross_entropy="standard")
        ch = std.model_copy(update={"cross_entropy": "chunked"})
        assert evaluate(m, hw, ch, s).time.step_s <= evaluate(m, hw, std, s).time.step_s, name


def test_trainer_runs_what_is_planned_by_default() -> None:
    """A trainer config plans the chunked loss with its chunk; `plan --emit` writes it back."""
    from shardwise.catalog import build_hardware, get_model
    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec, to_config
    from shardwise.specs import Strategy, TrainSpec

    run = run_spec(TrainConfig(), 1, "cpu")
    assert (run.train.cross_entropy, run.train.ce_chunk) == ("chunked", 1024)
    run = run_spec(TrainConfig.model_validate({"loss": {"implementation": "standard", "chunk_tokens": 512}}), 1, "cpu")
    assert (run.train.cross_entropy, run.train.ce_chunk) == ("standard", 512)
    hw = build_hardware(gpus=8)
    for ce in ("chunked", "standard"):
        cfg, notes = to_config(get_model("llama-2-7b"), hw, TrainSpec(cross_entropy=ce, ce_chunk=2048),
                               Strategy.from_name("fsdp"))
        assert (cfg.loss.implementation, cfg.loss.chunk_tokens) == (ce, 2048) and not notes
    cfg, notes = to_config(get_model("llama-2-7b"), hw, TrainSpec(cross_entropy="fused"), Strategy.from_name("fsdp"))
    assert cfg.loss.implementation == "chunked" and any("Liger" in n for n in notes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_peak_is_the_planned_logits_term(dtype) -> None:
    """Forward + backward of the loss from the lm_head input on CPU under torch's MemTracker:
    the peak of live bytes beyond the inputs (h, W) and the lm_head input gradient (which the
    planner books in place of the saved lm_head input) is the planned chunked term at two
    chunk sizes; the standard path's is the planned standard term less the c-byte logits an
    HF-style caller holds (the trainer's engines drop them before backward). So the measured
    saving is the planned one, less that."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardwise.plan.loss import logits_bytes
    from shardwise.specs import ModelSpec, TrainSpec

    torch.set_num_threads(1)
    batch, seq, hidden, vocab = 2, 256, 64, 2048
    m = ModelSpec.from_hf_dict({"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2}, name="head")
    c = torch.finfo(dtype).bits // 8
    labels = packed_labels(batch, seq, vocab)
    measured, planned = {}, {}
    for impl, chunk in (("standard", 1024), ("chunked", 64), ("chunked", 128)):
        h = torch.randn(batch, seq, hidden, dtype=dtype, requires_grad=True)
        w = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dtype) * 0.1)
        mt = MemTracker()
        mt.track_external(h, w)
        with mt:
            if impl == "standard":
                loss = token_loss_sum(F.linear(h, w), labels)
            else:
                loss = linear_cross_entropy_sum(h.reshape(-1, hidden), w, None, shifted_targets(labels), chunk)
            loss.backward()
        peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
        grad_h = c * batch * seq * hidden if impl == "chunked" else 0  # held from forward: not a logits term
        measured[impl, chunk] = peak - c * (h.numel() + w.numel()) - grad_h
        precision = "fp32" if dtype == torch.float32 else "bf16-mixed"
        planned[impl, chunk] = logits_bytes(m, TrainSpec(seq_len=seq, micro_batch=batch, precision=precision,
                                                         cross_entropy=impl, ce_chunk=chunk))
    held_logits = c * vocab * batch * seq
    for key in measured:
        expect = planned[key] - (held_logits if key[0] == "standard" else 0)
        assert measured[key] == pytest.approx(expect, rel=0.05), (key, measured[key], planned[key])
    saving = measured["standard", 1024] - measured["chunked", 64]
    assert saving == pytest.approx(planned["standard", 1024] - held_logits - planned["chunked", 64], rel=0.05)
