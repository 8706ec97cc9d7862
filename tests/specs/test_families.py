"""Every family the planner knows, against what transformers builds on the meta device.

Analytic families (torch-free derivation in shardwise.specs.model) and the meta-device path
(shardwise.specs.hf_meta) for any other architecture: the parameter count, the per-module
inventory, `model.parameters()` order, per-layer sizes, active (MoE) parameters and the
attention widths are compared with a model transformers builds from the same config (2 hidden
layers, small widths). Nothing here is copied from the code under test.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

from shardwise.errors import ShardwiseError
from shardwise.specs import ModelSpec
from shardwise.specs.train import weight_decayed

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=256)
CONFIGS = {
    "llama-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "qwen3-bias-tied-default-head-dim": dict(model_type="qwen3", attention_bias=True, tie_word_embeddings=True),
    "qwen3_moe-dense-layer0": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, mlp_only_layers=[0]),
    "qwen3_moe-sparse-step-2": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, decoder_sparse_step=2, head_dim=24),
    "qwen2_moe-shared-expert": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen2_moe-no-bias": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32,
                              shared_expert_intermediate_size=40, qkv_bias=False),
    "gemma-mqa": dict(model_type="gemma", head_dim=32, num_key_value_heads=1),
    "gemma-untied-bias": dict(model_type="gemma", head_dim=48, tie_word_embeddings=False, attention_bias=True),
    "gemma2": dict(model_type="gemma2", head_dim=32),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=32),
    "gemma3_text-default-head-dim": dict(model_type="gemma3_text", attention_bias=True),
    "phi3": dict(model_type="phi3", pad_token_id=0, eos_token_id=0, bos_token_id=0),
    "phi3-mha-tied": dict(model_type="phi3", num_key_value_heads=4, tie_word_embeddings=True,
                          pad_token_id=0, eos_token_id=0, bos_token_id=0),
    "olmo2": dict(model_type="olmo2"),
    "olmo2-bias": dict(model_type="olmo2", attention_bias=True, head_dim=8),
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_group=2,
                        topk_group=1),
    "deepseek_v3-no-q-lora-bias": dict(model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32,
                                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                       first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, n_group=2, topk_group=1,
                                       attention_bias=True),
}
# GPT-style blocks, complete configs (their own names or transformers' aliases). mpt here is what
# transformers builds: its defaults (no_bias, ALiBi, expansion_ratio 4) are the fields it honours.
GPT_CONFIGS = {
    "mpt": dict(model_type="mpt", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256),
    "mpt-own-names-untied": dict(model_type="mpt", d_model=64, n_layers=2, n_heads=8, vocab_size=256,
                                 max_seq_len=128, tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                 n_positions=128),
    "gpt2-own-names-untied-n-inner-gelu": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=2, n_inner=96,
                                               vocab_size=256, activation_function="gelu",
                                               tie_word_embeddings=False),
}


def full_config(key: str) -> dict:
    return dict(GPT_CONFIGS[key]) if key in GPT_CONFIGS else {**BASE, **CONFIGS[key]}


def build_meta(cfg: dict):
    d = dict(cfg)
    mt = d.pop("model_type")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(mt, **d))


def measured(model, experts_per_token: int = 0, num_experts: int = 0) -> dict:
    """The numbers ModelSpec derives, read off a transformers model."""
    from shardwise.specs.hf_meta import decoder_layers

    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n.split("."))
    idle = experts * (num_experts - experts_per_token) // num_experts if num_experts else 0
    emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    positions = sum(m.weight.numel() for n, m in model.named_modules() if n.split(".")[-1] == "wpe")  # GPT-2
    return {
        "params": total,
        "hf_order": [p.numel() for p in model.parameters()],
        "hf_decayed": [weight_decayed(n, p.ndim) for n, p in model.named_parameters()],
        "largest_module": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        "layer_sizes": [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)],
        "active_params": total - idle,
        "expert_params": experts,
        "embedding_params": emb_in.numel() + (0 if emb_out is emb_in else emb_out.numel()) + positions,
    }


def spec_numbers(spec: ModelSpec) -> dict:
    return {
        "params": spec.params, "hf_order": list(spec.hf_order), "hf_decayed": list(spec.hf_decayed or ()),
        "largest_module": spec.largest_module,
        "layer_sizes": list(spec.layer_sizes), "active_params": spec.active_params,
        "expert_params": spec.expert_params, "embedding_params": spec.embedding_params,
    }


def attention_widths(model) -> dict:
    """q/k/v/o widths read from the first layer's attention modules."""
    from shardwise.specs.hf_meta import decoder_layers

    layer = decoder_layers(model)[0]
    a = getattr(layer, "self_attn", None) or layer.attn
    if hasattr(a, "qkv_proj"):  # phi3: fused [q | k | v]
        return {"q+2kv": a.qkv_proj.out_features, "o": a.o_proj.in_features}
    if hasattr(a, "Wqkv"):  # mpt: fused [q | k | v]
        return {"q+2kv": a.Wqkv.out_features, "o": a.out_proj.in_features}
    if hasattr(a, "c_attn"):  # gpt2: Conv1D weights are [in, out]
        return {"q+2kv": a.c_attn.weight.shape[1], "o": a.c_proj.weight.shape[0]}
    if hasattr(a, "kv_b_proj"):  # MLA: k expanded per head to qk_head_dim; kv_b = [k_nope | v] per head
        q = (a.q_b_proj if a.q_b_proj is not None else a.q_proj).out_features
        return {"q": q, "kv": a.num_heads * a.qk_head_dim, "v": a.num_heads * a.v_head_dim, "o": a.o_proj.in_features}
    return {"q": a.q_proj.out_features, "kv": a.k_proj.out_features, "v": a.v_proj.out_features,
            "o": a.o_proj.in_features}


