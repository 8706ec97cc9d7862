"""Build the HF causal LM: a catalog model from its config (random init) or a local checkpoint.

`check_model_source` is torch-free and runs before ranks start; `build_model` runs per rank
under the same seed, so every rank (and a single-process reference) starts from equal weights.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.config.schema import ModelSection
from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec
from shardwise.run.resolve import NO_SDPA
from shardwise.train.model.hf import causal_lm_class

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_source(cfg: ModelSection, source: str = "<config>",
                       opt_in: str = "set model.trust_remote_code: true (--set model.trust_remote_code=true)") -> None:
    """Refuse a bad model before any process starts: a missing dir, config.json or weights, a
    config.json that is not JSON or holds a value no model is built from
    (shardwise.specs.hf_values), remote code not asked for (`opt_in` says how this command allows it)."""
    if cfg.path is None:
        from shardwise.catalog import get_model

        get_model(cfg.name or "")  # raises with the valid names
        return
    p = Path(cfg.path)
    if not p.is_dir():
        raise ShardwiseError(
            f"{source}: model.path {cfg.path!r} is not a directory (expected a local HF model dir)"
        )
    if not (p / "config.json").is_file():
        raise ShardwiseError(f"{source}: model.path {cfg.path!r} has no config.json")
    if not cfg.random_init and not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ShardwiseError(
            f"{source}: model.path {cfg.path!r} has no weights (expected one of {', '.join(WEIGHT_FILES)}); "
            "set model.random_init: true to train from its config with random weights"
        )
    import json

    from shardwise.specs.hf_config import read_config_json

    try:
        doc, config = read_config_json(p)
    except ShardwiseError as exc:
        raise ShardwiseError(f"{source}: model.path {cfg.path!r}: {exc}") from None
    auto_map = doc.get("auto_map")
    if auto_map and not cfg.trust_remote_code:
        shown = json.dumps(auto_map)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise ShardwiseError(
            f"{source}: model.path {cfg.path!r}: {config}: field 'auto_map' is {shown}: the model ships its own "
            f"Python code, which shardwise does not run by default; {opt_in} only if you trust that code"
        )




def attention_implementation(run: RunSpec) -> str:
    """The `attn_implementation` the model is built with: the one that keeps packed documents
    apart without a dense mask where the run has them (`TrainSpec.packed_attention`:
    flash_attention_2, shardwise's per-document SDPA or FlexAttention, shardwise.train.model.packed_attention),
    else the planner's `attention_kind`, i.e. `model.attention`, except where transformers has no
    SDPA path and the planner already plans the eager attention that runs instead (Gemma2). What
    is planned is what is built; preflight says so once (`attention_note`)."""
    from shardwise.plan.activations import attention_kind
    from shardwise.train.model.packed_attention import implementation

    return implementation(run) or attention_kind(run.model, run.train)


def attention_note(run: RunSpec) -> str | None:
    """Preflight's check of the attention kernel, before any rank builds the model.

    - The planner plans eager for the family under `sdpa` (Gemma2): it runs eager; the note says so.
    - transformers has no SDPA path but the plan assumed one (MPT, whose plan is llm-foundry's
      fused kernel; meta-path architectures whose class lacks `_supports_sdpa`): refused naming
      `model.attention`, since eager's s×s scores would break the memory check.
    - Packed SFT rows: `packed_attention.note` (the dense fallback's cost, or a refusal).
    None: the configured kernel runs as planned."""
    from shardwise.plan.activations import attention_kind
    from shardwise.train.model.packed_attention import note as packed_note

    cfg = run.config
    packed = packed_note(run)
    impl = attention_kind(run.model, run.train)
    if impl != cfg.model.attention:
        return (f"{cfg.source}: model.attention is {cfg.model.attention!r}, but transformers has no SDPA path for "
                f"{run.model.family} ({run.model.name}); building it with {impl!r} attention, as the memory plan "
                f"assumes (set model.attention: {impl} to make this explicit)" + (f"; {packed}" if packed else ""))
    if impl != "sdpa":
        return packed
    if run.model.inventory is not None:
        cls = causal_lm_class(run.model.inventory.model_type)
        refused = cls is not None and not getattr(cls, "_supports_sdpa", True)
        what = f"{cls.__name__} (model_type {run.model.inventory.model_type!r})" if refused else ""
    else:
        refused, what = run.model.family in NO_SDPA, f"model_type {run.model.family!r}"
    if refused:
        raise ShardwiseError(
            f"{cfg.source}: model.attention is 'sdpa', but transformers has no SDPA path for {what}; set "
            "model.attention: eager (--set model.attention=eager), which plans and builds the eager attention")
    return packed


def build_model(run: RunSpec, *, deferred: bool = False):
    """The run's model, seeded by run.seed on every rank, with the planned activation
    checkpointing. A catalog model is built from the run's ModelSpec: what was planned is what is
    built; `model.random_init` builds a local config's architecture with random weights.

    A local safetensors checkpoint is read without a full copy per rank (shardwise.train.model.weights):
    with `deferred`, the model comes back on the meta device for the engine to place and fill
    (`weights.materialize`), or, for DeepSpeed ZeRO-3, already partitioned and filled inside
    `deepspeed.zero.Init`. Without `deferred` (export, tools) a meta-built model is filled on this
    process's CPU before it is returned. Other models: fp32 master weights on CPU (engines move,
    cast and shard them), as `from_pretrained`/`from_config` build them; under bf16-pure the
    parameters are cast to bf16 here (`cast_parameters`), meta-built ones included."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.train.model import weights

    cfg = run.config.model
    torch.manual_seed(run.config.run.seed)  # the init is part of the result: equal on every rank
    kw = {"attn_implementation": attention_implementation(run), "trust_remote_code": cfg.trust_remote_code}
    meta = False
    if cfg.path is None:
        d = dict(run.model.to_hf_dict())
        hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, **kw)
    elif cfg.random_init:
        hf_cfg = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, **kw)
    elif weights.sharded_load(run) and weights.zero3(run):
        from shardwise.train.launch.host_alloc import large_allocations_returned
        from shardwise.train.model.weights_zero3 import load_zero3, zero3_model

        with large_allocations_returned():
            model = zero3_model(run, kw["attn_implementation"])
            load_zero3(model, Path(cfg.path), _rank())
    elif weights.sharded_load(run):
        model, meta = weights.meta_model(run, kw["attn_implementation"]), True
    else:  # no weights format shardwise reads itself: transformers loads it whole
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32, **kw)
    model.config.use_cache = False  # no KV cache in training
    if run.train.master_dtype != "fp32":
        cast_parameters(model, run)
    if run.train.cross_entropy == "chunked":  # the model's forward computes the loss (train.loss)
        from shardwise.train.model.loss import install_loss_heads

        install_loss_heads(model)
    if run.train.checkpointing == "full":
        # Non-reentrant: works under FSDP2 and ZeRO-3 hooks and with frozen inputs.
        from shardwise.train.model.hf import enable_checkpointing

        enable_checkpointing(model, use_reentrant=False)
    lora = run.config.lora
    if meta and (not deferred or (lora is not None and lora.quantization == "nf4")):
        # Filled here, on CPU: for a caller that wants weights, or for QLoRA, which quantises the
        # base from real values (its strategies replicate the base: one copy per rank anyway), read
        # in the compute dtype when the base is frozen.
        if lora is not None:
            from shardwise.train.engines._torch_common import compute_dtype

            for p in model.parameters():
                p.data = p.data.to(compute_dtype(run))
        weights.materialize(weights.defer(model, run), torch.device("cpu"))
        meta = False
    if lora is not None:
        from shardwise.train.model.lora import apply_lora

        model = apply_lora(model, run)  # frozen base in the compute dtype, fp32 adapters
    if meta:
        weights.defer(model, run)
    if run.train.fused_kernels:  # run.compile (the bridge decides it once, for plan and build)
        from shardwise.train.model.compile import compile_layers

        compile_layers(model, run.config.run.compile_backend, run)
    return model


