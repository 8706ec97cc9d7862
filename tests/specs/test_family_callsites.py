"""Call sites that assumed the Llama block, checked per family against what actually runs.

- FLOPs (`plan/flops.py`): torch's FlopCounterMode counts the matmuls of one forward + backward
  of a tiny model of each family (and, for selective checkpointing, the matmuls torchtitan's
  per-op policy replays); the attention term by hand from published configs.
- LoRA (`plan/lora.py`): PEFT's trainable parameter count on the model transformers builds on
  the meta device, for the same target names.
- FSDP wrap class (`emit/accelerate.py`): the class of the decoder layers transformers builds.

Expected numbers come from those tools or from the configs by hand, never from the code under
test.
"""

from __future__ import annotations

import warnings

import pytest

from shardwise.catalog import build_hardware, get_model
from shardwise.errors import ShardwiseError
from shardwise.specs import ModelSpec, Strategy, TrainSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from shardwise.bench import saved  # noqa: E402  (needs torch)
from shardwise.plan.flops import flops_per_token, model_flops_per_token  # noqa: E402
from shardwise.plan.lora import adapter_params, adapter_tensors  # noqa: E402

LAYERS = 3  # deepseek / qwen3-moe shapes: layer 0 dense, layers 1-2 MoE


def _build(cfg: dict, attention: str = "eager", device: str = "cpu"):
    d = dict(cfg)
    config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    config._attn_implementation = attention
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config).train()


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """aten._grouped_mm (transformers 5.x fused experts): each row of a 2-D input meets one
    expert's [K, N] matrix (forward, input gradient); 2-D x 2-D with offsets over the shared
    dimension is the per-expert weight gradient. Either way 2·M·K·N over all rows."""
    if len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _measured_flops(model, vocab: int, seq: int, batch: int = 2) -> float:
    """Matmul FLOPs per token of one forward + backward, as torch counts them; recomputation
    runs to the end of each checkpointed layer (torchtitan's default early_stop=False)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
    with counter, set_checkpoint_early_stop(False):
        model(input_ids=ids).logits.float().sum().backward()
    return counter.get_total_flops() / (batch * seq)


def _not_matmul_params(model) -> int:
    """Parameters a token does not multiply through a matmul but 6·Ψ counts: norm weights and
    biases (PaLM's 6N counts every non-embedding parameter)."""
    n = 0
    for m in model.modules():
        direct = dict(m.named_parameters(recurse=False))
        if "norm" in type(m).__name__.lower():
            n += sum(p.numel() for p in direct.values())
        elif "bias" in direct:
            n += direct["bias"].numel()
    return n


# ---------------------------------------------------------------------------- 1. FLOPs


def test_attention_term_by_hand_from_published_configs():
    """3·L·s·(q_dim + o_dim) per token: QKᵀ over the q/k head width, PV over the v width."""
    ds = get_model("deepseek-v3")  # 61 layers, 128 heads, qk_nope 128 + qk_rope 64, v_head_dim 128
    per_s = model_flops_per_token(ds, 4097) - model_flops_per_token(ds, 4096)
    assert per_s == 3 * 61 * (128 * (128 + 64) + 128 * 128)
    llama = get_model("llama-2-7b")  # 32 layers, 32 heads of 128: 6·L·d·s as before
    assert model_flops_per_token(llama, 2049) - model_flops_per_token(llama, 2048) == 6 * 32 * 4096


def _flops_case(shape: str) -> dict:
    return {**saved.SHAPES[shape], "num_hidden_layers": LAYERS}


FLOPS_CASES = {shape: _flops_case(shape) for shape in saved.SHAPES}
# MLA with v_head_dim (16) != qk_nope + qk_rope (32): q_dim 128, o_dim 64; all layers dense.
FLOPS_CASES["mla-v16-dense"] = {**saved.SHAPES["tiny-deepseek-v3"], "num_hidden_layers": LAYERS, "v_head_dim": 16,
                                "first_k_dense_replace": LAYERS}


@pytest.mark.parametrize("case", list(FLOPS_CASES))
def test_model_flops_match_torch_flop_counter(case):
    """Eager attention computes the whole s×s square: the measured growth with s is twice the
    planner's causal 3·L·(q_dim + o_dim); the rest is 6 per matmul weight a token uses (top-k
    experts), to which 6·Ψ adds the norms and biases."""
    cfg = FLOPS_CASES[case]
    spec = ModelSpec.from_hf_dict(cfg)
    model = _build(cfg, "eager")
    s1, s2 = 32, 64
    f1, f2 = _measured_flops(model, cfg["vocab_size"], s1), _measured_flops(model, cfg["vocab_size"], s2)
    measured_per_s = (f2 - f1) / (s2 - s1)
    planned_per_s = (model_flops_per_token(spec, s2) - model_flops_per_token(spec, s1)) / (s2 - s1)
    assert measured_per_s == 2 * planned_per_s
    measured_fixed = f1 - measured_per_s * s1
    planned_fixed = model_flops_per_token(spec, s1) - planned_per_s * s1
    assert planned_fixed == measured_fixed + 6 * _not_matmul_params(model)


@pytest.mark.parametrize("shape", list(saved.SHAPES))
def test_selective_replay_flops_match_torchtitan_policy(shape):
    """torchtitan's per-op policy (shardwise.bench.saved.torchtitan_sac_context) on every layer:
    the matmuls replayed in backward, counted by torch, against flops_per_token's selective
    extra. Eager attention (Gemma2) also replays its score and value bmm's: the full square,
    twice the causal count the planner adds."""
    cfg, seq = _flops_case(shape), 64
    attention = saved.attentions(shape)[0]
    spec = ModelSpec.from_hf_dict(cfg)

    def measure(ckpt: str) -> float:
        model = saved.build_model(shape, LAYERS, "fp32", attention, ckpt)
        return _measured_flops(model, cfg["vocab_size"], seq)

    replayed = measure("selective") - measure("none")
    planned = flops_per_token(spec, seq, "selective", attention) - flops_per_token(spec, seq)
    if attention == "eager":
        attention_replay = flops_per_token(spec, seq, "selective", "eager") - flops_per_token(spec, seq, "selective")
        planned += attention_replay  # eager's full square = 2x the causal count
    assert replayed == planned


def test_full_checkpointing_replays_one_forward():
    spec = get_model("deepseek-v3")
    assert flops_per_token(spec, 4096, "full") == pytest.approx(model_flops_per_token(spec, 4096) * 8 / 6)


# ---------------------------------------------------------------------------- 2. LoRA vs PEFT

TARGET_LISTS = [
    ("q_proj", "k_proj", "v_proj", "o_proj"),  # TrainSpec's default
    ("gate_proj", "up_proj", "down_proj"),
    ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # Phi-3's fused names
    ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),  # MLA
    ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    ("gate_proj", "up_proj", "o_proj"),
    ("down_proj",),
    ("gate",),  # MoE routers
    ("w1", "w2", "w3"),  # Mixtral's transformers-4 expert names
    ("shared_expert_gate", "shared_expert.up_proj"),
    ("c_attn", "c_proj", "c_fc"),  # GPT-2
    ("Wqkv", "out_proj", "up_proj", "down_proj"),  # MPT
]
LORA_CASES = {shape: _flops_case(shape) for shape in saved.SHAPES}
LORA_CASES["mla-full-rank-q"] = {**_flops_case("tiny-deepseek-v3"), "q_lora_rank": None}


