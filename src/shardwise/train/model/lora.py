"""LoRA and QLoRA through PEFT: adapters injected into the HF model in place.

`peft.inject_adapter_in_model` (not `get_peft_model`) keeps the transformers CausalLM as the
root module: every engine wraps, shards and hooks the same modules as for full fine-tuning
(FSDP2's per-layer `fully_shard`, ZeRO-3's module hooks, DDP), the forward and the loss are
unchanged, and parameter names only gain PEFT's `.base_layer` / `.lora_A.default` parts.

- Frozen base: every parameter PEFT does not mark trainable is cast to the compute dtype
  (bf16/fp16; fp32 runs keep fp32). Adapters (and `modules_to_save` copies) are in the master
  dtype: fp32 under mixed precision (the engines cast them for compute and keep fp32 master
  values), bf16 under bf16-pure (everything bf16, as torchtune's LoRA recipes run it).
- Only trainable parameters reach the optimizer (`decay_groups` skips frozen ones) and the
  checkpoint (the canonical state holds `requires_grad` tensors): a LoRA checkpoint is the
  adapters and their AdamW moments. The base is rebuilt from the config (local weights, or the
  seeded random init) on resume and export.
- QLoRA (`lora.quantization: nf4`): the decoder layers' linears become bitsandbytes
  `Linear4bit` (NF4, double-quantised scales, compute in the run's dtype) before the adapters
  are injected; on CUDA, and on CPU with bitsandbytes 0.50+; replicated-base strategies only
  (see `check_qlora`).
"""

from __future__ import annotations

from typing import Any

from shardwise.config.schema import LoraSection, TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec

ADAPTER_NAME = "default"  # PEFT's adapter name: parameters are `...lora_A.default.weight`


def peft_config(section: LoraSection) -> Any:
    """The `peft.LoraConfig` of a `lora:` section (task CAUSAL_LM, no bias training)."""
    from peft import LoraConfig

    return LoraConfig(
        r=section.rank, lora_alpha=section.scale_alpha, lora_dropout=section.dropout,
        target_modules=section.target_modules, modules_to_save=list(section.modules_to_save) or None,
        bias="none", task_type="CAUSAL_LM",
    )


def check_qlora(cfg: TrainConfig, device: str) -> None:
    """Refuse QLoRA where it cannot run, before any process starts: a strategy that shards
    parameters, no bitsandbytes, or a bitsandbytes without NF4 kernels for the device."""
    if cfg.lora is None or cfg.lora.quantization == "none":
        return
    where = f"{cfg.source}: lora.quantization 'nf4'"
    replicated = qlora_strategies()
    if cfg.strategy.name not in replicated:
        raise ShardwiseError(f"{where} runs with a replicated base ({', '.join(replicated)}); strategy "
                             f"{cfg.strategy.name!r} shards (or offloads) parameters, which bitsandbytes' packed 4-bit "
                             "weights do not support here. Pick one of those strategies, or lora.quantization: none.")
    try:
        import bitsandbytes
    except ImportError:
        raise ShardwiseError(f"{where} needs bitsandbytes: pip install 'shardwise[qlora]'") from None
    if not nf4_supported(device):
        raise ShardwiseError(f"{where}: the installed bitsandbytes {bitsandbytes.__version__} cannot quantise to "
                             f"NF4 on {device} (CPU needs bitsandbytes 0.50 or later). Use lora.quantization: none "
                             f"(LoRA on a {cfg.precision} base), or a device it supports.")


def nf4_supported(device: str) -> bool:
    """Whether the installed bitsandbytes quantises to NF4 on `device`: CUDA always; on CPU, tried
    on one block (bitsandbytes added CPU kernels in its multi-backend releases)."""
    if device == "cuda":
        return True
    import torch
    from bitsandbytes.functional import quantize_4bit

    try:
        quantize_4bit(torch.ones(64, 64, dtype=torch.bfloat16), quant_type="nf4", compress_statistics=True)
    except Exception:
        return False
    return True


def qlora_strategies() -> tuple[str, ...]:
    """Trainer strategies whose base weights stay whole on every rank: bitsandbytes' packed 4-bit
    tensors (uint8 storage with a QuantState attached) cannot be flattened and sharded by ZeRO-3
    or FSDP2 (the planner's recommender marks the others plan-only the same way)."""
    from shardwise.config.strategy import STRATEGY_NAMES
    from shardwise.specs import Strategy

    return tuple(n for n in STRATEGY_NAMES if (s := Strategy.from_name(n)).trainable
                 and not s.shards_params and not s.offload_params)