@pytest.mark.parametrize("key", [*CONFIGS, *GPT_CONFIGS])
def test_family_matches_transformers(key: str) -> None:
    cfg = full_config(key)
    spec = ModelSpec.from_hf_dict(cfg, name=key)
    assert spec.family == cfg["model_type"]
    model = build_meta(cfg)
    want = measured(model, spec.experts_per_token, spec.num_experts)
    assert spec_numbers(spec) == want
    assert spec.params_per_layer == max(want["layer_sizes"])  # the largest decoder layer (FSDP unit)
    assert spec.layer_params + spec.root_params == spec.params
    # ZeRO-3 persistence sees every individual tensor: the inventory's tensors are the model's
    sizes: Counter = Counter()
    for n, k in spec.tensor_sizes():
        sizes[n] += k
    assert sizes == Counter(want["hf_order"])
    widths = attention_widths(model)
    if "q+2kv" in widths:
        assert widths == {"q+2kv": spec.q_dim + 2 * spec.kv_dim, "o": spec.o_dim}
    else:
        assert widths == {"q": spec.q_dim, "kv": spec.kv_dim, "v": spec.v_dim, "o": spec.o_dim}


@pytest.mark.parametrize("key", [*CONFIGS, *GPT_CONFIGS])
def test_to_hf_dict_builds_the_same_model(key: str) -> None:
    """to_hf_dict is what the trainer builds random-init models from: same counts, same order,
    and reading it back gives the same spec."""
    spec = ModelSpec.from_hf_dict(full_config(key), name=key)
    d = spec.to_hf_dict()
    json.dumps(d)  # plain JSON (export writes it as config.json)
    rebuilt = build_meta(d)
    assert [p.numel() for p in rebuilt.parameters()] == list(spec.hf_order)
    assert ModelSpec.from_hf_dict(d, name=key) == spec


@pytest.mark.parametrize("model_type", ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe",
                                        "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "deepseek_v3", "mpt",
                                        "gpt2"])
