"""LoRA adapters: which matrices get them and how many trainable parameters they add. Pure.

One place for the adapter count, shared by the communication model (plan/comm.py: only
adapter gradients are reduced), the memory model (plan/memory.py `_lora`) and step time.

A LoRA adapter of rank r on a linear d_in → d_out is two matrices, A (r × d_in) and
B (d_out × r): r·(d_in + d_out) parameters (PEFT `LoraLayer`). PEFT keeps them in fp32 under
a bf16/fp16 base (`autocast_adapter_dtype=True`, its default).

Targets are names matched as PEFT matches a list of names: a module whose qualified name is the
target or ends with "." + the target (`peft.tuners.tuners_utils.check_target_module_exists`),
so "gate_proj" also adapts Qwen2-MoE's `mlp.shared_expert.gate_proj`. Module targets are the
`nn.Linear`s each family's `transformers` decoder layer holds:

- Llama, Mistral, Qwen2/3, Gemma 1/2/3, OLMo 2: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj
- Phi-3: self_attn.qkv_proj (h → q + 2·kv), self_attn.o_proj, mlp.gate_up_proj (h → 2I), mlp.down_proj
- DeepSeek-V3 (MLA): self_attn.q_a_proj, q_b_proj (q_proj when q_lora_rank is 0),
  kv_a_proj_with_mqa, kv_b_proj, o_proj (heads·v_head_dim → h); dense layers mlp.{gate,up,down}_proj,
  MoE layers mlp.shared_experts.{gate,up,down}_proj
- MoE layers: Mixtral and Qwen3-MoE no MLP linears; Qwen2-MoE mlp.shared_expert.{gate,up,down}_proj
  and mlp.shared_expert_gate (h → 1)
- GPT-2: attn.c_attn (h → 3h), attn.c_proj, mlp.c_fc (h → I), mlp.c_proj (Conv1D: PEFT adapts them too);
  MPT: attn.Wqkv (h → 3h), attn.out_proj, ffn.up_proj (h → I), ffn.down_proj
- meta-path models (family "hf"): the inventory's layer modules, a linear taken as h → n/h
  (n/h → h for names ending in o_proj/down_proj/out_proj/c_proj/fc2/wo/w2 or dense_4h_to_h).

Routed experts are fused 3-D parameters in transformers 5.x (no Linear) and the routers are not
Linear either, so the default targets (q/k/v/o) never reach them. But PEFT (0.21, with
transformers 5: `peft/utils/transformers_weight_conversion.py`) rewrites the transformers-4
expert names for the model types transformers converts checkpoints of (here qwen3_moe and
deepseek_v3, pattern qwen2_moe: gate_proj, up_proj, down_proj, gate; mixtral: w1, w3, w2, gate)
into `target_parameters` on the fused tensors, and drops those names from the module targets
(the dense layers' and shared experts' Linears of the same name are then NOT adapted):
gate_proj + up_proj (both or PEFT refuses) → experts.gate_up_proj [E, 2I, h] at rank 2r, down_proj
→ experts.down_proj [E, h, I] at rank r, one A/B pair per expert (A: rank·E × d_in, B: d_out ×
rank·E), gate → the router weight [E, h]. Qwen2-MoE itself is not converted (its experts are not
targeted). Meta-path MoE models: experts are not counted.
"""

from __future__ import annotations

from typing import NamedTuple

from shardwise.errors import ShardwiseError
from shardwise.plan.pipeline import PipelineRank, pipeline_ranks
from shardwise.specs.families import root_modules
from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec

