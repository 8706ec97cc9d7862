"""A Hugging Face TrainingArguments JSON (`TrainingArguments.to_json_string()`, or the JSON an
HfArgumentParser script reads, TRL's SFTConfig included). HF Trainer's stock semantics: its
`deepspeed` JSON (path or inline) with "auto" filled from these arguments
(transformers/integrations/deepspeed.py), or its FSDP through accelerate's plugin
(training_args.py `_process_fsdp_args`: fsdp_config version 2 by default, reshard_after_forward
true, cpu_offload, activation_checkpointing; the legacy `fsdp: "full_shard auto_wrap"` string),
else DDP. LLaMA-Factory and axolotl reuse these readers for their TrainingArguments keys."""

from __future__ import annotations

from typing import Any

from shardwise.ingest import deepspeed as ds_reader
from shardwise.ingest.common import (
    Context,
    Doc,
    Setting,
    Source,
    as_bool,
    as_count,
    as_number,
    hub_model,
    ignore,
    load,
    lora_dropout,
    refuse,
    resolve_path,
    unstated,
)

# HF optim names -> the planner's optimizer
OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_apex_fused": "adamw",
         "adamw_torch_xla": "adamw", "adamw_8bit": "adamw8bit", "adamw_bnb_8bit": "adamw8bit",
         "adamw_torch_8bit": "adamw8bit", "adamw_torch_4bit": "adamw4bit",
         "paged_adamw_8bit": "paged_adamw8bit", "paged_adamw_32bit": "adamw", "sgd": "sgd"}
# the kernels each runs: transformers' own AdamW (adamw_hf, transformers/optimization.py, TrainingArguments'
# default before adamw_torch) steps parameter by parameter in Python, several eager ops each; apex's FusedAdam
# is a multi-tensor kernel as torch's fused one is
OPTIM_IMPL = {"adamw_torch_fused": "fused", "adamw_torch": "foreach", "adamw_hf": "forloop", "adamw_apex_fused": "fused"}
NO_EFFECT = {"output_dir", "learning_rate", "num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_ratio",
             "warmup_steps", "logging_steps", "save_steps", "save_strategy", "eval_strategy", "evaluation_strategy",
             "eval_steps", "report_to", "seed", "data_seed", "overwrite_output_dir", "save_total_limit",
             "resume_from_checkpoint", "ddp_timeout", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
             "logging_dir", "run_name", "do_train", "do_eval", "push_to_hub", "save_only_model", "dataloader_num_workers",
             "remove_unused_columns", "plot_loss", "logging_first_step", "per_device_eval_batch_size", "tf32",
             "save_safetensors", "dataset_text_field", "packing", "gradient_checkpointing_kwargs",
             # TRL / alignment-handbook script and logging arguments
             "model_revision", "chat_template", "dataset_mixture", "dataset_name", "dataset_configs",
             "dataset_num_proc", "hub_model_id", "hub_strategy", "log_level", "logging_strategy", "lora_alpha",
             "log_completions"}
# fsdp_config keys (without the fsdp_ prefix) that change nothing the plan counts
FSDP_NO_EFFECT = {"state_dict_type", "transformer_layer_cls_to_wrap", "sync_module_states", "use_orig_params",
                  "cpu_ram_efficient_loading", "min_num_params"}
TA_KEYS = {"per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "learning_rate",
           "num_train_epochs", "bf16", "fp16", "gradient_checkpointing", "deepspeed", "fsdp"}


def is_training_args(data: dict[str, Any]) -> bool:
    return "per_device_train_batch_size" in data or len(set(data) & TA_KEYS) >= 3


