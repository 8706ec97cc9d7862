"""An axolotl config YAML (`axolotl train FILE`; keys from its docs/config reference and
examples/): `base_model`, `sequence_len`, `micro_batch_size`, `gradient_accumulation_steps`,
`bf16`/`fp16`, `gradient_checkpointing`, `adapter: lora | qlora` with `lora_r` and
`lora_target_modules` / `lora_target_linear`, `load_in_4bit`, `deepspeed:` (a JSON) or
`fsdp_config` (its FSDP keys, with or without the `fsdp_` prefix; `fsdp_version` beside them),
`flash_attention`, `sample_packing`, `plugins`' Liger kernels. Stock semantics: axolotl builds
HF TrainingArguments from these, so the readers of shardwise.ingest.training_args apply."""

from __future__ import annotations

from typing import Any

from shardwise.ingest.common import Context, Doc, Source, as_bool, as_count, hub_model
from shardwise.ingest.training_args import NO_EFFECT, read_trainer_args, rest

AX_KEYS = {"base_model", "micro_batch_size", "sequence_len", "adapter", "lora_r"}
AX_NO_EFFECT = NO_EFFECT | {"model_type", "tokenizer_type", "datasets", "dataset_prepared_path", "val_set_size",
                            "lora_alpha", "lora_dropout", "lr_scheduler", "num_epochs", "wandb_project",
                            "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "train_on_inputs",
                            "group_by_length", "early_stopping_patience", "local_rank", "xformers_attention",
                            "warmup_steps", "evals_per_epoch", "saves_per_epoch", "debug", "special_tokens",
                            "pad_to_sequence_len", "eval_sample_packing", "chat_template", "strict", "tf32",
                            "resume_from_checkpoint", "logging_steps", "flash_attention", "sdp_attention",
                            "load_in_8bit", "lora_fan_in_fan_out", "lora_model_dir", "hub_model_id"}


def is_axolotl(data: dict[str, Any]) -> bool:
    return "base_model" in data or len(set(data) & AX_KEYS) >= 2


def read(doc: Doc, ctx: Context) -> Source:
    d = dict(doc.data)
    src = Source("axolotl", doc.path)
    fsdp_cfg = d.get("fsdp_config")
    if fsdp_cfg and not d.get("fsdp"):
        d["fsdp"] = "full_shard auto_wrap"  # axolotl turns FSDP on from fsdp_config
        if "fsdp_version" in d and isinstance(fsdp_cfg, dict):
            fsdp_cfg = {**fsdp_cfg, "version": d["fsdp_version"]}
    hub_model(doc, ("base_model",), d.get("base_model"), src, ctx)  # first: "auto" buckets need its hidden size
    seen = read_trainer_args(doc, {**d, "fsdp_config": fsdp_cfg}, src, ctx, batch_key="micro_batch_size",
                             ckpt_key="gradient_checkpointing")
    seen |= {"base_model", "trust_remote_code", "sequence_len", "adapter", "lora_r", "lora_target_modules",
             "lora_target_linear", "load_in_4bit", "sample_packing", "fsdp_version", "fsdp_config", "fsdp",
             "lora_modules_to_save", "plugins", "liger_fused_linear_cross_entropy"}
    if "sequence_len" in d:
        src.values["seq_len"] = as_count(doc, ("sequence_len",), d["sequence_len"])
        src.read.append(("sequence_len", f"--seq-len {src.values['seq_len']}"))
    adapter = d.get("adapter")
    if adapter in ("lora", "qlora"):
        rank = as_count(doc, ("lora_r",), d.get("lora_r", 8))
        if d.get("lora_target_linear"):
            targets = "all-linear"
        else:
            mods = d.get("lora_target_modules") or ["q_proj", "v_proj"]
            targets = ",".join(mods if isinstance(mods, list) else [str(mods)])
        src.values |= {"lora_rank": rank, "lora_targets": targets}
        src.read.append(("adapter", f"{adapter}: --lora-rank {rank} --lora-targets {targets}"))
        if d.get("lora_modules_to_save"):
            src.values["lora_modules_to_save"] = ",".join(d["lora_modules_to_save"])
            src.read.append(("lora_modules_to_save", f"--lora-modules-to-save {src.values['lora_modules_to_save']}"))
        four = d.get("load_in_4bit")
        if adapter == "qlora" or (four is not None and as_bool(doc, ("load_in_4bit",), four)):
            src.values["qlora"] = True
            src.read.append(("load_in_4bit", "--qlora (bitsandbytes NF4 base)"))
    elif adapter is not None:
        src.ignored.append(("adapter", f"{adapter}: planned as full fine-tuning"))
    if d.get("load_in_8bit") and adapter:
        src.ignored.append(("load_in_8bit", "an 8-bit base is not planned (planned in the compute dtype)"))
    if d.get("sample_packing"):
        src.values["packed_attention"] = "flash_varlen" if d.get("flash_attention") else "sdpa_varlen"
        src.read.append(("sample_packing", f"true: --packed-attention {src.values['packed_attention']}"))
    if d.get("flash_attention"):
        src.values["attention"] = "flash"
    if d.get("liger_fused_linear_cross_entropy"):
        src.values["cross_entropy"] = "fused"
        src.read.append(("liger_fused_linear_cross_entropy", "--cross-entropy fused"))
    rest(doc, doc.data, src, seen, AX_NO_EFFECT)
    return src