def _peft_trainable(cfg: dict, targets: tuple[str, ...], r: int) -> int | None:
    """PEFT's trainable parameters on the meta-device model; None where PEFT refuses the list."""
    from peft import LoraConfig, get_peft_model

    model = _build(cfg, "eager", device="meta")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = get_peft_model(model, LoraConfig(r=r, target_modules=list(targets)))
    except ValueError:  # no target found, a non-Linear module named, a half of a fused pair
        return None
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_adapters_match_peft(case):
    cfg, r = LORA_CASES[case], 8
    spec = ModelSpec.from_hf_dict(cfg)
    for targets in TARGET_LISTS:
        expected = _peft_trainable(cfg, targets, r)
        train = TrainSpec(lora_rank=r, lora_targets=targets)
        try:
            planned = adapter_params(spec, train)
        except ShardwiseError:
            assert expected is None, (targets, expected)  # the planner refuses only what PEFT refuses
            continue
        assert planned == (expected or 0), targets
        # A and B of every adapter, over the layers, add up to the same count
        assert sum(n * per * LAYERS for n, per in adapter_tensors(spec, train)) == pytest.approx(planned)


def test_lora_by_hand_on_published_configs():
    r = 16
    ds = get_model("deepseek-v3")  # default q/k/v/o targets: MLA has only o_proj (128·128 → 7168)
    assert adapter_params(ds, TrainSpec(lora_rank=r)) == 61 * r * (128 * 128 + 7168)
    mla = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    per_layer = (7168 + 1536) + (1536 + 128 * 192) + (7168 + 512 + 64) + (512 + 128 * (128 + 128)) + (128 * 128 + 7168)
    assert adapter_params(ds, TrainSpec(lora_rank=r, lora_targets=mla)) == 61 * r * per_layer
    phi = get_model("phi-3-mini")  # qkv_proj 3072 → 3·3072, gate_up_proj 3072 → 2·8192
    fused = ("qkv_proj", "gate_up_proj")
    assert adapter_params(phi, TrainSpec(lora_rank=r, lora_targets=fused)) == 32 * r * (4 * 3072 + 3072 + 2 * 8192)
    # pipeline stages: deepseek's 61 layers over 4 stages are 16/15/15/15 (the trainer's split), the
    # first holding the 3 dense ones: the fullest holds 15 MoE layers;
    # PEFT puts the routed experts' down_proj adapters (one A/B per expert) on MoE layers only
    down = TrainSpec(lora_rank=r, lora_targets=("down_proj",))
    expert_down = r * 256 * (2048 + 7168)
    assert adapter_params(ds, down, pp=4) == 15 * expert_down
    assert adapter_params(ds, down) == 58 * expert_down