def read(doc: Doc, ctx: Context) -> Source:
    src = Source("training_args", doc.path)
    if "model_name_or_path" in doc.data:  # first: a DeepSpeed JSON's "auto" buckets need its hidden size
        hub_model(doc, ("model_name_or_path",), doc.data["model_name_or_path"], src, ctx)
    seen = read_trainer_args(doc, doc.data, src, ctx) | {"model_name_or_path"}
    if "model_name_or_path" in doc.data:
        seen.add("trust_remote_code")  # hub_model read it
    for k in ("max_length", "max_seq_length"):
        if k in doc.data and doc.data[k] is not None:
            seen.add(k)
            src.values["seq_len"] = as_count(doc, (k,), doc.data[k])
            src.read.append((k, f"--seq-len {src.values['seq_len']}"))
    seen |= _preference(doc, doc.data, src)
    seen |= model_config(doc, doc.data, src)
    if "num_generations" in doc.data:
        seen |= _grpo(doc, doc.data, src)
    unstated(src, ctx, precision=False)  # HF Trainer's precision default (fp32) is read_trainer_args'
    rest(doc, doc.data, src, seen, NO_EFFECT)
    return src


# TRL's preference configs (huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8): DPOConfig
# (trl/trainer/dpo_config.py: `beta`, `loss_type` default ["sigmoid"], `precompute_ref_log_probs`,
# `max_length` the whole sequence, prompt + completion, default 1024), KTOConfig (trl/trainer/
# kto_config.py: loss_type kto or apo_zero_unpaired, desirable_weight/undesirable_weight), CPOConfig
# (trl/experimental/cpo: loss_type simpo is SimPO, reference-free), ORPOConfig (trl/experimental/orpo/
# orpo_config.py: beta, max_length, max_completion_length, padding_value, generate_during_eval,
# is_encoder_decoder, no loss_type and no reference model: ORPOTrainer runs the pair through the
# policy only). A file with DPO's own keys (its loss or reference) is planned as DPO; one with
# ORPOConfig's (padding_value, is_encoder_decoder, generate_during_eval, max_completion_length,
# none of which DPOConfig has at that commit) and none of DPO's as ORPO; `beta` alone is either
# (the script decides): planned as DPO, and said first.
DPO_KEYS = ("beta", "precompute_ref_log_probs", "ref_model_init_kwargs", "max_prompt_length", "loss_type",
            "rpo_alpha", "ref_adapter_name", "model_adapter_name", "sync_ref_model", "reference_free")
KTO_KEYS = ("desirable_weight", "undesirable_weight")
# DPOConfig's keys that ORPOConfig lacks (the loss, the reference), and ORPOConfig's that DPOConfig lacks
DPO_OWN = ("loss_type", "precompute_ref_log_probs", "ref_model_init_kwargs", "rpo_alpha", "ref_adapter_name",
           "model_adapter_name", "sync_ref_model", "reference_free", "label_smoothing", "use_weighting",
           "f_divergence_type", "ld_alpha", "loss_weights")
ORPO_OWN = ("padding_value", "is_encoder_decoder", "generate_during_eval", "max_completion_length")
CPO_OWN = ("cpo_alpha", "simpo_gamma")
PREF_NO_EFFECT = ("beta", "max_prompt_length", "max_completion_length", "label_smoothing", "rpo_alpha",
                  "ref_model_init_kwargs", "disable_dropout", "truncation_mode", "generate_during_eval",
                  "desirable_weight", "undesirable_weight", "simpo_gamma", "cpo_alpha", "loss_weights",
                  "padding_value", "is_encoder_decoder")


