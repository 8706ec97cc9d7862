"""Any decoder-only `transformers` architecture: its parameter inventory read from the model
built on the meta device (no memory, no weights, no remote code).

`ModelSpec.from_hf_dict` comes here for a `model_type` that is not an analytic family. The
model is `AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), trust_remote_code=False)`
under `torch.device("meta")`; the decoder layers are the text decoder's `layers` (or the
`nn.ModuleList` holding the most parameters). torch and transformers are imported here only,
inside functions, so `shardwise plan` stays importable without them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.specs.families import ANALYTIC_FAMILIES
from shardwise.specs.inventory import HFInventory, ParamTensor
from shardwise.specs.train import weight_decayed

# Config attributes (first one present wins) for the numbers the planner needs beyond the inventory.
_FFN = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")


def spec_fields_from_meta(cfg: dict, name: str = "custom", source: str = "config") -> dict:
    """The ModelSpec fields of `cfg` (a config.json dict) read from its meta-device model; a
    ShardwiseError naming `source`, the model_type and what is missing when that is impossible."""
    try:
        key = json.dumps(cfg, sort_keys=True)
    except (TypeError, ValueError):
        raise ShardwiseError(f"{source}: the config is not plain JSON data") from None
    return dict(_spec(key, name, source))  # a copy: the cached one stays as read


@lru_cache(maxsize=32)
def _spec(key: str, name: str, source: str) -> dict:
    cfg = json.loads(key)
    mt = cfg.get("model_type")
    families = ", ".join(ANALYTIC_FAMILIES)
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as e:
        raise ShardwiseError(
            f"{source}: field 'model_type' is {mt!r}, not an analytic family ({families}); other architectures "
            f"are read from the model built on the meta device, which needs torch and transformers "
            f"({e.name or e} is not installed)"
        ) from None
    ver = transformers.__version__
    if mt not in CONFIG_MAPPING_NAMES:
        raise ShardwiseError(
            f"{source}: field 'model_type' is {mt!r}: neither an analytic family ({families}) nor a model type "
            f"transformers {ver} knows (shardwise never runs a checkpoint's own code: trust_remote_code=False)"
        )
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ShardwiseError(
            f"{source}: model_type {mt!r} has no causal-LM class in transformers {ver} "
            "(AutoModelForCausalLM); shardwise plans decoder-only causal language models"
        )
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "auto_map")}
    try:
        hf_cfg = AutoConfig.for_model(mt, **kwargs)
    except Exception as e:  # transformers' own validation of the config
        raise ShardwiseError(f"{source}: transformers {ver} refused this {mt} config: {e}") from None
    if getattr(hf_cfg, "is_encoder_decoder", False):
        raise ShardwiseError(f"{source}: model_type {mt!r} is an encoder-decoder (is_encoder_decoder=true); "
                             "expected a decoder-only causal language model")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg, trust_remote_code=False)
    except Exception as e:
        raise ShardwiseError(f"{source}: transformers {ver} could not build {mt} from this config on the meta "
                             f"device ({type(e).__name__}: {e})") from None
    return _read(model, hf_cfg, cfg, name, source)


def decoder_layers(model: Any) -> Any:
    """The decoder's layer list: `get_decoder().layers`, else the nn.ModuleList with the most
    parameters (None if the model has none)."""
    import torch

    try:
        layers = getattr(model.get_decoder(), "layers", None)
    except Exception:  # some models have no decoder accessor
        layers = None
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def _width(tc: Any, names: tuple[str, ...], source: str, mt: str, what: str) -> int:
    for n in names:
        v = getattr(tc, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    raise ShardwiseError(f"{source}: the {mt} config has none of {', '.join(repr(n) for n in names)} "
                         f"(the planner needs {what}, a positive integer)")


def _first(tc: Any, names: tuple[str, ...]) -> int:
    for n in names:
        v = getattr(tc, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def _read(model: Any, hf_cfg: Any, cfg: dict, name: str, source: str) -> dict:
    mt = cfg["model_type"]
    layers = decoder_layers(model)
    if layers is None:
        raise ShardwiseError(f"{source}: the {mt} model has no list of decoder layers (nn.ModuleList); "
                             "expected a decoder-only transformer")
    in_layer: dict[int, tuple[int, str]] = {}
    for i, layer in enumerate(layers):
        for rel, m in layer.named_modules():
            in_layer[id(m)] = (i, rel or "(layer)")
    seen: set[int] = set()
    grouped: dict[tuple, int] = {}  # (relative name, weight, bias, extra) -> layers holding it
    root: list[ParamTensor] = []
    layer_sizes = [0] * len(layers)
    largest = experts = 0
    for qual, m in model.named_modules():
        direct = list(m.named_parameters(recurse=False))
        largest = max(largest, sum(p.numel() for _, p in direct))
        fresh = [(n, p.numel()) for n, p in direct if id(p) not in seen]  # tied: counted once
        seen.update(id(p) for _, p in direct)
        if not fresh:
            continue
        sizes = dict(fresh)
        w_name = "weight" if "weight" in sizes else fresh[0][0]
        weight, bias = sizes.pop(w_name), sizes.pop("bias", 0)
        extra = tuple(sizes.values())
        if "experts" in qual.split("."):  # routed experts (fused 3-D or a ModuleList of experts)
            experts += weight + bias + sum(extra)
        where = in_layer.get(id(m))
        if where is None:
            root.append(ParamTensor(name=qual, weight=weight, bias=bias, extra=extra, layer=False))
        else:
            layer_sizes[where[0]] += weight + bias + sum(extra)
            k = (where[1], weight, bias, extra)
            grouped[k] = grouped.get(k, 0) + 1
    tensors = tuple(ParamTensor(name=n, weight=w, bias=b, extra=x, count=c) for (n, w, b, x), c in grouped.items())
    hf_order = tuple(p.numel() for p in model.parameters())
    hf_decayed = tuple(weight_decayed(n, p.ndim) for n, p in model.named_parameters())  # the same order
    total = sum(hf_order)

    tc = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    h = _width(tc, ("hidden_size",), source, mt, "the hidden width")
    heads = _width(tc, ("num_attention_heads",), source, mt, "the number of attention heads")
    kv_heads = _first(tc, ("num_key_value_heads",)) or heads
    head_dim = _first(tc, ("head_dim",))
    ffn = _first(tc, _FFN)
    if not ffn and any(hasattr(tc, n) and getattr(tc, n) is None for n in _FFN):
        ffn = 4 * h  # GPT-2 / GPT-Neo / GPT-J: n_inner / intermediate_size None means 4·hidden
    if not ffn:
        _width(tc, _FFN, source, mt, "the MLP width")
    vocab = _width(tc, ("vocab_size",), source, mt, "the vocabulary size")
    n_exp, top_k = _first(tc, _EXPERTS), _first(tc, _TOP_K)
    if not (n_exp and top_k and experts):
        n_exp = top_k = 0
    active = total - experts * (n_exp - top_k) // n_exp if n_exp else total
    emb_in = model.get_input_embeddings()
    emb_out = model.get_output_embeddings()
    tied = emb_out is not None and emb_out.weight is emb_in.weight
    embedding = emb_in.weight.numel() + (0 if tied or emb_out is None else emb_out.weight.numel())
    inventory = HFInventory(
        model_type=mt, layer_class=type(layers[0]).__name__, tensors=(*tensors, *root), hf_order=hf_order,
        layer_sizes=tuple(layer_sizes), largest_module=largest, active_params=active, expert_params=experts,
        embedding_params=embedding, config_json=json.dumps(cfg, sort_keys=True), hf_decayed=hf_decayed,
    )
    return dict(
        name=name, family="hf", hidden_size=h, num_layers=len(layers), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab, tie_embeddings=tied,
        num_experts=n_exp, experts_per_token=top_k, moe_intermediate_size=_first(tc, ("moe_intermediate_size",)),
        max_position_embeddings=_first(tc, ("max_position_embeddings",)) or 4096, inventory=inventory,
    )
