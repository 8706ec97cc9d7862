"""A LLaMA-Factory training YAML (`llamafactory-cli train FILE`; keys from its examples/ and
hparams: ModelArguments, DataArguments, FinetuningArguments, TrainingArguments). Stock
semantics: gradient checkpointing is ON unless `disable_gradient_checkpointing: true`
(llamafactory/model/model_utils/checkpointing.py), `cutoff_len` is the sequence (default 2048),
`finetuning_type: lora` with `lora_rank` (default 8) and `lora_target` (default all: every
linear), QLoRA with `quantization_bit: 4` (bitsandbytes NF4), `deepspeed:` a DeepSpeed JSON
("auto" filled from these arguments), `enable_liger_kernel`, `pure_bf16`."""

from __future__ import annotations

from typing import Any

from shardwise.ingest.common import (
    Context,
    Doc,
    Source,
    as_bool,
    as_count,
    hub_model,
    ignore,
    lora_dropout,
    refuse,
    unstated,
)
from shardwise.ingest.training_args import NO_EFFECT, read_trainer_args, rest

LF_KEYS = {"stage", "finetuning_type", "cutoff_len", "template", "lora_target", "dataset"}
LF_NO_EFFECT = NO_EFFECT | {"stage", "template", "dataset", "dataset_dir", "max_samples", "overwrite_cache",
                            "preprocessing_num_workers", "val_size", "lora_alpha",
                            "quantization_method", "eval_dataset", "image_max_pixels",
                            "video_max_pixels", "mix_strategy", "neat_packing", "tokenized_path", "report_to",
                            "do_predict", "predict_with_generate", "infer_backend", "quantization_type"}


def is_llama_factory(data: dict[str, Any]) -> bool:
    return "model_name_or_path" in data and bool(set(data) & LF_KEYS)


def read(doc: Doc, ctx: Context) -> Source:
    d = doc.data
    src = Source("llama_factory", doc.path)
    # the model first: a DeepSpeed JSON's "auto" buckets are derived from its hidden size
    _refusals(doc, d)
    hub_model(doc, ("model_name_or_path",), d.get("model_name_or_path"), src, ctx)
    seen = read_trainer_args(doc, d, src, ctx, ckpt_key=None)
    seen |= {"fp8", "fp8_backend", "fp8_enable_fsdp_float8_all_gather", "use_galore", "flash_attn"}
    if "use_galore" in d:
        src.read.append(("use_galore", "false"))
    _fp8(doc, d, src)
    if "flash_attn" in d:
        how = {"fa2": "flash", "fa3": "flash", "sdpa": "sdpa", "disabled": "eager"}.get(str(d["flash_attn"]))
        if how:
            src.values["attention"] = how
            src.read.append(("flash_attn", f"--attention {how}"))
        else:  # auto: transformers' own choice, sdpa where available
            src.read.append(("flash_attn", f"{d['flash_attn']}: transformers' default (sdpa)"))
    seen |= {"model_name_or_path", "trust_remote_code", "cutoff_len", "finetuning_type", "lora_rank", "lora_target",
             "quantization_bit", "disable_gradient_checkpointing", "additional_target", "packing",
             "enable_liger_kernel", "pure_bf16", "lora_dropout"}
    src.values["seq_len"] = as_count(doc, ("cutoff_len",), d.get("cutoff_len", 2048))
    src.read.append(("cutoff_len", f"--seq-len {src.values['seq_len']}" + ("" if "cutoff_len" in d else
                                                                          " (LLaMA-Factory's default 2048)")))
    off = as_bool(doc, ("disable_gradient_checkpointing",), d.get("disable_gradient_checkpointing", False))
    src.values["checkpointing"] = "none" if off else "full"
    src.read.append(("disable_gradient_checkpointing", f"{off}: --checkpointing {src.values['checkpointing']}"
                     + ("" if "disable_gradient_checkpointing" in d else " (LLaMA-Factory checkpoints by default)")))
    kind = str(d.get("finetuning_type", "lora"))
    if kind == "lora":
        rank = as_count(doc, ("lora_rank",), d.get("lora_rank", 8))
        target = d.get("lora_target", "all")
        targets = "all-linear" if str(target).strip() == "all" else ",".join(
            str(t).strip() for t in (target if isinstance(target, list) else str(target).split(",")))
        src.values |= {"lora_rank": rank, "lora_targets": targets}
        src.read.append(("finetuning_type", f"lora: --lora-rank {rank} --lora-targets {targets}"))
        if "lora_dropout" in d:
            lora_dropout(doc, ("lora_dropout",), d["lora_dropout"], src)
        extra = d.get("additional_target")
        if extra:
            src.values["lora_modules_to_save"] = extra if isinstance(extra, str) else ",".join(map(str, extra))
            src.read.append(("additional_target", f"--lora-modules-to-save {src.values['lora_modules_to_save']}"))
        bits = d.get("quantization_bit")
        if bits is not None:
            if as_count(doc, ("quantization_bit",), bits) == 4:
                src.values["qlora"] = True
                src.read.append(("quantization_bit", "4: --qlora (bitsandbytes NF4 base)"))
            else:
                ignore(src, "quantization_bit", f"{bits}-bit base: not planned (planned in the compute dtype)")
    elif kind == "full":
        src.values["lora_rank"] = 0
        src.read.append(("finetuning_type", "full: --lora-rank 0"))
    else:
        ignore(src, "finetuning_type", f"{kind}: planned as full fine-tuning")
    if kind != "lora" and "lora_dropout" in d:
        src.read.append(("lora_dropout", f"finetuning_type {kind}: no adapters, no change to memory or time"))
    if d.get("packing"):
        src.values["packed_attention"] = "sdpa_varlen"
        src.read.append(("packing", "true: documents packed (--packed-attention sdpa_varlen)"))
    seen |= _preference(doc, d, src, lora=kind == "lora")
    engine_keys = src.keys_of
    src.keys_of = lambda s: {**engine_keys(s), "disable_gradient_checkpointing": s.checkpointing == "none"}
    unstated(src, ctx, precision=False)  # the launcher's GPUs
    rest(doc, d, src, seen, LF_NO_EFFECT)
    return src