def _preference(doc: Doc, d: dict, src: Source) -> set:
    """A TRL DPO/KTO/CPO config's objective and reference. Returns the keys read. A GRPOConfig
    (`num_generations`) shares `beta` (its KL coefficient) and `max_prompt_length`: it is `_grpo`'s."""
    if "num_generations" in d or not any(k in d for k in DPO_KEYS + KTO_KEYS):
        return set()
    seen: set = set()
    losses = d.get("loss_type", "sigmoid")
    losses = [str(x) for x in (losses if isinstance(losses, list) else [losses])]
    if "loss_type" in d:
        seen.add("loss_type")
    if any(k in d for k in KTO_KEYS) or set(losses) & {"kto", "apo_zero_unpaired"}:
        objective = "kto"
    elif "simpo" in losses:
        objective = "simpo"
    elif not any(k in d for k in DPO_OWN + CPO_OWN) and any(k in d for k in ORPO_OWN):
        objective = "orpo"
    else:
        objective = "dpo"
    src.values["objective"] = objective
    if objective == "orpo":
        keys = [k for k in ORPO_OWN if k in d]
        src.read.append(("beta/" + "/".join(keys), "--objective orpo (ORPOConfig's keys, none of DPOConfig's own: "
                         "the pair through the policy, no reference model)"))
    else:
        src.read.append(("loss_type" if "loss_type" in d else "beta/DPO keys",
                         f"{','.join(losses)}: --objective {objective}" + ("" if "loss_type" in d else
                                                                           " (DPOConfig's default loss sigmoid)")))
    if objective == "dpo" and not any(k in d for k in DPO_OWN + CPO_OWN):
        src.warnings.append(f"{src.path.name}: beta without DPOConfig's own keys (loss_type, "
                            "precompute_ref_log_probs, ...): planned as DPO, with its reference model; TRL's "
                            "ORPOConfig takes the same keys and runs no reference — pass --objective orpo if the "
                            "script is ORPO's")
    if objective in ("dpo", "kto"):
        pre = d.get("precompute_ref_log_probs")
        seen.add("precompute_ref_log_probs")
        if pre is not None and as_bool(doc, ("precompute_ref_log_probs",), pre):
            src.values["reference"] = "precomputed"
            src.read.append(("precompute_ref_log_probs", "true: --reference precomputed (the pass before training "
                             "is not in the step; no reference held)"))
        elif d.get("reference_free"):
            seen.add("reference_free")
            src.values["reference"] = "precomputed"
            src.read.append(("reference_free", "true: no reference forward (planned as --reference precomputed)"))
        else:
            src.read.append(("precompute_ref_log_probs", "unset: a reference model (the base with the adapters "
                             "disabled under LoRA, else a frozen copy)"))
    if "max_length" not in d and "max_seq_length" not in d:
        src.values["seq_len"] = 1024
        src.read.append(("max_length", "unset: --seq-len 1024 (DPOConfig's default: prompt + completion)"))
    for k in PREF_NO_EFFECT:
        if k in d:
            seen.add(k)
            src.read.append((k, "no change to memory or time" if k != "max_prompt_length" else
                             "the prompt's truncation inside max_length: no change to memory or time"))
    return seen