def test_transformers_defaults_for_omitted_fields(model_type: str) -> None:
    """A config.json with only the widths: the spec takes transformers' defaults for the rest
    (qwen3 head_dim 128, gemma head_dim 256 and tied embeddings, key/value heads, MoE/MLA
    sizes, gpt2's 1024 positions and 4h MLP, mpt's ALiBi without biases...). 32 heads: every
    family's default number of key/value heads divides it."""
    cfg = {"model_type": model_type, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 32,
           "intermediate_size": 96, "vocab_size": 256, "pad_token_id": 0, "eos_token_id": 0, "bos_token_id": 0}
    spec = ModelSpec.from_hf_dict(cfg)
    model = build_meta(cfg)
    assert spec_numbers(spec) == measured(model, spec.experts_per_token, spec.num_experts)


# ------------------------------------------------------------------ the meta-device path
def test_granite_is_read_on_the_meta_device_and_agrees_with_the_llama_derivation(tmp_path) -> None:
    """Granite is not an analytic family: its inventory comes from the meta-device model. Its
    modules are Llama's, so the analytic Llama spec of the same widths must agree exactly."""
    cfg = {**BASE, "model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
           "logits_scaling": 8.0, "attention_multiplier": 0.015625, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(path)
    assert spec.family == "hf" and spec.inventory is not None
    assert spec.inventory.model_type == "granite" and spec.inventory.layer_class == "GraniteDecoderLayer"
    model = build_meta(cfg)
    assert spec_numbers(spec) == measured(model)
    llama = ModelSpec.from_hf_dict({**cfg, "model_type": "llama"})
    assert spec_numbers(spec) == spec_numbers(llama)
    assert (spec.q_dim, spec.kv_dim, spec.intermediate_size, spec.tie_embeddings) == (64, 32, 96, True)
    assert ModelSpec.from_hf_dict(spec.to_hf_dict(), name=spec.name) == spec


def test_meta_path_moe_active_params() -> None:
    """OLMoE (routed experts, no analytic family): active = total minus the idle experts."""
    cfg = {**BASE, "model_type": "olmoe", "num_experts": 8, "num_experts_per_tok": 2}
    spec = ModelSpec.from_hf_dict(cfg)
    assert spec.family == "hf" and spec.is_moe and (spec.num_experts, spec.experts_per_token) == (8, 2)
    idle = (8 - 2) * 3 * 96 * 64 * 2  # (E - k) experts × SwiGLU (3·I·h) × 2 layers
    assert spec.params - spec.active_params == idle
    assert spec_numbers(spec) == measured(build_meta(cfg), 2, 8)


def test_meta_path_multimodal_reads_the_text_decoder() -> None:
    """A Gemma 3 image-text config: the text decoder's layers are the FSDP units and its
    widths the planner's; the vision tower is counted in the root group."""
    cfg = {"model_type": "gemma3", "mm_tokens_per_image": 4, "boi_token_index": 256, "eoi_token_index": 257,
           "image_token_index": 258,
           "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 300},
           "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "intermediate_size": 48, "image_size": 28, "patch_size": 14}}
    spec = ModelSpec.from_hf_dict(cfg)
    model = build_meta(cfg)
    assert spec.params == sum({id(p): p.numel() for p in model.parameters()}.values())
    assert (spec.hidden_size, spec.num_layers, spec.intermediate_size, spec.vocab_size) == (64, 2, 96, 300)
    assert spec.inventory.layer_class == "Gemma3DecoderLayer"
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.language_model.layers]
    assert list(spec.layer_sizes) == layers


def test_unknown_model_type_names_file_and_type(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, "model_type": "my-own-llm", "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    with pytest.raises(ShardwiseError) as e:
        ModelSpec.from_hf_config(path)
    msg = str(e.value)
    assert str(path) in msg and "'my-own-llm'" in msg and "transformers" in msg and "trust_remote_code" in msg


@pytest.mark.parametrize("model_type,expected", [
    ("t5", "causal-LM"),  # encoder-decoder: no AutoModelForCausalLM class
    ("vit", "causal-LM"),  # an image encoder
    ("mamba", "num_attention_heads"),  # a causal LM without attention heads
])
def test_not_a_decoder_only_transformer(model_type: str, expected: str, tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
                                "vocab_size": 256}))
    with pytest.raises(ShardwiseError) as e:
        ModelSpec.from_hf_config(path)
    assert str(path) in str(e.value) and model_type in str(e.value) and expected in str(e.value)


