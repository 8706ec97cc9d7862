"""Which matmuls torchtitan's per-op selective activation checkpointing keeps and which it
replays (pure, no torch): `mm_order` lists a decoder layer's `aten.mm` calls in forward order,
the policy keeps every second one; `plan/activations.py` counts the kept outputs' bytes,
`plan/flops.py` the replayed weights' FLOPs (`selective_replayed_params`)."""

from __future__ import annotations

from shardwise.specs.families import attention_modules, dense_mlp_modules, layer_modules
from shardwise.specs.model import ModelSpec


def mm_order(model: ModelSpec, moe: bool = False) -> list[tuple[str, float, bool, int]]:
    """One decoder layer's matmuls that dispatch to `aten.mm`, in forward order, as (module,
    output width per token, split by TP, output bytes; 0 = the compute dtype). Linears with a
    bias run `aten.addmm` and routed experts `grouped_mm`: neither is in torchtitan's save list,
    so they are replayed and not counted. Orders (HF modeling files):

    - Llama/Mistral/Qwen3/Gemma/OLMo 2: q k v o gate up down (q/k/v with bias: o gate up down)
    - Phi-3: qkv_proj o_proj gate_up_proj down_proj
    - DeepSeek-V3 (MLA): q_a q_b (or q) kv_a kv_b o, then gate up down (dense) or the router
      (fp32) and shared_experts gate up down (MoE)
    - Mixtral/Qwen3-MoE: q k v o router; Qwen2-MoE: o (q/k/v biased) shared_expert gate up
      down, router, shared_expert_gate
    - MPT: Wqkv out_proj up_proj down_proj (without biases; with llm-foundry's biases none);
      GPT-2: none (every Conv1D runs addmm). The eager attention's 4-D matmuls run bmm.
    """
    h, f = model.hidden_size, model.family
    if model.is_gpt:
        if model.attention_bias:  # all linears biased (mpt: no_bias false; gpt2 always)
            return []
        i = model.intermediate_size
        return [(name, width, split, 0) for (name, *_), width, split in
                zip(attention_modules(model) + dense_mlp_modules(model), (model.q_dim + 2 * model.kv_dim, h, i, h),
                    (True, False, True, False), strict=True)]
    biased = {name: b > 0 for name, _, b in attention_modules(model)} if f != "hf" else {}
    out: list[tuple[str, float, bool, int]] = []

    def mm(name: str, width: float, split: bool = True, nbytes: int = 0) -> None:
        if not biased.get(name):
            out.append((name, width, split, nbytes))

    if model.is_mla:
        if model.q_lora_rank:
            mm("q_a_proj", model.q_lora_rank, False)
            mm("q_b_proj", model.q_dim)
        else:
            mm("q_proj", model.q_dim)
        mm("kv_a_proj_with_mqa", model.kv_lora_rank + model.qk_rope_head_dim, False)
        mm("kv_b_proj", model.num_heads * (model.qk_nope_head_dim + model.v_head_dim))
        mm("o_proj", h, False)
    elif f == "phi3":
        mm("qkv_proj", model.q_dim + 2 * model.kv_dim)
        mm("o_proj", h, False)
    else:
        for name, width in (("q_proj", model.q_dim), ("k_proj", model.kv_dim), ("v_proj", model.kv_dim)):
            mm(name, width)
        mm("o_proj", h, False)
    shared = model.shared_expert_intermediate_size
    if moe:
        if f == "qwen2_moe":
            if shared:
                mm("shared_expert.gate_proj", shared)
                mm("shared_expert.up_proj", shared)
                mm("shared_expert.down_proj", h, False)
            mm("router", model.num_experts, False)
            if shared:
                mm("shared_expert_gate", 1, False)
        elif f == "deepseek_v3":
            mm("router", model.num_experts, False, 4)
            mm("shared_experts.gate_proj", shared)
            mm("shared_experts.up_proj", shared)
            mm("shared_experts.down_proj", h, False)
        else:
            mm("router", model.num_experts, False)
    elif f == "phi3":
        mm("gate_up_proj", 2 * model.intermediate_size)
        mm("down_proj", h, False)
    elif not model.mlp_bias:
        mm("gate_proj", model.intermediate_size)
        mm("up_proj", model.intermediate_size)
        mm("down_proj", h, False)
    return out


def selective_replayed_params(model: ModelSpec, moe: bool | None = None) -> float:
    """Weights per decoder layer whose forward matmul torchtitan's per-op policy replays in
    backward (for FLOPs: 2 per weight per token): every matmul weight of the layer — routed
    experts as the k a token visits — except those of the kept mms (1st, 3rd, ... of
    `mm_order`). Meta-path models use the Llama block at their widths."""
    if moe is None:
        moe = model.is_moe
    weights: dict[str, float]
    if model.family == "hf":
        h, i = model.hidden_size, model.expert_width if moe else model.intermediate_size
        weights = {"q_proj": h * model.q_dim, "k_proj": h * model.kv_dim, "v_proj": h * model.kv_dim,
                   "o_proj": model.q_dim * h}
        if moe:
            weights |= {"router": model.num_experts * h, "experts": model.experts_per_token * 3 * i * h}
        else:
            weights |= {"gate_proj": h * i, "up_proj": h * i, "down_proj": i * h}
    elif model.is_gpt:
        weights = {name: w for name, w, _ in attention_modules(model) + dense_mlp_modules(model)}
    else:
        weights = {name: w for name, w, _ in layer_modules(model, moe) if not name.endswith("norm")}
        if moe:  # gate_up (weight) and down (bias slot) of the k experts a token visits
            experts = next((w, b) for name, w, b in layer_modules(model, moe) if name == "experts")
            weights["experts"] = sum(experts) * model.experts_per_token / model.num_experts
    kept = sum(weights.get(name, 0) for i, (name, *_) in enumerate(mm_order(model, moe)) if i % 2 == 0)
    return sum(weights.values()) - kept