def model_config(doc: Doc, d: dict, src: Source) -> set:
    """TRL's ModelConfig (trl/trainer/model_config.py), which TRL's scripts and the alignment
    handbook read beside the trainer's arguments: `use_peft` with `lora_r` (default 16), `lora_dropout`
    (default 0.05: huggingface/trl@bc13ae6d trl/trainer/model_config.py),
    `lora_target_modules` (default None: PEFT's own targets for the architecture, q_proj and v_proj
    for Llama, Mistral and Qwen: peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING),
    `lora_modules_to_save`; `load_in_4bit` (get_quantization_config: bitsandbytes 4-bit,
    `bnb_4bit_quant_type` nf4 by default), `load_in_8bit`, `torch_dtype`, `attn_implementation`."""
    seen: set = set()
    peft = "use_peft" in d and as_bool(doc, ("use_peft",), d["use_peft"])
    if "use_peft" in d:
        seen.add("use_peft")
        if peft:
            seen |= {"lora_r", "lora_target_modules", "lora_modules_to_save", "lora_dropout"}
            rank = as_count(doc, ("lora_r",), d.get("lora_r", 16))
            mods = d.get("lora_target_modules")
            if mods is None:
                targets, how = "q_proj,v_proj", " (PEFT's default targets for Llama/Mistral/Qwen)"
            elif mods == "all-linear" or mods == ["all-linear"]:
                targets, how = "all-linear", ""
            else:
                targets, how = ",".join(str(m) for m in (mods if isinstance(mods, list) else [mods])), ""
            src.values |= {"lora_rank": rank, "lora_targets": targets}
            src.read.append(("use_peft", f"true: --lora-rank {rank}" + ("" if "lora_r" in d else " (TRL's default 16)")
                             + f" --lora-targets {targets}{how}"))
            lora_dropout(doc, ("lora_dropout",), d.get("lora_dropout", 0.05), src,
                         "" if "lora_dropout" in d else "TRL's ModelConfig default 0.05")
            if d.get("lora_modules_to_save"):
                extra = d["lora_modules_to_save"]
                src.values["lora_modules_to_save"] = extra if isinstance(extra, str) else ",".join(map(str, extra))
                src.read.append(("lora_modules_to_save", f"--lora-modules-to-save {src.values['lora_modules_to_save']}"))
        else:
            src.read.append(("use_peft", "false: full fine-tuning"))
    if not peft:  # TRL builds no PEFT config then (get_peft_config returns None)
        for k in ("lora_r", "lora_target_modules", "lora_modules_to_save", "lora_dropout"):
            if k in d:
                seen.add(k)
                src.read.append((k, "without use_peft: no adapters (no change to the plan)"))
    for k in ("use_dora", "use_rslora"):
        if k in d:
            seen.add(k)
            if peft and k == "use_dora" and as_bool(doc, (k,), d[k]):
                ignore(src, k, "DoRA's magnitude vectors and their extra forward are not planned (planned as LoRA)")
            else:
                src.read.append((k, "no change to memory or time"))
    four, eight = (("load_in_4bit" in d and as_bool(doc, ("load_in_4bit",), d["load_in_4bit"])),
                   ("load_in_8bit" in d and as_bool(doc, ("load_in_8bit",), d["load_in_8bit"])))
    seen |= {k for k in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant") if k in d}
    if four and peft:
        src.values["qlora"] = True
        kind = str(d.get("bnb_4bit_quant_type", "nf4"))
        src.read.append(("load_in_4bit", "true with use_peft: --qlora (bitsandbytes 4-bit base"
                         + (", fp4: the same 4 bits a weight as nf4)" if kind == "fp4" else ")")))
    elif four:
        ignore(src, "load_in_4bit", "a 4-bit base without use_peft (no adapters to train)")
    if "bnb_4bit_quant_type" in d:
        src.read.append(("bnb_4bit_quant_type", f"{d['bnb_4bit_quant_type']}: 4 bits a weight"))
    if "use_bnb_nested_quant" in d:
        src.read.append(("use_bnb_nested_quant", "the quantization constants' own quantization (planned with NF4's "
                         "constants)"))
    if eight:
        ignore(src, "load_in_8bit", "an 8-bit bitsandbytes base is not planned (planned in the compute dtype)")
    for k in ("load_in_4bit", "load_in_8bit"):
        if k in d and not (four if k == "load_in_4bit" else eight):
            src.read.append((k, "false"))
    seen |= attn_implementation(doc, d, src)
    if "torch_dtype" in d or "dtype" in d:
        k = "torch_dtype" if "torch_dtype" in d else "dtype"
        seen.add(k)
        dtype = str(d[k])
        ddp = src.values.get("strategy") == ["ddp"]
        if dtype == "bfloat16" and not peft and ddp and not four and src.values.get("precision") != "fp16-mixed":
            # the weights load in bf16 (TRL's scripts and the alignment handbook's get_model pass
            # torch_dtype to from_pretrained; SFTTrainer casts no full-fine-tuning weights:
            # huggingface/trl@f2cd57710ae345ea6428ae95363267fcf38a3dc8 trl/trainer/sft_trainer.py)
            # and DDP trains them as loaded: the Trainer's AdamW steps bf16 weights with no fp32
            # master and keeps its states in their dtype
            src.values["precision"] = "bf16-pure"
            src.read.append((k, "bfloat16, full fine-tuning under DDP: --precision bf16-pure (the weights loaded in "
                             "bf16 and stepped so, no fp32 master)"))
        elif dtype in ("bfloat16", "float16") and not peft and ddp and src.values.get("precision") != "bf16-pure":
            ignore(src, k, f"{dtype}: the weights are loaded (and so trained, with their optimizer states) in "
                   f"{dtype}; planned as {src.values.get('precision')} with fp32 master weights")
        elif dtype in ("bfloat16", "float16") and not peft and not ddp:
            # accelerate@16cb6eb80dd9aa8b4df1a63ef57863e455d53b83 src/accelerate/utils/fsdp_utils.py
            # fsdp2_prepare_model (accelerator.py for FSDP1) upcasts trainable parameters to fp32
            # when mixed_precision is not "no"
            src.read.append((k, f"{dtype}: the load dtype (DeepSpeed's bf16/fp16 optimizer keeps fp32 masters, and "
                             "accelerate upcasts FSDP's parameters to fp32 under mixed precision: no change to the "
                             "plan)"))
        else:
            src.read.append((k, f"{dtype}: the load dtype (the frozen base's, with adapters; no change to the plan)"))
    return seen


ATTN = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "sdpa", "eager": "eager"}


