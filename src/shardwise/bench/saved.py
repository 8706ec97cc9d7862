"""Saved-for-backward bytes of one forward, deduplicated by storage (single process, CPU).

Two independent measurements:

* `saved_activation_bytes`: every tensor autograd packs for backward passes through a
  `saved_tensors_hooks` pack hook; we sum the *storages* (a view saved by three ops is one
  buffer — without dedupe the sum is ~37% too high) and skip parameter/buffer storages and
  the batch. Non-reentrant checkpointing saves each checkpointed region's inputs through
  `_NoopSaveInputs.save_for_backward` outside its own hook, so the outer hook sees exactly
  what a checkpointed forward keeps.
* `live_forward_bytes`: a TorchDispatchMode records a weak reference to the storage of every
  op output during forward; afterwards the storages still alive (minus params, the batch and
  the model output) are what the forward left behind. A cross-check of the first.

bf16: the model's weights are cast to bf16 (`model.to(torch.bfloat16)`), which is how
DeepSpeed's bf16 mode and FSDP2 `MixedPrecisionPolicy(param_dtype=bf16)` run the forward:
activations in bf16, RMSNorm internals upcast to fp32 by the HF code. `torch.autocast`
(fp32 weights) is measured separately as "bf16-autocast": there the residual stream stays
fp32 and autocast's bf16 weight copies are saved by every linear, a different layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.bench.census import storage_key

SEQ, BATCH = 128, 2
SHAPES: dict[str, dict[str, Any]] = {
    # Llama: MHA, untied, no bias.
    "tiny-llama": dict(model_type="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=344, vocab_size=2048, tie_word_embeddings=False,
                       max_position_embeddings=512),
    # Qwen2: GQA (4 q heads, 2 kv heads), tied embeddings, q/k/v bias.
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=344, vocab_size=2048, tie_word_embeddings=True,
                       max_position_embeddings=512),
    # Further families (activations.py derives each block; tests assert bf16 sdpa, gemma2 and mpt eager).
    # Qwen3: RMSNorm over head_dim on q and k.
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=344, vocab_size=2048, tie_word_embeddings=True,
                       max_position_embeddings=512),
    # Qwen3-MoE: 8 experts, top-2, fused 3-D experts; layer 0 dense (mlp_only_layers).
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=344, moe_intermediate_size=96, num_experts=8,
                           num_experts_per_tok=2, mlp_only_layers=[0], vocab_size=2048,
                           max_position_embeddings=512),
    # Qwen2-MoE: routed experts + a sigmoid-gated shared expert, q/k/v bias.
    "tiny-qwen2-moe": dict(model_type="qwen2_moe", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=344, moe_intermediate_size=96, shared_expert_intermediate_size=192,
                           num_experts=8, num_experts_per_tok=2, vocab_size=2048, max_position_embeddings=512),
    # Gemma: GeGLU (gelu tanh), MQA, head_dim·heads (192) != hidden, scaled embeddings, tied.
    "tiny-gemma": dict(model_type="gemma", hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=48, intermediate_size=344, vocab_size=2048, max_position_embeddings=512,
                       pad_token_id=0, eos_token_id=1, bos_token_id=2),
    # Gemma2: sandwich norms, attention logit softcapping (transformers runs it eager: no sdpa),
    # no final logit softcapping here (that is the loss side).
    "tiny-gemma2": dict(model_type="gemma2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, intermediate_size=344, vocab_size=2048, max_position_embeddings=512,
                        final_logit_softcapping=None, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    # Gemma3 (text): sandwich norms + q/k norms over head_dim; window 4096 > SEQ (no mask).
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, intermediate_size=344, vocab_size=2048, max_position_embeddings=512,
                        pad_token_id=0, eos_token_id=1, bos_token_id=2),
    # Phi-3: fused qkv_proj and gate_up_proj.
    "tiny-phi3": dict(model_type="phi3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=344, vocab_size=2048, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2),
    # OLMo 2: post-norms only, q/k norms over the full projection width.
    "tiny-olmo2": dict(model_type="olmo2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=344, vocab_size=2048, max_position_embeddings=512,
                       pad_token_id=0, eos_token_id=1),
    # DeepSeek-V3: MLA (q and kv low-rank paths with their norms), 8 routed experts top-2 in 2
    # groups, a shared expert, layer 0 dense (first_k_dense_replace). qk_nope + qk_rope = v_head_dim:
    # CPU SDPA has no fused kernel for unequal q/v head dims (it would fall back to the math path,
    # which saves the attention matrix); on CUDA the memory-efficient kernel takes them.
    "tiny-deepseek-v3": dict(model_type="deepseek_v3", hidden_size=128, num_attention_heads=4,
                             num_key_value_heads=4, intermediate_size=344, moe_intermediate_size=96,
                             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                             n_group=2, topk_group=1, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=16, v_head_dim=32, vocab_size=2048, max_position_embeddings=512),
    # Mixtral: routed experts only (fused 3-D, grouped_mm), top-2 renormalised in place.
    "tiny-mixtral": dict(model_type="mixtral", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, vocab_size=2048,
                         max_position_embeddings=512),
    # MPT (transformers' MptForCausalLM): GPT-style block, LayerNorm without bias, fused Wqkv, ALiBi,
    # a 4h exact-GeLU MLP, no linear biases, tied embeddings; eager attention only (no SDPA path).
    "tiny-mpt": dict(model_type="mpt", hidden_size=128, num_attention_heads=4, expansion_ratio=4, max_seq_len=512,
                     vocab_size=2048),
    # GPT-2: LayerNorm and linear biases (Conv1D runs addmm), fused c_attn, learned position
    # embeddings, tied lm_head; exact GeLU (Megatron's) and no dropout, as the trainer runs.
    "tiny-gpt2": dict(model_type="gpt2", hidden_size=128, num_attention_heads=4, n_positions=512, vocab_size=2048,
                      activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # Granite: no analytic family; planned from the meta-device inventory with the Llama-block formula.
    "tiny-granite": dict(model_type="granite", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=344, vocab_size=2048, max_position_embeddings=512,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2),
}
PRECISIONS = ("fp32", "bf16", "bf16-autocast")
# The shapes of the original Llama-block derivation (measured over every precision, attention and
# checkpointing); the others are the further families (tests/accuracy/test_measured_memory.py).
LLAMA_BLOCK_SHAPES = ("tiny-llama", "tiny-qwen2")


def attentions(shape: str) -> tuple[str, ...]:
    """The attention implementations transformers runs for `shape`: Gemma2 and MPT have no SDPA
    path (`_supports_sdpa` False; MptAttention is eager code, and `attn_implementation="sdpa"`
    raises for it)."""
    return ("eager",) if SHAPES[shape]["model_type"] in ("gemma2", "mpt") else ("sdpa", "eager")


def _model_keys(model: torch.nn.Module, extra: Iterable[torch.Tensor]) -> set[int]:
    keys = set()
    for t in [*model.parameters(), *model.buffers(), *extra]:
        k = storage_key(t)
        if k:
            keys.add(k[0])
    return keys


def _autocast(precision: str):
    if precision == "bf16-autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return nullcontext()


def saved_activation_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                           precision: str = "fp32") -> int:
    """Bytes autograd saves for backward in one forward of `model(**batch)` (storage-deduped,
    parameters, buffers and batch excluded). `precision` only selects autocast; cast the
    model yourself for bf16 weights."""
    skip = _model_keys(model, batch.values())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        if k and k[0] not in skip:
            seen[k[0]] = max(seen.get(k[0], 0), k[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(precision):
        out = model(**batch)
    total = sum(seen.values())
    del out  # the saved tensors stay alive (no ptr reuse) until the sum is taken
    return total


class _Held:
    """What the pack hook hands autograd: when autograd drops a saved tensor, this object dies
    and the storage's hold count goes down (so live saved bytes can be followed in backward)."""

    __slots__ = ("book", "key", "t")

    def __init__(self, t: torch.Tensor, key: tuple[int, int], book: _SavedBook) -> None:
        self.t, self.key, self.book = t, key, book
        book.acquire(key)

    def __del__(self) -> None:
        self.book.release(self.key)