# (qualified name inside the decoder layer, d_in, d_out)
Linear = tuple[str, int, int]
_GPT_LINEARS = {"gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
                "mpt": ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")}
_TO_HIDDEN = ("o_proj", "down_proj", "out_proj", "c_proj", "fc2", "wo", "w2", "dense_4h_to_h")


def layer_linears(model: ModelSpec, moe: bool = False) -> list[Linear]:
    """Every nn.Linear of one decoder layer of the given kind (routed experts or a dense MLP),
    by its name inside the layer, as transformers builds it."""
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.family
    if f == "hf":
        return _inventory_linears(model)
    if f in _GPT_LINEARS:  # fused qkv, attention output, fc1, fc2 (gpt2: Conv1D, which PEFT adapts alike)
        qkv, out, fc1, fc2 = _GPT_LINEARS[f]
        i = model.intermediate_size
        return [(qkv, h, q + 2 * kv), (out, model.o_dim, h), (fc1, h, i), (fc2, i, h)]
    if model.is_mla:
        attn: list[Linear] = (
            [("self_attn.q_a_proj", h, model.q_lora_rank), ("self_attn.q_b_proj", model.q_lora_rank, q)]
            if model.q_lora_rank else [("self_attn.q_proj", h, q)])
        attn += [("self_attn.kv_a_proj_with_mqa", h, model.kv_lora_rank + model.qk_rope_head_dim),
                 ("self_attn.kv_b_proj", model.kv_lora_rank,
                  model.num_heads * (model.qk_nope_head_dim + model.v_head_dim)),
                 ("self_attn.o_proj", model.o_dim, h)]
    elif f == "phi3":
        attn = [("self_attn.qkv_proj", h, q + 2 * kv), ("self_attn.o_proj", q, h)]
    else:
        attn = [("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
                ("self_attn.o_proj", model.o_dim, h)]
    mlp: list[Linear] = []
    s = model.shared_expert_intermediate_size
    if not moe:
        i = model.intermediate_size
        mlp = ([("mlp.gate_up_proj", h, 2 * i), ("mlp.down_proj", i, h)] if f == "phi3" else
               [("mlp.gate_proj", h, i), ("mlp.up_proj", h, i), ("mlp.down_proj", i, h)])
    elif f == "qwen2_moe" and s:
        mlp = [("mlp.shared_expert.gate_proj", h, s), ("mlp.shared_expert.up_proj", h, s),
               ("mlp.shared_expert.down_proj", s, h), ("mlp.shared_expert_gate", h, 1)]
    elif f == "deepseek_v3" and s:
        mlp = [("mlp.shared_experts.gate_proj", h, s), ("mlp.shared_experts.up_proj", h, s),
               ("mlp.shared_experts.down_proj", s, h)]
    return attn + mlp  # mixtral, qwen3_moe MoE layers: router and fused experts only, no Linear


def _inventory_linears(model: ModelSpec) -> list[Linear]:
    """Meta-path models: the layer modules of the inventory that hold a weight whose size is a
    multiple of h (no norms: their weight is h itself), without biases' shapes to go by."""
    h = model.hidden_size
    assert model.inventory is not None
    out: dict[str, Linear] = {}
    for t in model.inventory.tensors:
        name = t.name
        if not t.layer or t.extra or "experts" in name.split(".") or t.weight % h or t.weight <= h:
            continue
        other = t.weight // h
        if t.bias not in (0, h, other):
            continue
        leaf = name.rsplit(".", 1)[-1]
        out.setdefault(name, (name, other, h) if leaf in _TO_HIDDEN else (name, h, other))
    return list(out.values())


def matches(name: str, target: str) -> bool:
    """PEFT's rule for a list of target names: the module's name is the target or ends with
    "." + the target."""
    return name == target or name.endswith("." + target)


class Adapter(NamedTuple):
    """One LoRA adapter of a decoder layer: A (rank·r·copies × d_in) and B (d_out × rank·r·copies)."""

    name: str  # the adapted module or parameter inside the layer
    d_in: int
    d_out: int
    rank: int = 1  # multiple of r (PEFT doubles it on the fused gate_up experts)
    copies: int = 1  # routed experts: one A/B pair per expert

    def params(self, r: int) -> int:
        return r * self.rank * self.copies * (self.d_in + self.d_out)


# PEFT's transformers-5 rewrite of expert target names (old name → fused parameter), per analytic
# family it applies to (transformers' conversion pattern qwen2_moe, and PEFT's own mixtral entry).
_PEFT_EXPERT_NAMES = {
    "qwen3_moe": {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                  "down_proj": "down_proj"},
    "mixtral": {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
}
_PEFT_EXPERT_NAMES["deepseek_v3"] = _PEFT_EXPERT_NAMES["qwen3_moe"]


def _split_targets(model: ModelSpec, targets: tuple[str, ...] | list[str]) -> tuple[list[str], set[str]]:
    """(module targets, fused expert parameters targeted) after PEFT's rewrite of expert names."""
    names = _PEFT_EXPERT_NAMES.get(model.family)
    if not names:
        return list(targets), set()
    modules, params, fused = [], set(), set()
    for t in targets:
        old = next((o for o in names if matches(t, o)), None)
        if old is None:
            modules.append(t)
            continue
        params.add(names[old])
        if names[old] == "gate_up_proj":
            fused.add(old)
    pair = {o for o, n in names.items() if n == "gate_up_proj"}
    if fused and fused != pair:
        missing = ", ".join(sorted(pair - fused))
        raise ShardwiseError(
            f"LoRA targets {', '.join(sorted(fused))} without {missing}: for {model.family}, PEFT (with transformers "
            f"5) maps them onto the fused experts' gate_up_proj and refuses one without the other; target both or "
            "neither")
    return modules, params


ALL_LINEAR = "all-linear"


def expand_targets(model: ModelSpec, targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """PEFT's `all-linear` (`_maybe_include_all_linear_layers`): the last name component of every
    linear in the decoder layers (dense and MoE kinds), the output layer excluded; other target
    lists as given."""
    if ALL_LINEAR not in targets:
        return tuple(targets)
    kinds = {False, True} if model.is_moe else {False}
    return tuple(sorted({name.rsplit(".", 1)[-1] for moe in kinds for name, _, _ in layer_linears(model, moe)}))


def adapters(model: ModelSpec, targets: tuple[str, ...] | list[str], moe: bool = False) -> list[Adapter]:
    """The adapters a target list puts on one decoder layer of the given kind (each once)."""
    modules, params = _split_targets(model, expand_targets(model, targets))
    out = [Adapter(name, d_in, d_out) for name, d_in, d_out in layer_linears(model, moe)
           if any(matches(name, t) for t in modules)]
    if moe and params:
        h, e, i = model.hidden_size, model.num_experts, model.expert_width
        if "gate.weight" in params:
            out.append(Adapter("mlp.gate.weight", h, e))
        if "gate_up_proj" in params:
            out.append(Adapter("mlp.experts.gate_up_proj", h, 2 * i, rank=2, copies=e))
        if "down_proj" in params:
            out.append(Adapter("mlp.experts.down_proj", i, h, copies=e))
    return out


def target_dims(model: ModelSpec, moe: bool | None = None) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of every linear LoRA can target in one decoder layer, by its last name
    component (a target list of such names is what PEFT users write). `moe`: the layer kind
    (default: routed experts if the model has any, like `activations.layer_saved_per_token`).
    What a target list actually adapts (PEFT's expert rewrite included) is `adapters`."""
    if moe is None:
        moe = model.is_moe
    return {name.rsplit(".", 1)[-1]: (d_in, d_out) for name, d_in, d_out in layer_linears(model, moe)}


def _adapted_layers(model: ModelSpec, targets: tuple[str, ...]) -> dict[Adapter, int]:
    """Each adapter and how many decoder layers hold it."""
    count: dict[Adapter, int] = {}
    if model.inventory is not None:  # grouped over the layers by the inventory
        layers = {(t.name, t.weight): t.count for t in model.inventory.tensors if t.layer}
        for a in adapters(model, targets):
            count[a] = layers.get((a.name, a.d_in * a.d_out), model.num_layers)
        return count
    kinds = model.moe_layers
    for moe in set(kinds):
        for a in adapters(model, targets, moe):
            count[a] = count.get(a, 0) + kinds.count(moe)
    return count


def _layer_adapters(model: ModelSpec, train: TrainSpec) -> list[float]:
    """Adapter parameters of each decoder layer, in order (meta-path models: the average)."""
    r = train.lora_rank
    if model.inventory is not None:
        total = sum(a.params(r) * n for a, n in _adapted_layers(model, train.lora_targets).items())
        return [total / model.num_layers] * model.num_layers
    kinds = model.moe_layers
    per = {moe: sum(a.params(r) for a in adapters(model, train.lora_targets, moe)) for moe in set(kinds)}
    return [per[moe] for moe in kinds]


def adapter_tensors(model: ModelSpec, train: TrainSpec, tp: int = 1) -> list[tuple[float, float]]:
    """(elements on one TP rank, tensors per decoder layer) of each adapter matrix (A and B of
    every adapter); where dense and MoE layers differ, the tensors per layer are the average
    over the layers (the fraction of layers holding it). Targets the model does not have are
    ignored."""
    r = train.lora_rank
    if not r:
        return []
    out: list[tuple[float, float]] = []
    for a, n in _adapted_layers(model, train.lora_targets).items():
        per, width = n / model.num_layers, r * a.rank * a.copies
        out += [(width * a.d_in / tp, per), (width * a.d_out / tp, per)]
    return out


def adapter_params_per_layer(model: ModelSpec, train: TrainSpec) -> float:
    """Trainable parameters LoRA adds to the largest decoder layer."""
    return max(_layer_adapters(model, train))


def _held_layers(model: ModelSpec, pp: int, virtual: int, rank: PipelineRank | None) -> list[tuple[int, ...]]:
    """The decoder layers of pipeline rank `rank`, or of every pipeline rank (the split the
    trainer runs: plan.pipeline) where none is named."""
    if rank is not None:
        return [rank.layers]
    return [r.layers for r in pipeline_ranks(model.num_layers, pp, virtual)]


def adapter_params(model: ModelSpec, train: TrainSpec, tp: int = 1, pp: int = 1, virtual: int = 1,
                   rank: PipelineRank | None = None) -> float:
    """Trainable adapter parameters one GPU's model replica holds: the layers of pipeline rank
    `rank` (default: the fullest of pp ranks with `virtual` stages each), split over the TP ranks
    (0 without LoRA)."""
    if not train.lora_rank:
        return 0.0
    per_layer = _layer_adapters(model, train)
    return max(sum(per_layer[i] for i in layers) for layers in _held_layers(model, pp, virtual, rank)) / tp


def saved_module_params(model: ModelSpec, names: tuple[str, ...] | list[str], tp: int = 1) -> float:
    """Parameters of the `modules_to_save` PEFT trains in full (a trainable copy of each, beside
    the frozen original): modules outside the decoder layers, by name (PEFT's match). lm_head
    counts V·h even where it is tied to the embedding (the copy is its own tensor)."""
    if not names:
        return 0.0
    h, v = model.hidden_size, model.vocab_size
    sizes = {n.rsplit(".", 1)[-1]: w + b for n, w, b in root_modules(model)} | {"lm_head": v * h}
    total = 0.0
    for name in names:
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in sizes:
            raise ShardwiseError(
                f"lora.modules_to_save: {name!r} is not a module the planner knows outside the decoder layers of "
                f"{model.name}; expected one of {', '.join(sorted(sizes))}")
        total += sizes[leaf] / (tp if leaf in ("lm_head", "embed_tokens", "wte") else 1)
    return total


def trainable_params(model: ModelSpec, train: TrainSpec, tp: int = 1, pp: int = 1, virtual: int = 1,
                     rank: PipelineRank | None = None) -> float:
    """What a LoRA run trains on one GPU: the adapters (`adapter_params`) plus the
    `modules_to_save` copies (all of them, wherever the pipeline puts them: an upper bound)."""
    return adapter_params(model, train, tp, pp, virtual, rank) + saved_module_params(model, train.lora_modules_to_save, tp)


def linear_weight_params(model: ModelSpec, tp: int = 1, pp: int = 1, virtual: int = 1,
                         rank: PipelineRank | None = None) -> float:
    """Weights of the decoder layers' nn.Linear modules on one GPU (pipeline rank `rank`, default
    the fullest): what QLoRA stores in 4-bit. Routed experts (fused 3-D parameters) and the
    routers are not Linear modules and stay in the compute dtype."""
    per = {moe: sum(d_in * d_out for _, d_in, d_out in layer_linears(model, moe)) for moe in set(model.moe_layers)}
    kinds = model.moe_layers
    return max(sum(per[kinds[i]] for i in layers) for layers in _held_layers(model, pp, virtual, rank)) / tp


# LoRA dropout (PEFT `lora_dropout` > 0: `lora_B(lora_A(dropout(x)))` in each adapted Linear,
# peft/tuners/lora/layer.py `Linear.forward`). On CUDA `F.dropout` runs aten's fused native_dropout,
# which keeps a bool mask (one byte an element) for backward; lora_A then saves the dropped copy
# instead of x. Where an adapted linear's input is a tensor nothing but the adapters keep (the
# norm output q/k/v and gate/up read, the MLP product down_proj reads), x itself is no longer
# saved; the attention output o_proj reads stays saved by the attention kernel.
DROPOUT_MASK_BYTES = 1
# the adapted linears whose input only the adapters keep in a LoRA run, by the input they read:
# the attention block's (a norm output, or OLMo 2's residual), the MLP's, the MLP's middle
_ATTN_IN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj", "attn.c_attn",
            "attn.Wqkv")
_MLP_IN = ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj", "mlp.c_fc", "ffn.up_proj")
_MLP_MID = ("mlp.down_proj", "mlp.c_proj", "ffn.down_proj")
_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "c_proj")


def dropout_saved_per_token(model: ModelSpec, train: TrainSpec, tp: int = 1, autocast: bool = False,
                            moe: bool = False, sp_shards: int = 1,
                            mask_bytes: float = DROPOUT_MASK_BYTES) -> float:
    """Bytes per token LoRA dropout adds to what one decoder layer (of kind `moe`) saves, against
    the same run without it: per adapted Linear the mask over its input (`mask_bytes` an element;
    CPU's dropout keeps a noise tensor of the input's dtype instead) and, outside autocast, the
    dropped copy lora_A saves (the compute dtype: the adapters run in it), less the input it no
    longer saves where only the adapters kept it (the activations plan counts that input once).
    Under torch.autocast lora_A saves its own bf16 cast whether or not the input was dropped: the
    mask alone. Row-parallel inputs are split over `tp`, the norm outputs over `sp_shards`.
    Dense layers of the families with a known layout get the subtraction; the others (MLA, MoE
    layers, meta-path models) keep the x they do not save, an overestimate. PEFT refuses dropout
    on adapted fused expert parameters (its ParamWrapper: `lora_dropout != 0`): refused here too."""
    if not train.lora_rank or not train.lora_dropout:
        return 0.0
    c = train.compute_bytes
    out, groups = 0.0, set()
    for a in adapters(model, train.lora_targets, moe):
        if a.copies > 1 or a.name.endswith(".weight"):
            raise ShardwiseError(f"lora_dropout {train.lora_dropout} with LoRA on {model.name}'s fused experts "
                                 f"({a.name}): PEFT's ParamWrapper refuses lora_dropout != 0 there; set it to 0 "
                                 "or target the Linear modules only")
        width = a.d_in / (tp if a.name.rsplit(".", 1)[-1] in _ROW_PARALLEL else 1)
        out += (mask_bytes if autocast else c + mask_bytes) * width
        if not autocast and not moe and not model.is_mla and model.family != "hf":
            groups |= {g for g, names in (("attn", _ATTN_IN), ("mlp", _MLP_IN), ("mid", _MLP_MID))
                       if a.name in names}
    h = model.hidden_size
    if "mid" in groups and model.hidden_act in ("relu", "tanh", "sigmoid") and model.is_gpt:
        groups.discard("mid")  # the activation keeps its output (fc2's input) itself
    width = {"attn": h / sp_shards, "mlp": h / sp_shards, "mid": model.intermediate_size / tp}
    return out - sum(c * width[g] for g in groups)