def attn_implementation(doc: Doc, d: dict, src: Source) -> set:
    """transformers' `attn_implementation` (a model argument of TRL, axolotl, LLaMA-Factory's
    `flash_attn`): flash_attention_2/3 = --attention flash, sdpa, eager; any other kernel is listed."""
    if "attn_implementation" not in d:
        return set()
    v = str(d["attn_implementation"])
    if v in ATTN:
        src.values["attention"] = ATTN[v]
        src.read.append(("attn_implementation", f"--attention {ATTN[v]}"))
    else:
        ignore(src, "attn_implementation", f"{v}: planned as sdpa")
    return {"attn_implementation"}


def _grpo(doc: Doc, d: dict, src: Source) -> set:
    """TRL's GRPOConfig (trl/trainer/grpo_config.py): each training row is one prompt and its
    completion, padded to max_prompt_length (default 512) + max_completion_length (default 256);
    the plan is of that training step only: the generation of the completions (vLLM or generate)
    and the reference model's forward are not planned, which the first lines say."""
    prompt = as_count(doc, ("max_prompt_length",), d.get("max_prompt_length", 512))
    completion = as_count(doc, ("max_completion_length",), d.get("max_completion_length", 256))
    if "seq_len" not in src.values:
        src.values["seq_len"] = prompt + completion
    src.read.append(("max_prompt_length/max_completion_length", f"--seq-len {prompt + completion} (a GRPO row is "
                     "the prompt and its completion" + ("" if {"max_prompt_length", "max_completion_length"} <= set(d)
                                                        else "; GRPOConfig's defaults 512 and 256 where unset") + ")"))
    src.read.append(("num_generations", f"{d['num_generations']} completions a prompt: rows of the batch"))
    src.warnings.append(f"{src.path.name}: a GRPO run (num_generations): planned is its policy's training step "
                        f"at sequence {prompt + completion}; the generation of completions (use_vllm/generate) and "
                        "the reference model (beta > 0) are not planned")
    seen = {"max_prompt_length", "max_completion_length", "num_generations"}
    for k in ("use_vllm", "vllm_device", "vllm_gpu_memory_utilization", "vllm_mode", "beta", "temperature"):
        if k in d:
            seen.add(k)
            src.ignored.append((k, "RL generation and the reference model are not planned"))
    if "num_processes" in d:
        seen.add("num_processes")
        ignore(src, "num_processes", f"{d['num_processes']}: the launcher's process count (accelerate launch "
               "--num_processes), not a TrainingArguments key: pass --gpus")
    return seen


