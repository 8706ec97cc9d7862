"""A torchtune recipe config YAML (`tune run RECIPE --config FILE`; pytorch/torchtune@bd2a0fc
recipes/configs/ and the recipes that read them: full_finetune_single_device.py,
full_finetune_distributed.py, lora_finetune_single_device.py, lora_finetune_distributed.py, the DPO
recipes). The file names its model through a builder (`model._component_:
torchtune.models.llama3_1.lora_llama3_1_8b`), not a Hub id, and not the recipe: the single-device
recipes are told from the distributed ones by the file's distributed keys, its name
(`*_single_device.yaml`, torchtune's own naming) or `--gpus`.

Stock semantics, each from the recipe that reads the key (line numbers at bd2a0fc):
- `dtype: bf16`: the model is built in bf16 (`training.set_default_dtype`) and trained so, AdamW
  states included, with no fp32 master: --precision bf16-pure; fp16 is refused by torchtune
  (`training.get_dtype`), fp32 is fp32.
- the distributed recipes `fully_shard` every decoder layer with
  `reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True)` and the root with
  `reshard_after_forward=False` (training/_distributed.py `shard_model`, since cdde80e: the loss
  applies the output projection after the forward), no MixedPrecisionPolicy: FSDP2 with the decoder
  layers resharded and the root kept, gradients reduced in the parameters' dtype, every micro-batch
  (no `no_sync`); `fsdp_cpu_offload` offloads parameters, gradients and the optimizer to the host
  (CPUOffloadPolicy); `custom_sharded_layers: [tok_embeddings, output]` makes the embedding and the
  head units of their own, resharded as the layers are (the root keeps the final norm only).
  `tensor_parallel_dim`, `context_parallel_dim` (rotate method allgather: torch's),
  `data_parallel_shard_dim` / `data_parallel_replicate_dim` (HSDP) give the mesh.
- after backward every recipe multiplies each gradient by 1/tokens (`training.scale_grads_`) and
  clips only where `clip_grad_norm` is set; with `optimizer_in_bwd` neither runs.
- `enable_activation_checkpointing` wraps each decoder layer whole (default false),
  `enable_activation_offloading` offloads the saved tensors (default false), `compile` compiles
  each layer and the loss (default false), `enable_fp8_training` swaps the linears but `output`
  for torchao's Float8Linear (`fp8_recipe_name`, default tensorwise with the fp8 all-gather).
- `dataset.packed` packs rows to `tokenizer.max_seq_len` with a block-causal mask that FlexAttention
  runs on CUDA (modules/attention_utils.py `_SUPPORTS_FLEX_ATTENTION`).
"""

from __future__ import annotations

from typing import Any

from shardwise.ingest.common import (
    Context,
    Doc,
    Setting,
    Source,
    as_bool,
    as_count,
    ignore,
    lora_dropout,
    refuse,
    unstated,
)
from shardwise.ingest.training_args import rest