# ---------------------------------------------------------------------------- 3. FSDP wrap class


def _layer_class(cfg: dict) -> str:
    from shardwise.specs.hf_meta import decoder_layers

    return type(decoder_layers(_build(cfg, "eager", device="meta"))[0]).__name__


WRAP_CASES = {**{shape: _flops_case(shape) for shape in saved.SHAPES},
              "mistral": {**saved.SHAPES["tiny-llama"], "model_type": "mistral", "num_hidden_layers": 2}}


@pytest.mark.parametrize("case", list(WRAP_CASES))
def test_fsdp_wrap_class_is_the_decoder_layer_transformers_builds(case):
    from shardwise.emit import accelerate_config

    cfg = WRAP_CASES[case]
    spec = ModelSpec.from_hf_dict(cfg)
    emitted = accelerate_config(spec, build_hardware(gpus=8), TrainSpec(), Strategy.from_name("fsdp"))
    name = emitted["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]
    assert name == _layer_class(cfg)


def test_every_analytic_family_has_a_wrap_class():
    """Each name imports from the modeling module of the family's causal-LM class (accelerate
    finds the class by name among the model's modules)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from shardwise.specs.families import ANALYTIC_FAMILIES
    from shardwise.specs.layer_class import LAYER_CLASS

    assert set(LAYER_CLASS) == set(ANALYTIC_FAMILIES)
    for family, name in LAYER_CLASS.items():
        causal_lm = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
        module = importlib.import_module(causal_lm.__module__)
        layer = getattr(module, name)
        assert isinstance(layer, type) and issubclass(layer, torch.nn.Module), family