def rest(doc: Doc, data: dict, src: Source, seen: set, no_effect: set) -> None:
    """List every top-level key not read: no effect on the plan, or ignored."""
    for k in data:
        if k in seen:
            continue
        if k in no_effect:
            src.read.append((k, "no change to memory or time"))
        else:
            src.ignored.append((k, "not a key shardwise plans"))


def read_trainer_args(doc: Doc, d: dict, src: Source, ctx: Context, *, batch_key: str = "per_device_train_batch_size",
                      ga_key: str = "gradient_accumulation_steps", ckpt_key: str | None = "gradient_checkpointing",
                      ckpt_default: bool = False) -> set:
    """The TrainingArguments keys (batch, accumulation, precision, optimizer, checkpointing,
    deepspeed / fsdp); the names of the first three can differ (axolotl). Returns the keys read."""
    seen: set = set()

    def take(k: str) -> Any:
        seen.add(k)
        return d.get(k)

    micro = take(batch_key)
    src.values["micro_batch"] = as_count(doc, (batch_key,), micro) if micro is not None else 8  # HF's default
    src.read.append((batch_key, f"--micro-batch {src.values['micro_batch']}" + ("" if micro is not None else
                                                                                 " (HF's default 8)")))
    ga = take(ga_key)
    if ga is not None:
        src.values["grad_accum"] = as_count(doc, (ga_key,), ga)
        src.read.append((ga_key, f"--grad-accum {src.values['grad_accum']}"))
    bf16, fp16 = take("bf16"), take("fp16")
    pure = take("pure_bf16")
    if pure is not None and as_bool(doc, ("pure_bf16",), pure):
        src.values["precision"] = "bf16-pure"
        src.read.append(("pure_bf16", "--precision bf16-pure"))
    elif bf16 is not None and bf16 != "auto" and as_bool(doc, ("bf16",), bf16):
        src.values["precision"] = "bf16-mixed"
        src.read.append(("bf16", "--precision bf16-mixed"))
    elif fp16 is not None and as_bool(doc, ("fp16",), fp16):
        src.values["precision"] = "fp16-mixed"
        src.read.append(("fp16", "--precision fp16-mixed"))
    elif bf16 == "auto":
        src.values["precision"] = "bf16-mixed"
        src.read.append(("bf16", "auto: --precision bf16-mixed (on a GPU with bf16)"))
    else:
        src.values["precision"] = "fp32"
        src.read.append(("bf16/fp16", "neither set: --precision fp32 (HF Trainer's default)"))
    optim = take("optim") or take("optimizer")
    if optim is not None:
        key = "optim" if "optim" in d else "optimizer"
        if str(optim) in OPTIM:
            src.values["optimizer"] = OPTIM[str(optim)]
            if str(optim) in OPTIM_IMPL:
                src.values["optimizer_impl"] = OPTIM_IMPL[str(optim)]
            src.read.append((key, f"--optimizer {OPTIM[str(optim)]}"))
        elif str(optim).startswith("galore"):
            raise refuse(doc, (key,), optim, "GaLore's low-rank gradient projection (its optimizer states and the "
                         "projection step) is not in shardwise's planner")
        else:
            ignore(src, key, f"{optim}: planned as AdamW (its states in fp32)")
    wd = take("weight_decay")
    if wd is not None:
        src.values["weight_decay"] = as_number(doc, ("weight_decay",), wd)
        src.read.append(("weight_decay", f"--weight-decay {src.values['weight_decay']:g}"))
    if ckpt_key:
        ck = take(ckpt_key)
        on = ckpt_default if ck is None else as_bool(doc, (ckpt_key,), ck)
        src.values["checkpointing"] = "full" if on else "none"
        src.read.append((ckpt_key, f"--checkpointing {src.values['checkpointing']}" + (
            "" if ck is not None else " (the default)")))
    liger = take("use_liger_kernel") or take("enable_liger_kernel")
    if liger:  # Liger's defaults (apply_liger_kernel_to_llama & co.: rope, rms_norm, swiglu, fused linear CE)
        src.values |= {"cross_entropy": "fused", "fused_norm": True, "fused_mlp": True}
        src.read.append(("use_liger_kernel" if "use_liger_kernel" in d else "enable_liger_kernel",
                         "--cross-entropy fused --fused-norm --fused-mlp (Liger's defaults: fused linear "
                         "cross-entropy, RMSNorm, SwiGLU; its RoPE is not planned apart)"))
    if take("torch_compile"):
        src.values["fused_kernels"] = True
        src.read.append(("torch_compile", "--fused-kernels"))
    ds = take("deepspeed")
    fsdp, fsdp_config = take("fsdp"), take("fsdp_config")
    if ds:
        _deepspeed(doc, ds, src, ctx)
    elif fsdp:
        _fsdp(doc, fsdp, fsdp_config, src, ctx)
    else:
        src.values["strategy"] = ["ddp"]
        src.family = ("ddp",)
        src.read.append(("(no deepspeed, no fsdp)", "-s ddp (HF Trainer's DistributedDataParallel)"))
    engine_keys = src.keys_of
    src.keys_of = lambda s: {**(engine_keys(s) if engine_keys else {}), **_keys(s, batch_key, ga_key, ckpt_key)}
    return seen