# LLaMA-Factory's preference stages (hiyouga/LLaMA-Factory ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30):
# hparams/finetuning_args.py `stage` (pt, sft, rm, ppo, dpo, kto) and `pref_loss` (sigmoid = DPO, hinge,
# ipo, kto_pair: DPO variants with a reference; orpo, simpo: `use_ref_model` False, no reference);
# train/trainer_utils.py `create_ref_model`: `ref_model` names another checkpoint, else a copy of the
# model itself, or, under finetuning_type lora, none (the base with the adapters disabled); train/dpo/
# trainer.py prepares it with TRL's prepare_deepspeed / prepare_fsdp (FSDP2: accelerate's
# fsdp2_prepare_model) or accelerator.prepare_model(evaluation_mode=True), and `concatenated_forward`
# runs chosen and rejected in one batch.
PREF_LOSS = {"sigmoid": "dpo", "hinge": "dpo", "ipo": "dpo", "kto_pair": "dpo", "orpo": "orpo", "simpo": "simpo"}
PREF_NO_EFFECT = ("pref_beta", "pref_ftx", "simpo_gamma", "dpo_label_smoothing", "kto_chosen_weight",
                  "kto_rejected_weight", "pref_bco_weight", "ld_alpha")


def _preference(doc: Doc, d: dict, src: Source, *, lora: bool) -> set:
    """`stage` and the preference keys: the objective and its reference. Returns the keys read."""
    stage = str(d.get("stage", "sft"))
    seen = {"stage"}
    if stage in ("pt", "sft"):
        src.read.append(("stage", f"{stage}: planned as SFT"))
        return seen
    if stage not in ("dpo", "kto"):
        src.ignored.append(("stage", f"{stage}: planned as SFT (shardwise plans sft, dpo, kto, orpo, simpo)"))
        return seen
    loss = str(d.get("pref_loss", "sigmoid")) if stage == "dpo" else "kto"
    if stage == "dpo":
        seen.add("pref_loss")
        if loss not in PREF_LOSS:
            raise doc.error(("pref_loss",), loss, ", ".join(PREF_LOSS))
    objective = PREF_LOSS.get(loss, "kto")
    src.values["objective"] = objective
    src.read.append(("stage" if stage == "kto" else "stage/pref_loss",
                     f"{stage}" + (f", pref_loss {loss}" if stage == "dpo" else "") + f": --objective {objective}"))
    if objective in ("dpo", "kto"):
        ref = d.get("ref_model")
        seen |= {"ref_model", "ref_model_adapters", "ref_model_quantization_bit"}
        if ref is not None:
            src.values["reference"] = "model"
            src.read.append(("ref_model", f"{ref}: --reference model (planned with the policy's shape)"))
        elif lora:
            src.values["reference"] = "adapters_off"
            src.read.append(("ref_model", "unset under LoRA: --reference adapters-off (the base with the adapters "
                             "disabled, no extra weights)"))
        else:
            src.values["reference"] = "model"
            src.read.append(("ref_model", "unset: --reference model (a frozen copy of the model)"))
        if d.get("ref_model_quantization_bit") is not None:
            src.ignored.append(("ref_model_quantization_bit", "a quantized reference is planned in the compute dtype"))
    for k in PREF_NO_EFFECT:
        if k in d:
            seen.add(k)
            src.read.append((k, "the loss's coefficient: no change to memory or time"))
    return seen