def quantize_base(model: Any, run: RunSpec) -> None:
    """Replace the decoder layers' nn.Linear with bitsandbytes NF4 `Linear4bit` (QLoRA's recipe:
    NF4, double quantisation, compute in the run's dtype), quantised on the run's device (moving
    a `Params4bit` quantises it)."""
    import bitsandbytes as bnb
    import torch

    from shardwise.train.engines._torch_common import compute_dtype

    dtype = compute_dtype(run)
    device = torch.device("cuda", torch.cuda.current_device()) if run.device == "cuda" else torch.device("cpu")
    for layer in model.model.layers:
        for name, mod in list(layer.named_modules()):
            if type(mod) is not torch.nn.Linear:
                continue
            q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                  compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                  device="cpu")
            q.weight = bnb.nn.Params4bit(mod.weight.data.to(dtype), requires_grad=False, quant_type="nf4",
                                         compress_statistics=True)
            if mod.bias is not None:
                q.bias = torch.nn.Parameter(mod.bias.data.to(dtype), requires_grad=False)
            parent, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, leaf, q.to(device))  # quantises


def apply_lora(model: Any, run: RunSpec) -> Any:
    """Inject the run's adapters into `model` (in place; returned): base frozen in the compute
    dtype, adapters in the master dtype (fp32; bf16 under bf16-pure), initialised from the run's seed (`init_adapters`), so every
    rank (and a later resume or export) builds the same starting point. `model` may be on the
    meta device (a checkpoint read later by the engine: shardwise.train.model.weights)."""
    from peft import inject_adapter_in_model

    from shardwise.train.engines._torch_common import compute_dtype, master_dtype

    section = run.config.lora
    assert section is not None
    if section.quantization == "nf4":
        quantize_base(model, run)
    try:
        model = inject_adapter_in_model(peft_config(section), model, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model"
        raise ShardwiseError(f"{run.config.source}: lora.target_modules {section.target_modules!r}: {e}") from None
    # Adapters drawn from the run's seed after injection, on CPU, whatever built the base (from
    # its config, from a checkpoint, on the meta device): equal on every rank, engine and resume.
    init_adapters(model, section, run.config.run.seed)
    dtype, master = compute_dtype(run), master_dtype(run)
    for p in model.parameters():
        if hasattr(p, "ds_id"):  # a ZeRO-3 partition (zero.Init): already in DeepSpeed's dtype
            continue
        if p.requires_grad:
            p.data = p.data.to(master)
        elif p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def peft_model(section: LoraSection, base: Any) -> Any:
    """A `peft.PeftModel` around `base` with a `lora:` section's adapter config (fresh adapters),
    for export (built on the meta device): PEFT's names, scalings and `save_pretrained`."""
    import warnings

    from peft import get_peft_model

    from shardwise.quiet import verbose

    with warnings.catch_warnings():
        # PeftModel.__init__ reads `base.is_gradient_checkpointing` (getattr), a property transformers 5
        # deprecated for `is_activation_checkpointing`: a FutureWarning about PEFT's code, not the run's.
        if not verbose():
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
        return get_peft_model(base, peft_config(section), adapter_name=ADAPTER_NAME)


def init_adapters(model: Any, section: Any, seed: int) -> None:
    """Initialise every LoRA adapter on CPU, as PEFT's `reset_lora_parameters` does, from a
    generator seeded by `seed` in module order: the same values on every rank, engine and load
    path (meta or whole). Meta adapters are allocated on CPU first."""
    import torch
    from peft.tuners.lora import LoraLayer

    init = peft_config(section).init_lora_weights
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for holder in (module.lora_A, module.lora_B, module.lora_embedding_A, module.lora_embedding_B):
                if ADAPTER_NAME in holder:
                    entry = holder[ADAPTER_NAME]
                    if isinstance(entry, torch.nn.Module):
                        if any(p.device.type == "meta" for p in entry.parameters()):
                            entry.to_empty(device="cpu")
                    elif entry.device.type == "meta":
                        entry.data = torch.empty_like(entry, device="cpu")
            module.reset_lora_parameters(ADAPTER_NAME, init)