# torchtune's model builders (torchtune/models/<family>/_model_builders.py at bd2a0fc; `lora_` and
# `qlora_` variants build the same layers with adapters) -> the catalog entry of the same
# architecture: the same widths, layers, heads and vocabulary as the Hugging Face checkpoint the
# config's checkpointer loads (its `checkpointer.model_type`)
BUILDERS = {
    "gemma_7b": "gemma-7b", "gemma2_2b": "gemma-2-2b", "gemma2_9b": "gemma-2-9b", "gemma2_27b": "gemma-2-27b",
    "llama2_7b": "llama-2-7b", "llama2_13b": "llama-2-13b", "llama2_70b": "llama-2-70b",
    "llama3_8b": "llama-3-8b", "llama3_70b": "llama-3-70b",
    "llama3_1_8b": "llama-3.1-8b", "llama3_1_70b": "llama-3.1-70b", "llama3_1_405b": "llama-3.1-405b",
    "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "llama-3.2-3b",
    "llama3_3_70b": "llama-3.3-70b",  # llama3_3/_model_builders.py: llama3_1_70b's layers
    "mistral_7b": "mistral-7b", "phi3_mini": "phi-3-mini", "phi4_14b": "phi-4",
    "qwen2_5_0_5b": "qwen2.5-0.5b", "qwen2_5_1_5b_base": "qwen2.5-1.5b", "qwen2_5_1_5b_instruct": "qwen2.5-1.5b",
    "qwen2_5_3b": "qwen2.5-3b", "qwen2_5_7b_base": "qwen2.5-7b", "qwen2_5_7b_instruct": "qwen2.5-7b",
    "qwen2_5_14b_base": "qwen2.5-14b", "qwen2_5_14b_instruct": "qwen2.5-14b",
    "qwen2_5_32b_base": "qwen2.5-32b", "qwen2_5_32b_instruct": "qwen2.5-32b",
    "qwen2_5_72b_base": "qwen2.5-72b", "qwen2_5_72b_instruct": "qwen2.5-72b",
    "qwen3_0_6b_base": "qwen3-0.6b", "qwen3_0_6b_instruct": "qwen3-0.6b", "qwen3_1_7b_base": "qwen3-1.7b",
    "qwen3_1_7b_instruct": "qwen3-1.7b", "qwen3_4b_base": "qwen3-4b", "qwen3_4b_instruct": "qwen3-4b",
    "qwen3_8b_base": "qwen3-8b", "qwen3_8b_instruct": "qwen3-8b", "qwen3_14b_base": "qwen3-14b",
    "qwen3_14b_instruct": "qwen3-14b", "qwen3_32b": "qwen3-32b",
    "smollm2_135m": "smollm2-135m", "smollm2_360m": "smollm2-360m", "smollm2_1_7b": "smollm2-1.7b",
}

# optimizer._component_ -> (--optimizer, its default weight decay): torch.optim.AdamW 0.01, Adam and
# SGD 0; bitsandbytes' AdamW8bit / PagedAdamW8bit (bitsandbytes/optim/adamw.py) and torchao's
# low-bit AdamW (torchao/optim/adam.py) 0.01
OPTIMIZERS = {
    "torch.optim.AdamW": ("adamw", 0.01), "torch.optim.Adam": ("adamw", 0.0), "torch.optim.SGD": ("sgd", 0.0),
    "bitsandbytes.optim.PagedAdamW8bit": ("paged_adamw8bit", 0.01), "bitsandbytes.optim.AdamW8bit": ("adamw8bit", 0.01),
    "torchao.optim.AdamW8bit": ("adamw8bit", 0.01), "torchao.prototype.low_bit_optim.AdamW8bit": ("adamw8bit", 0.01),
    "torchao.optim.AdamW4bit": ("adamw4bit", 0.01), "torchao.prototype.low_bit_optim.AdamW4bit": ("adamw4bit", 0.01),
}
SAVER_OPTIMIZERS = {"adamw8bit": "torchao.optim.AdamW8bit", "adamw4bit": "torchao.optim.AdamW4bit",
                    "paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit"}

# loss._component_ -> --cross-entropy: CEWithChunkedOutputLoss (the model's output in 8 chunks, every
# chunk's logits kept); LinearCrossEntropyLoss (the output projection applied by the loss a chunk at
# a time, each chunk's graph kept until backward: the same saved set, planned alike)
LOSSES = {"torchtune.modules.loss.CEWithChunkedOutputLoss": "chunked-output",
          "torchtune.modules.loss.LinearCrossEntropyLoss": "chunked-output",
          "torch.nn.CrossEntropyLoss": "standard"}
# the DPO recipes' losses (torchtune/rlhf/loss/dpo.py): DPO with a reference; SimPO without one
PREFERENCE = {"torchtune.rlhf.loss.DPOLoss": "dpo", "torchtune.rlhf.loss.RSOLoss": "dpo",
              "torchtune.rlhf.loss.SimPOLoss": "simpo"}