def test_meta_path_without_torch_is_a_clear_error(monkeypatch) -> None:
    from shardwise.specs import hf_meta

    hf_meta._spec.cache_clear()
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(ShardwiseError) as e:
        ModelSpec.from_hf_dict({**BASE, "model_type": "granite"}, source="cfg/config.json")
    msg = str(e.value)
    assert "cfg/config.json" in msg and "'granite'" in msg and "torch" in msg and "qwen3" in msg
    hf_meta._spec.cache_clear()


def test_analytic_families_need_no_torch() -> None:
    """Every analytic family (and the catalog) is derived without importing torch."""
    import subprocess

    code = ("import sys; from shardwise import catalog; from shardwise.specs import ModelSpec; "
            "[catalog.get_model(n).hf_order for n in catalog.model_names()]; "
            f"ModelSpec.from_hf_dict({json.dumps({**BASE, **CONFIGS['deepseek_v3']})}).params; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("bad,needle", [
    ({"model_type": "deepseek_v3", "kv_lora_rank": None}, "kv_lora_rank"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": "0"}, "mlp_only_layers"),
    ({"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 5}, "experts_per_token"),
    ({"model_type": "gemma", "head_dim": 2.5}, "head_dim"),
])
def test_bad_family_fields_are_named(bad: dict, needle: str) -> None:
    with pytest.raises(ShardwiseError) as e:
        ModelSpec.from_hf_dict({**BASE, **bad}, source="m/config.json")
    assert "m/config.json" in str(e.value) and needle in str(e.value)


def test_gemma2_final_logit_softcapping_follows_transformers() -> None:
    """Gemma2 caps its logits by default (30.0; a loss-side tensor the planner's logits need);
    the spec reads, defaults and writes it as transformers does."""
    for given, want in (({}, 30.0), ({"final_logit_softcapping": None}, 0.0), ({"final_logit_softcapping": 20}, 20.0)):
        spec = ModelSpec.from_hf_dict({**BASE, "model_type": "gemma2", **given})
        assert spec.final_logit_softcapping == want
        d = spec.to_hf_dict()
        rebuilt = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        assert (rebuilt.final_logit_softcapping or 0.0) == want


# ------------------------------------------------------------------ GPT-style blocks (mpt, gpt2)
@pytest.mark.parametrize("bad,needle", [
    ({"model_type": "mpt", "attn_config": {"attn_type": "multiquery_attention"}}, "attn_type"),
    ({"model_type": "mpt", "ffn_config": {"ffn_type": "mptglu"}}, "ffn_type"),
    ({"model_type": "mpt", "attn_config": {"qk_ln": True}}, "qk_ln"),
    ({"model_type": "mpt", "expansion_ratio": "4"}, "expansion_ratio"),
    ({"model_type": "mpt", "d_model": 32}, "d_model"),  # disagrees with its alias hidden_size 64
    ({"model_type": "gpt2", "activation_function": "swiglu"}, "activation_function"),
    ({"model_type": "gpt2", "add_cross_attention": True}, "add_cross_attention"),
    ({"model_type": "gpt2", "num_attention_heads": 5}, "num_heads"),
])
def test_bad_gpt_fields_are_named(bad: dict, needle: str) -> None:
    cfg = {k: v for k, v in BASE.items() if k not in ("num_key_value_heads", "intermediate_size")}
    with pytest.raises(ShardwiseError) as e:
        ModelSpec.from_hf_dict({**cfg, **bad}, source="m/config.json")
    assert "m/config.json" in str(e.value) and needle in str(e.value)


def test_mpt_fields_transformers_ignores_are_read_as_llm_foundry_builds_them() -> None:
    """transformers' MptForCausalLM has no learned position embedding (it always adds ALiBi), no
    biases and a 4h MLP whatever `learned_pos_emb`, `no_bias` and `expansion_ratio` say.
    llm-foundry, whose configs these are, builds them: a `wpe` of max_seq_len rows when
    learned_pos_emb and no ALiBi/RoPE, every linear and LayerNorm bias unless no_bias. The spec
    follows llm-foundry; the difference to what transformers builds is exactly those tensors."""
    h, L, P = 64, 2, 128
    foundry = dict(model_type="mpt", d_model=h, n_heads=4, n_layers=L, vocab_size=256, max_seq_len=P,
                   expansion_ratio=4, no_bias=False, learned_pos_emb=True, attn_config={"alibi": False})
    spec = ModelSpec.from_hf_dict(foundry)
    hf = build_meta(foundry)
    names = [n for n, _ in hf.named_parameters()]
    assert not any(n.endswith("bias") or "wpe" in n for n in names)  # transformers ignores the fields
    # biases: Wqkv 3h, out_proj h, up_proj 4h, down_proj h, two LayerNorms 2h per layer; norm_f h
    assert spec.params - measured(hf)["params"] == L * 11 * h + h + P * h
    assert spec.position_embedding_params == P * h and spec.learned_pos_emb and spec.norm_bias
    assert spec.hf_order[:2] == (256 * h, P * h)  # wte, wpe, then the layers (llm-foundry's order)
    assert ModelSpec.from_hf_dict(spec.to_hf_dict()) == spec
    # ALiBi or RoPE switch the learned positions off (llm-foundry's MPTConfig); so does the flag
    for attn in ({"alibi": True}, {"alibi": False, "rope": True}):
        assert not ModelSpec.from_hf_dict({**foundry, "attn_config": attn}).learned_pos_emb
    assert not ModelSpec.from_hf_dict({**foundry, "learned_pos_emb": False}).learned_pos_emb
    # transformers' defaults (no_bias true, alibi true): what MptForCausalLM builds
    plain = ModelSpec.from_hf_dict({k: v for k, v in foundry.items() if k not in ("no_bias", "attn_config")})
    assert not plain.learned_pos_emb and not plain.attention_bias


def test_mpt_published_num_params_are_exact() -> None:
    """llm-foundry's benchmark table prints each run's NumParams (its model with learned position
    embeddings of max_seq_len rows and biases): every converted run's spec reproduces it."""
    import re
    from pathlib import Path

    import yaml

    path = Path(__file__).parents[2] / "benchmarks/published/llm-foundry-mpt-benchmarks.yaml"
    runs = yaml.safe_load(path.read_text())["runs"]
    checked = set()
    for run in runs:
        published = int(re.findall(r"\|\s*(\d+)\s*\|\s*$", run["quote"].strip())[0])
        spec = ModelSpec.from_hf_dict(run["model"])
        assert spec.family == "mpt" and spec.params == published, (run["name"], spec.params, published)
        checked.add((spec.hidden_size, spec.max_position_embeddings))
    assert len(checked) == 37  # six sizes, 512 to 65536 tokens


def test_gpt2_spec_defaults_and_family_fields() -> None:
    """A gpt2 spec written field by field (catalog style) takes the family's fixed parts (biases,
    learned positions, MHA, 4h, gelu_new); GPT-style fields on other families are refused."""
    cfg = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    direct = ModelSpec(name="custom", family="gpt2", hidden_size=64, num_layers=2, num_heads=4, vocab_size=256,
                       max_position_embeddings=128, tie_embeddings=True)
    assert direct == ModelSpec.from_hf_dict(cfg)
    assert (direct.intermediate_size, direct.hidden_act, direct.num_kv_heads) == (256, "gelu_new", 4)
    assert direct.params == measured(build_meta(cfg))["params"]
    with pytest.raises(ShardwiseError, match="norm_bias"):
        ModelSpec(family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=96,
                  vocab_size=256, norm_bias=True)
    with pytest.raises(ShardwiseError, match="all or none"):
        ModelSpec(family="mpt", hidden_size=64, num_layers=2, num_heads=4, vocab_size=256, attention_bias=True)
    with pytest.raises(ShardwiseError, match="always has"):
        ModelSpec(**{**direct.model_dump(), "learned_pos_emb": False})