class _SavedBook:
    def __init__(self) -> None:
        self.count: dict[int, int] = {}
        self.live = self.peak = 0

    def acquire(self, key: tuple[int, int]) -> None:
        if self.count.get(key[0], 0) == 0:
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self.count[key[0]] = self.count.get(key[0], 0) + 1

    def release(self, key: tuple[int, int]) -> None:
        self.count[key[0]] -= 1
        if self.count[key[0]] == 0:
            self.live -= key[1]


@contextmanager
def following_saved(skip: Callable[[int], bool]) -> Iterator[_SavedBook]:
    """Inside the block, follow the live saved-for-backward bytes (storage-deduped) of every
    tensor autograd packs, from its pack until autograd drops it (after its node's backward, or
    with the graph): the book's `live` and `peak`. `skip(data_ptr)`, asked at pack time: a storage
    not to count (parameters, the batch). Read-only: what autograd saves is handed back as is."""
    book = _SavedBook()

    def pack(t: torch.Tensor) -> Any:
        k = storage_key(t)
        return t if k is None or skip(k[0]) else _Held(t, k, book)

    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield book


def peak_saved_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], precision: str = "fp32") -> int:
    """Peak of live saved-for-backward bytes over one forward AND its backward (storage-deduped,
    params/buffers/batch excluded). With checkpointing this includes the recomputed layer's
    saved set in backward; it needs reentrant checkpointing, whose recompute packs through our
    hook (non-reentrant recomputes under its own hook, invisible here). The backward is driven
    by summing the logits (no labels: the loss side is measured separately)."""
    skip = _model_keys(model, batch.values())
    with following_saved(skip.__contains__) as book:
        with _autocast(precision):
            out = model(**batch)
        out.logits.float().sum().backward()
    del out
    return book.peak