# keys of the distributed recipes only
DISTRIBUTED_KEYS = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "tensor_parallel_dim",
                    "tensor_parallel_plan", "data_parallel_shard_dim", "data_parallel_replicate_dim",
                    "context_parallel_dim", "context_parallel_rotate_method")

# torchtune's LoRA module names -> the Hugging Face names the planner's targets use (PEFT's)
LORA_ATTN = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}

TT_NO_EFFECT = {"output_dir", "seed", "shuffle", "checkpointer", "resume_from_checkpoint", "epochs",
                "max_steps_per_epoch", "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "log_level",
                "profiler", "lr_scheduler", "save_adapter_weights_only", "run_val_every_n_steps", "dataset_val",
                "batch_size_val", "collate_fn", "low_cpu_ram", "enable_async_checkpointing",
                "cudnn_deterministic_mode", "save_every_n_steps", "save_every_n_epochs", "resize_token_embeddings",
                "activation_offloading_use_streams", "ref_checkpointer", "device"}


def is_torchtune(data: dict[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, dict) and str(model.get("_component_", "")).startswith("torchtune.")


def _component(doc: Doc, key: str) -> str | None:
    section = doc.data.get(key)
    if section is None:
        return None
    if not isinstance(section, dict) or not isinstance(section.get("_component_"), str):
        raise doc.error((key,), section, "a mapping with _component_ (a dotted class or builder path)")
    return section["_component_"]


def read(doc: Doc, ctx: Context) -> Source:
    d = doc.data
    src = Source("torchtune", doc.path)
    _refusals(doc, d)
    seen = {"model", "tokenizer", "dataset", "batch_size", "gradient_accumulation_steps", "dtype", "optimizer",
            "optimizer_in_bwd", "loss", "enable_activation_checkpointing", "enable_activation_offloading",
            "compile", "clip_grad_norm", "enable_fp8_training", "fp8_recipe_name", "ac_mode", "ac_option",
            *DISTRIBUTED_KEYS}
    lora = _model(doc, d, src, ctx)
    _batch(doc, d, src)
    _precision(doc, d, src)
    _optimizer(doc, d, src)
    _loss(doc, d, src, lora)
    _memory_flags(doc, d, src)
    _fp8(doc, d, src)
    distributed = _layout(doc, d, src, ctx)
    src.keys_of = lambda s: _keys(s, distributed)
    src.saver_keys = _saver_keys
    if "fsdp" in d:  # in a few QLoRA configs; no recipe reads it
        seen.add("fsdp")
        src.read.append(("fsdp", "no change to memory or time: no recipe reads it (their key is fsdp_cpu_offload)"))
    unstated(src, ctx, precision=False)
    rest(doc, d, src, seen, TT_NO_EFFECT)
    return src


def _refusals(doc: Doc, d: dict) -> None:
    """What a torchtune config runs and the planner cannot: a second trained or teacher model
    (knowledge distillation, PPO/GRPO's policy, value and reward models)."""
    for key, what in (("teacher_model", "knowledge distillation's teacher model beside the student"),
                      ("reward_and_value_model", "PPO's reward and value models beside the policy"),
                      ("reward_functions", "GRPO's generation and reward loop")):
        if key in d:
            value = d[key].get("_component_", d[key]) if isinstance(d[key], dict) else d[key]
            raise refuse(doc, (key,), value, f"{what} is not in shardwise's planner (it plans SFT and DPO-style "
                         "objectives of one model)")


def _model(doc: Doc, d: dict, src: Source, ctx: Context) -> bool:
    """The model and its adapters; returns whether it is a LoRA model."""
    comp = _component(doc, "model")
    assert comp is not None  # is_torchtune
    builder = comp.rsplit(".", 1)[-1]
    base = builder.removeprefix("qlora_").removeprefix("lora_")
    m = d["model"]
    if any(k in ctx.given for k in ("model", "model_config", "params")):
        src.read.append(("model._component_", f"{comp} (overridden by the --model/--model-config/--params given)"))
    elif base in BUILDERS:
        src.values["model"] = BUILDERS[base]
        src.read.append(("model._component_", f"--model {BUILDERS[base]} (torchtune's {base} builder)"))
    else:
        raise doc.error(("model", "_component_"), comp, "a torchtune builder of a model in shardwise's catalog ("
                        + ", ".join(sorted({b.split("_")[0] for b in BUILDERS})) + " families), or pass --model "
                        "(or --model-config) for it")
    lora = builder != base or "lora_rank" in m
    if not lora:
        return False
    rank = as_count(doc, ("model", "lora_rank"), m.get("lora_rank", 8))
    attn = m.get("lora_attn_modules", [])
    if not isinstance(attn, list) or any(a not in LORA_ATTN for a in attn):
        raise doc.error(("model", "lora_attn_modules"), attn, "a list of q_proj, k_proj, v_proj, output_proj")
    targets = [LORA_ATTN[a] for a in attn]
    if as_bool(doc, ("model", "apply_lora_to_mlp"), m.get("apply_lora_to_mlp", False)):
        targets += ["gate_proj", "up_proj", "down_proj"]  # torchtune's w1, w3, w2
    if as_bool(doc, ("model", "apply_lora_to_output"), m.get("apply_lora_to_output", False)):
        targets.append("lm_head")
    if not targets:
        raise doc.error(("model", "lora_attn_modules"), attn, "at least one adapted module (or apply_lora_to_mlp)")
    src.values |= {"lora_rank": rank, "lora_targets": ",".join(targets)}
    src.read.append(("model.lora_rank/lora_attn_modules", f"--lora-rank {rank} --lora-targets {','.join(targets)}"))
    if "lora_dropout" in m:  # the builders' default 0.0: torchtune's LoRALinear runs nn.Identity then
        lora_dropout(doc, ("model", "lora_dropout"), m["lora_dropout"], src)
    quant = builder.startswith("qlora_") or as_bool(doc, ("model", "quantize_base"), m.get("quantize_base", False))
    if quant:
        src.values["qlora"] = True
        src.read.append(("model.quantize_base" if "quantize_base" in m else "model._component_",
                         "--qlora (torchao's NF4 base)"))
    if as_bool(doc, ("model", "use_dora"), m.get("use_dora", False)):
        ignore(src, "model.use_dora", "DoRA's magnitude vectors and their weight-norm pass are not planned: "
               "planned as LoRA")
    return True


def _batch(doc: Doc, d: dict, src: Source) -> None:
    if "batch_size" not in d:
        raise doc.error(("batch_size",), None, "the per-device batch size (torchtune's recipes require batch_size)")
    src.values["micro_batch"] = as_count(doc, ("batch_size",), d["batch_size"])
    src.read.append(("batch_size", f"--micro-batch {src.values['micro_batch']}"))
    ga = d.get("gradient_accumulation_steps", 1)
    src.values["grad_accum"] = as_count(doc, ("gradient_accumulation_steps",), ga)
    src.read.append(("gradient_accumulation_steps", f"--grad-accum {src.values['grad_accum']}"
                     + ("" if "gradient_accumulation_steps" in d else " (the recipes' default 1)")))
    tok = d.get("tokenizer")
    seq = tok.get("max_seq_len") if isinstance(tok, dict) else None
    if seq is not None:
        src.values["seq_len"] = as_count(doc, ("tokenizer", "max_seq_len"), seq)
        src.read.append(("tokenizer.max_seq_len", f"--seq-len {src.values['seq_len']}"))
    else:
        src.warnings.append(f"{doc.path.name}: tokenizer.max_seq_len is null: sequences are as long as the "
                            "dataset's examples (unpadded); pass --seq-len for the longest batch")
    sets = d.get("dataset")
    packed = [as_bool(doc, ("dataset", "packed"), s.get("packed", False)) for s in
              (sets if isinstance(sets, list) else [sets]) if isinstance(s, dict)]
    if any(packed):
        if seq is None:
            raise doc.error(("tokenizer", "max_seq_len"), None, "a length: torchtune packs rows to max_seq_len")
        src.values["packed_attention"] = "flex"
        src.read.append(("dataset.packed", "true: rows packed to max_seq_len, documents kept apart by FlexAttention's "
                         "block mask (--packed-attention flex)"))


def _precision(doc: Doc, d: dict, src: Source) -> None:
    dtype = str(d.get("dtype", "bf16"))
    if dtype not in ("bf16", "fp32"):
        raise doc.error(("dtype",), d.get("dtype"), "bf16 or fp32 (torchtune's get_dtype refuses fp16)")
    src.values["precision"] = "bf16-pure" if dtype == "bf16" else "fp32"
    src.read.append(("dtype", f"{dtype}: --precision {src.values['precision']}"
                     + (" (weights, gradients and optimizer states in bf16, no fp32 master)" if dtype == "bf16" else "")))


def _optimizer(doc: Doc, d: dict, src: Source) -> None:
    comp = _component(doc, "optimizer")
    if comp is None:
        return
    if comp not in OPTIMIZERS:
        raise refuse(doc, ("optimizer", "_component_"), comp, "its states are not planned (planned: "
                     + ", ".join(OPTIMIZERS) + ")")
    name, default = OPTIMIZERS[comp]
    opt = d["optimizer"]
    src.values["optimizer"] = name
    said = [f"--optimizer {name}"]
    if name == "adamw" and comp.startswith("torch.optim."):
        fused = as_bool(doc, ("optimizer", "fused"), opt.get("fused", False))
        src.values["optimizer_impl"] = "fused" if fused else "foreach"
        said.append(f"--optimizer-impl {src.values['optimizer_impl']}" + ("" if fused else " (torch's CUDA default)"))
    wd = opt.get("weight_decay", default)
    if isinstance(wd, bool) or not isinstance(wd, int | float) or wd < 0:
        raise doc.error(("optimizer", "weight_decay"), wd, "a number ≥ 0")
    src.values["weight_decay"] = float(wd)
    said.append(f"--weight-decay {float(wd):g}" + ("" if "weight_decay" in opt else " (the optimizer's default)"))
    src.read.append(("optimizer._component_", " ".join(said)))
    if as_bool(doc, ("optimizer_in_bwd",), d.get("optimizer_in_bwd", False)):
        if src.values.get("grad_accum", 1) > 1:
            raise refuse(doc, ("optimizer_in_bwd",), True, "torchtune runs the step in backward with "
                         "gradient_accumulation_steps 1 only (its recipes raise otherwise)")
        src.values |= {"optimizer_in_backward": True, "grad_pass": "none"}
        src.read.append(("optimizer_in_bwd", "--optimizer-in-backward --grad-pass none (neither the scaling nor "
                         "clipping runs)"))
    else:
        clip = d.get("clip_grad_norm")
        src.values["grad_pass"] = "clip" if clip is not None else "scale"
        src.read.append(("clip_grad_norm", f"{clip}: --grad-pass {src.values['grad_pass']}"
                         + (" (the gradients scaled by 1/tokens, then clipped)" if clip is not None
                            else " (training.scale_grads_: each gradient multiplied by 1/tokens)")))


def _loss(doc: Doc, d: dict, src: Source, lora: bool) -> None:
    comp = _component(doc, "loss")
    if comp is None:
        return
    if comp in PREFERENCE:
        objective = PREFERENCE[comp]
        src.values["objective"] = objective
        ref = "" if objective == "simpo" else ("adapters_off" if lora else "model")
        if ref:
            src.values["reference"] = ref
        src.read.append(("loss._component_", f"--objective {objective}" + (f" --reference {ref}" if ref else "")
                         + (" (the LoRA recipe's reference is the base with the adapters disabled)"
                            if ref == "adapters_off" else "")))
        return
    if comp not in LOSSES:
        raise refuse(doc, ("loss", "_component_"), comp, "a loss shardwise does not plan (planned: "
                     + ", ".join([*LOSSES, *PREFERENCE]) + ")")
    src.values["cross_entropy"] = LOSSES[comp]
    src.read.append(("loss._component_", f"--cross-entropy {LOSSES[comp]}"
                     + (" (the output projection a chunk at a time inside the loss; ignored tokens' logits are "
                        "planned too)" if comp.endswith("LinearCrossEntropyLoss") else "")))


def _memory_flags(doc: Doc, d: dict, src: Source) -> None:
    ckpt = as_bool(doc, ("enable_activation_checkpointing",), d.get("enable_activation_checkpointing", False))
    src.values["checkpointing"] = "full" if ckpt else "none"
    src.read.append(("enable_activation_checkpointing", f"{ckpt}: --checkpointing {src.values['checkpointing']}"
                     + ("" if "enable_activation_checkpointing" in d else " (the recipes' default)")))
    if d.get("ac_mode") == "selective":
        ignore(src, "ac_mode", f"selective (every {d.get('ac_option')}-th layer): planned as every layer checkpointed")
    offload = as_bool(doc, ("enable_activation_offloading",), d.get("enable_activation_offloading", False))
    src.values["activation_offload"] = offload
    src.read.append(("enable_activation_offloading", f"{offload}: "
                     + ("--activation-offload" if offload else "--no-activation-offload")))
    compiled = d.get("compile", False)
    on = bool(compiled) if isinstance(compiled, dict) else as_bool(doc, ("compile",), compiled)
    src.values["fused_kernels"] = on
    src.read.append(("compile", f"{compiled}: " + ("--fused-kernels (each layer and the loss compiled)" if on
                                                   else "--no-fused-kernels")))


def _fp8(doc: Doc, d: dict, src: Source) -> None:
    if not as_bool(doc, ("enable_fp8_training",), d.get("enable_fp8_training", False)):
        return
    name = d.get("fp8_recipe_name") or "tensorwise"
    if name not in ("tensorwise", "rowwise"):
        raise refuse(doc, ("fp8_recipe_name",), name, "rowwise_with_gw_hp (weight gradients in high precision) is "
                     "not planned (tensorwise and rowwise are)")
    src.values["fp8"] = name
    src.read.append(("enable_fp8_training", f"--fp8 {name} (torchao Float8Linear on every linear but the output)"))


def _layout(doc: Doc, d: dict, src: Source, ctx: Context) -> bool:
    """The recipe (single-device or distributed) and its mesh; returns whether it is distributed."""
    given = ctx.given.get("gpus")
    keys = [k for k in DISTRIBUTED_KEYS if k in d]
    single = "single_device" in doc.path.name and not keys
    if single and (given or 1) == 1:
        src.values |= {"strategy": ["ddp"], "gpus": 1}
        src.family = ("ddp",)
        src.read.append(("(file name)", f"{doc.path.name}: a single-device recipe's config: one GPU, the bare "
                         "module (-s ddp --gpus 1)"))
        return False
    if single:
        src.notes.append(f"{doc.path.name} is a single-device recipe's config; planned on --gpus {given} as the "
                         "distributed recipe runs it")
    offload = as_bool(doc, ("fsdp_cpu_offload",), d.get("fsdp_cpu_offload", False))
    reshard = as_bool(doc, ("fsdp_reshard_after_forward",), d.get("fsdp_reshard_after_forward", True))
    replicate = as_count(doc, ("data_parallel_replicate_dim",), d.get("data_parallel_replicate_dim", 1))
    if offload and not reshard:
        raise refuse(doc, ("fsdp_reshard_after_forward",), False, "with fsdp_cpu_offload the planner offloads "
                     "resharded units (fsdp+offload); unsharded ones between forward and backward are not planned")
    strategy = "fsdp+offload" if offload else "fsdp-hybrid" if replicate > 1 else "fsdp" if reshard else "fsdp-grad-op"
    src.values["strategy"] = [strategy]
    src.family = ("fsdp", "fsdp-grad-op", "fsdp+offload")
    src.read.append(("fsdp_cpu_offload/fsdp_reshard_after_forward", f"-s {strategy} (fully_shard on every layer "
                     "and the root, no mixed-precision policy)"))
    src.knobs["fsdp"] |= {"reduce_dtype": "param", "reduce_every_micro_batch": True}
    layers = d.get("custom_sharded_layers") or []
    if set(layers) >= {"tok_embeddings", "output"}:
        # the embedding and the head reshard as the layers do; the root keeps a final norm: planned as
        # every unit resharded (its kept norm: h elements)
        src.knobs["fsdp"]["wrap_embeddings"] = True
        if reshard:
            src.knobs["fsdp"]["reshard_after_forward"] = "all"
        src.read.append(("custom_sharded_layers", "--fsdp-wrap-embeddings (the embedding and the head as units "
                         "of their own, resharded after forward)"))
    elif reshard:  # the root (embedding, final norm, output) kept gathered from forward into backward
        src.knobs["fsdp"]["reshard_after_forward"] = "layers"
    for key, flag in (("tensor_parallel_dim", "tp"), ("context_parallel_dim", "cp")):
        if key in d and (n := as_count(doc, (key,), d[key])) > 1:
            src.values[flag] = n
            src.read.append((key, f"--{flag} {n}"))
    shard = d.get("data_parallel_shard_dim", -1)
    if replicate > 1:
        if shard != -1:
            src.shard_group = as_count(doc, ("data_parallel_shard_dim",), shard)
        src.read.append(("data_parallel_replicate_dim", f"{replicate} replicas of each shard group"
                         + (f" of {src.shard_group}" if src.shard_group else "")))
    if "gpus" not in ctx.given and not keys:
        src.notes.append(f"{doc.path.name}: a distributed recipe's config (no single_device in its name); pass "
                         "--gpus for the GPUs `tune run --nproc_per_node` starts")
    return True


def _keys(s: Setting, distributed: bool) -> dict[str, Any]:
    """This format's keys for a strategy, batch split and checkpointing."""
    out: dict[str, Any] = {"batch_size": s.micro_batch, "gradient_accumulation_steps": s.grad_accum,
                           "enable_activation_checkpointing": s.checkpointing != "none"}
    if distributed:
        out |= {"fsdp_cpu_offload": s.strategy == "fsdp+offload",
                "fsdp_reshard_after_forward": s.strategy != "fsdp-grad-op"}
    return out


def _saver_keys(t) -> dict[str, Any] | None:
    """The config's keys for the memory savers `t` (a TrainSpec) has on; None for one it cannot say."""
    out: dict[str, Any] = {}
    if t.optimizer_in_backward:  # torchtune's recipes refuse it with accumulation or clipping
        out |= {"optimizer_in_bwd": True, "gradient_accumulation_steps": 1, "clip_grad_norm": None}
    if t.activation_offload:
        out["enable_activation_offloading"] = True
    if t.optimizer != "adamw":
        if t.optimizer not in SAVER_OPTIMIZERS:
            return None
        out["optimizer._component_"] = SAVER_OPTIMIZERS[t.optimizer]
    if t.precision == "bf16-pure":
        out["dtype"] = "bf16"
    elif t.precision != "fp32":
        return None  # torchtune trains in bf16 or fp32 only
    return out