def _refusals(doc: Doc, d: dict) -> None:
    """What LLaMA-Factory runs and the planner cannot: `use_galore` (GaLore's
    projected optimizer; LLaMA-Factory itself refuses the layer-wise one under distributed training,
    hparams/parser.py), `finetuning_type: freeze` (only the last `freeze_trainable_layers` layers
    train: TrainSpec trains every layer or LoRA adapters, not a subset of layers)."""
    if "use_galore" in d and as_bool(doc, ("use_galore",), d["use_galore"]):
        raise refuse(doc, ("use_galore",), d["use_galore"], "GaLore's low-rank gradient projection (its optimizer "
                     "states and projection step) is not in shardwise's planner" + (
                         "; and LLaMA-Factory refuses galore_layerwise under distributed training"
                         if d.get("galore_layerwise") else ""))
    if str(d.get("finetuning_type", "lora")) == "freeze":
        n = d.get("freeze_trainable_layers", 2)
        raise refuse(doc, ("finetuning_type",), "freeze", f"only the last {n} layer(s) train (freeze_trainable_layers), "
                     "and the planner trains every layer (full) or LoRA adapters, not a subset of layers")


# LLaMA-Factory's fp8 backends (train/fp8_utils.py at hiyouga/LLaMA-Factory 7f564fdb: `auto` and `torchao`
# build torchao's Float8LinearConfig.from_recipe_name("rowwise"); `te` sets FP8_BACKEND for accelerate,
# whose Transformer Engine recipe is DelayedScaling); fp8_enable_fsdp_float8_all_gather is only logged
FP8_BACKENDS = {"auto": "rowwise", "torchao": "rowwise", "te": "delayed"}


def _fp8(doc: Doc, d: dict, src: Source) -> None:
    if "fp8" not in d or not as_bool(doc, ("fp8",), d["fp8"]):
        for k in ("fp8", "fp8_backend", "fp8_enable_fsdp_float8_all_gather"):
            if k in d:
                src.read.append((k, f"{d[k]}: no change to memory or time (fp8 off)"))
        return
    backend = str(d.get("fp8_backend", "auto"))
    if backend not in FP8_BACKENDS:
        raise refuse(doc, ("fp8_backend",), backend, "MS-AMP's fp8 optimizer states and weights are not planned "
                     "(auto, torchao: torchao float8 linears; te: Transformer Engine are)")
    src.values["fp8"] = FP8_BACKENDS[backend]
    src.read.append(("fp8", f"--fp8 {FP8_BACKENDS[backend]} (fp8_backend {backend})"))
    if "fp8_backend" in d:
        src.read.append(("fp8_backend", f"{backend}: --fp8 {FP8_BACKENDS[backend]}"))
    if "fp8_enable_fsdp_float8_all_gather" in d:
        src.read.append(("fp8_enable_fsdp_float8_all_gather", "no change to memory or time (LLaMA-Factory only "
                         "logs it; its float8 config is rowwise, which has no fp8 all-gather)"))