def cast_parameters(model, run: RunSpec) -> None:
    """bf16-pure: every floating-point parameter in the master dtype (bf16), once, before the engine
    wraps the model: there is no fp32 copy to keep (a meta-built model gets bf16 meta parameters,
    which the engine's read fills in bf16). Buffers keep their dtype: RoPE's `inv_freq` stays fp32
    (transformers computes the rotary angles in fp32 and casts cos/sin to the activations' dtype)."""
    from shardwise.train.engines._torch_common import master_dtype

    dtype = master_dtype(run)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and not hasattr(p, "ds_id"):
            p.data = p.data.to(dtype)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def trainable_shapes(run: RunSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter `build_model(run)` trains, i.e. what a checkpoint holds
    as `model.<name>` (shardwise.train.checkpoint.sharded): the model built on the meta device from the
    same config (and the same adapters), so no memory is used and no weights are read. An NF4
    base is not quantised here: it is frozen, and the adapters' shapes do not depend on it."""
    import torch

    model = meta_base(run)
    if run.config.lora is not None:
        from peft import inject_adapter_in_model

        from shardwise.train.model.lora import ADAPTER_NAME, peft_config

        try:
            with torch.device("meta"):
                model = inject_adapter_in_model(peft_config(run.config.lora), model, adapter_name=ADAPTER_NAME)
        except ValueError as e:  # as apply_lora says it: "Target modules {...} not found"
            raise ShardwiseError(f"{run.config.source}: lora.target_modules "
                                 f"{run.config.lora.target_modules!r}: {e}") from None
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def meta_base(run: RunSpec):
    """The run's base model (no adapters) on the meta device, fp32: every module, name and shape
    `build_model` gives, no storage and no weights read (buffers are meta too). For what needs
    only names and shapes: a checkpoint's expected tensors, the names of an adapter export."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = run.config.model
    kw = {"attn_implementation": attention_implementation(run), "trust_remote_code": cfg.trust_remote_code}
    if cfg.path is None:
        d = dict(run.model.to_hf_dict())
        hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    else:
        hf_cfg = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, **kw)