class _OutputRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.nbytes():
                    self.refs[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        return out


def live_forward_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], precision: str = "fp32",
                       keep_output: bool = False) -> int:
    """Bytes of op outputs still alive after one forward (what the graph keeps). The model
    output (logits, loss) is excluded unless `keep_output`."""
    skip = _model_keys(model, batch.values())
    rec = _OutputRecorder()
    with rec, _autocast(precision):
        out = model(**batch)
    if not keep_output:
        skip |= {k[0] for t in tree_flatten(dict(out))[0] if isinstance(t, torch.Tensor)
                 if (k := storage_key(t))}
    total = sum(n for ptr, (ref, n) in rec.refs.items() if ptr not in skip and not ref.expired())
    del out
    return total


def torchtitan_sac_context() -> Callable[[], Any]:
    """A `context_fn` for torch.utils.checkpoint: torchtitan's per-op selective activation
    checkpointing policy (torchtitan/models/llama3/infra/parallelize.py `_save_list`,
    `_custom_policy`): save the outputs of mm, SDPA (flash / memory-efficient), reduce_scatter
    and max, except every second mm, with a fresh mm counter per checkpointed call; recompute
    everything else. CPU's SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`) stands in
    for the CUDA ones."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default, aten.max.default}

    def context_fn():
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
            if func == aten.mm.default:
                meta[key] += 1
            to_save = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def build_model(shape: str, layers: int, precision: str, attention: str, checkpointing: str,
                reentrant: bool = False) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(d.pop("model_type"), num_hidden_layers=layers, **d)
    cfg._attn_implementation = attention
    cfg.use_cache = False  # as the trainer runs (train/model/build.py): no KV cache holding k/v copies
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)  # a built-in shape: no code to run
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if checkpointing == "full":
        from shardwise.train.model.hf import enable_checkpointing

        enable_checkpointing(model, use_reentrant=reentrant)
    elif checkpointing == "selective":  # per decoder layer, as torchtitan wraps its blocks
        from functools import partial

        from torch.utils.checkpoint import checkpoint

        from shardwise.specs.hf_meta import decoder_layers

        for layer in decoder_layers(model):
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False,
                                                         context_fn=torchtitan_sac_context())
    return model.train()  # HF checkpoints only in training mode; no dropout in these configs


def make_batch(vocab: int, labels: bool = False, seq: int = SEQ, batch: int = BATCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()} if labels else {"input_ids": ids}


def measure_case(shape: str, precision: str, attention: str, checkpointing: str,
                 layers: tuple[int, int] = (2, 4),
                 method: Callable[..., int] = saved_activation_bytes) -> dict[str, Any]:
    """Totals at two depths and the per-layer difference (same shape, so everything outside
    the decoder layers cancels). `peak_saved_bytes` gets reentrant checkpointing (see there)."""
    vocab = SHAPES[shape]["vocab_size"]
    totals = {}
    for L in layers:
        model = build_model(shape, L, precision, attention, checkpointing,
                            reentrant=method is peak_saved_bytes)
        totals[L] = method(model, make_batch(vocab), precision=precision)
    lo, hi = layers
    per_layer = (totals[hi] - totals[lo]) / (hi - lo)
    sbh = SEQ * BATCH * SHAPES[shape]["hidden_size"]
    return {"totals": {str(k): v for k, v in totals.items()}, "per_layer": per_layer,
            "per_layer_over_sbh": per_layer / sbh, "outside_layers": totals[lo] - lo * per_layer}


def loss_side_bytes(shape: str, precision: str, layers: int = 2) -> dict[str, int]:
    """What the loss adds in forward: saved bytes and live bytes with labels minus without."""
    vocab = SHAPES[shape]["vocab_size"]
    out: dict[str, int] = {}
    for name, fn in (("saved", saved_activation_bytes), ("live", live_forward_bytes)):
        vals = []
        for labels in (False, True):
            model = build_model(shape, layers, precision, "sdpa", "none")
            kw = {"keep_output": True} if fn is live_forward_bytes else {}
            vals.append(fn(model, make_batch(vocab, labels=labels), precision=precision, **kw))
        out[name] = vals[1] - vals[0]
    return out


def measure_all() -> dict[str, Any]:
    """Every case recorded in benchmarks/results/measured_activations.json."""
    import transformers

    torch.set_num_threads(1)
    cases = []
    for shape in SHAPES:
        for precision in PRECISIONS:
            for attention in attentions(shape):
                for ckpt in ("none", "full"):
                    r = measure_case(shape, precision, attention, ckpt)
                    live = measure_case(shape, precision, attention, ckpt, method=live_forward_bytes)
                    peak = measure_case(shape, precision, attention, ckpt, method=peak_saved_bytes)
                    cases.append({"shape": shape, "precision": precision, "attention": attention,
                                  "checkpointing": ckpt, **r,
                                  "peak_fwd_bwd": {"totals": peak["totals"], "per_layer": peak["per_layer"]},
                                  "live_cross_check": {"totals": live["totals"], "per_layer": live["per_layer"]}})
    loss = [{"shape": s, "precision": p, **loss_side_bytes(s, p)} for s in SHAPES for p in PRECISIONS]
    return {
        "what": "saved-for-backward bytes of one forward WITHOUT labels (storage-deduped; params, buffers "
                "and input_ids excluded), at L=2 and L=4 layers; per_layer = (L4 - L2) / 2. "
                "peak_fwd_bwd: peak of live saved bytes over forward + backward (reentrant checkpointing "
                "so the recompute is visible); live_cross_check: op outputs alive after forward",
        "seq_len": SEQ, "micro_batch": BATCH,
        "shapes": {k: {**v, "head_dim": v["hidden_size"] // v["num_attention_heads"]} for k, v in SHAPES.items()},
        "precision_notes": {"fp32": "fp32 weights and compute",
                            "bf16": "weights cast to bf16 (as DeepSpeed bf16 / FSDP2 param_dtype=bf16 run forward)",
                            "bf16-autocast": "fp32 weights under torch.autocast('cpu', bfloat16)"},
        "checkpointing_notes": "full = model.gradient_checkpointing_enable(use_reentrant=False), train mode",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "cases": cases,
        "loss_side": {"what": "bytes the loss adds to one forward (labels minus no labels, L=2, sdpa): "
                              "'saved' = saved-for-backward, 'live' = all live op outputs incl. logits",
                      "tokens": SEQ * BATCH, "cases": loss},
    }