def _keys(s: Setting, batch_key: str, ga_key: str, ckpt_key: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {batch_key: s.micro_batch, ga_key: s.grad_accum}
    if ckpt_key:
        out[ckpt_key] = s.checkpointing != "none"
    return out


def _deepspeed(doc: Doc, ds: Any, src: Source, ctx: Context) -> None:
    if isinstance(ds, dict):
        where = "deepspeed."
        flat = ds_reader.read_into(doc, ds, src, ctx, under="these arguments", prefix=("deepspeed",))
    else:
        path = resolve_path(doc, ("deepspeed",), ds)
        inner = load(path)
        src.read.append(("deepspeed", f"{path} (read below; \"auto\" filled from these arguments)"))
        n = len(src.read)
        flat = ds_reader.read_into(inner, inner.data, src, ctx, under="these arguments")
        src.read[n:] = [(f"{path.name}: {k}", v) for k, v in src.read[n:]]
        src.ignored = [(k if ":" in k else f"{path.name}: {k}", v) for k, v in src.ignored]
        where = f"in {path.name}: "
    src.family = ds_reader.DS_FAMILY
    src.keys_of = lambda s: ds_reader.zero_keys(s, flat, ctx, src, where=where)


def _fsdp(doc: Doc, fsdp: Any, cfg: Any, src: Source, ctx: Context) -> None:
    if isinstance(cfg, str):
        cfg = load(resolve_path(doc, ("fsdp_config",), cfg)).data
    if not isinstance(cfg, dict | None):
        raise doc.error(("fsdp_config",), cfg, "a mapping of fsdp_* keys, or the path of a file of them")
    named = {(k[5:] if k.startswith("fsdp_") else k): k for k in (cfg or {}) if isinstance(k, str)}  # as written
    cfg = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in (cfg or {}).items() if isinstance(k, str)}
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    version = cfg.get("version", 2)
    if str(version) not in ("1", "2"):
        raise doc.error(("fsdp_config", "version"), version, "1 or 2")
    version = int(version)
    for item in items:
        if item in ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard", "hybrid_shard_zero2"):
            cfg.setdefault("reshard_after_forward", item if version == 1 else item == "full_shard")
        elif item == "offload":
            cfg.setdefault("cpu_offload", True)
        elif item != "auto_wrap":
            raise doc.error(("fsdp",), fsdp, "full_shard, shard_grad_op, hybrid_shard, no_shard, offload, auto_wrap")
    fsdp_knobs = src.knobs["fsdp"]
    fsdp_knobs |= {"single_rank": "fsdp", "reduce_every_micro_batch": False}
    reshard = cfg.get("reshard_after_forward", cfg.get("sharding_strategy", True if version == 2 else "full_shard"))
    if version == 2:
        if isinstance(reshard, str) and reshard.upper() in ("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP"):
            reshard = reshard.upper() != "SHARD_GRAD_OP"  # an FSDP1 sharding_strategy under FSDP2 (accelerate maps it)
        on = as_bool(doc, ("fsdp_config", "reshard_after_forward"), reshard)
        name = "fsdp" if on else "fsdp-grad-op"
        if on:  # as accelerate prepares the model (ingest/accelerate.py FSDP2_RESHARDED)
            from shardwise.ingest.accelerate import FSDP2_RESHARDED

            fsdp_knobs |= FSDP2_RESHARDED
    else:
        from shardwise.ingest.accelerate import FSDP1

        name, how = FSDP1.get(str(reshard).upper(), (None, None))
        if name is None:
            raise doc.error(("fsdp_config", "reshard_after_forward"), reshard, ", ".join(FSDP1).lower())
        if how:
            fsdp_knobs["reshard_after_forward"] = how
        src.notes.append("FSDP1 planned as FSDP2 with the same sharding")
    # offload: HF's `cpu_offload` ("offload" in the fsdp string), accelerate's and axolotl's
    # `(fsdp_)offload_params` (accelerate utils/dataclasses.py FullyShardedDataParallelPlugin.cpu_offload)
    off_key = next((k for k in ("cpu_offload", "offload_params") if k in cfg), None)
    if off_key and as_bool(doc, ("fsdp_config", off_key), cfg[off_key]):
        if name != "fsdp":
            raise doc.error(("fsdp_config", off_key), cfg[off_key], f"false with {name} (shardwise plans offload "
                            "with full sharding: fsdp+offload)")
        name = "fsdp+offload"
        src.read.append((f"fsdp_config.{named.get(off_key, off_key)}", "true: -s fsdp+offload (CPUOffloadPolicy)"))
    elif off_key:
        src.read.append((f"fsdp_config.{named.get(off_key, off_key)}", "false: no offload"))
    if "activation_checkpointing" in cfg and as_bool(doc, ("fsdp_config", "activation_checkpointing"),
                                                      cfg["activation_checkpointing"]):
        src.values["checkpointing"] = "full"
    for k in cfg:
        if k in ("version", "reshard_after_forward", "sharding_strategy", "cpu_offload", "offload_params"):
            continue
        key = f"fsdp_config.{named.get(k, k)}"
        if k in FSDP_NO_EFFECT:
            src.read.append((key, "no change to memory or time"))
        elif k == "activation_checkpointing":
            src.read.append((key, f"--checkpointing {src.values.get('checkpointing', 'none')}"))
        elif k == "auto_wrap_policy" and cfg[k] == "TRANSFORMER_BASED_WRAP":
            src.read.append((key, "one unit per decoder layer (the plan's unit)"))
        else:
            src.ignored.append((key, "not planned (FSDP prefetch and wrap details)"))
    precision = src.values.get("precision", "fp32")
    fsdp_knobs["reduce_dtype"] = "fp32" if precision == "fp32" else "param"
    src.values["strategy"] = [name]
    src.read.append(("fsdp/fsdp_config", f"-s {name}, FSDP{version} through accelerate's plugin "
                     f"(reshard_after_forward {reshard}, reduce in the compute dtype)"))
    from shardwise.ingest.accelerate import FSDP_FAMILY

    src.family = FSDP_FAMILY
    src.keys_of = lambda s: {"fsdp_config.reshard_after_forward": s.strategy != "fsdp-grad-op",
                             "fsdp_config.cpu_offload": s.strategy == "fsdp+offload"}
