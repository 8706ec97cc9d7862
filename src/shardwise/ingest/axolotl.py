"""An axolotl config YAML (`axolotl train FILE`; keys from its docs/config reference and
examples/): `base_model`, `sequence_len`, `micro_batch_size`, `gradient_accumulation_steps`,
`bf16`/`fp16`, `gradient_checkpointing`, `adapter: lora | qlora` with `lora_r` and
`lora_target_modules` / `lora_target_linear`, `load_in_4bit`, `deepspeed:` (a JSON) or
`fsdp_config` (its FSDP keys, with or without the `fsdp_` prefix; `fsdp_version` beside them),
`flash_attention`, `sample_packing`, `plugins`' Liger kernels. Stock semantics: axolotl builds
HF TrainingArguments from these, so the readers of shardwise.ingest.training_args apply."""

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
from shardwise.ingest.training_args import NO_EFFECT, attn_implementation, read_trainer_args, rest

# axolotl's N-D parallelism (its docs "N-D Parallelism"; utils/schemas: dp_shard_size, dp_replicate_size,
# tensor_parallel_size, context_parallel_size, expert_parallel_size), a device mesh whose product
# is the world size
MESH = ("dp_shard_size", "dp_replicate_size", "tensor_parallel_size", "context_parallel_size",
        "expert_parallel_size")

AX_KEYS = {"base_model", "micro_batch_size", "sequence_len", "adapter", "lora_r"}
AX_NO_EFFECT = NO_EFFECT | {"model_type", "tokenizer_type", "datasets", "dataset_prepared_path", "val_set_size",
                            "lora_alpha", "lr_scheduler", "num_epochs", "wandb_project",
                            "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "train_on_inputs",
                            "group_by_length", "early_stopping_patience", "local_rank", "xformers_attention",
                            "warmup_steps", "evals_per_epoch", "saves_per_epoch", "debug", "special_tokens",
                            "pad_to_sequence_len", "eval_sample_packing", "chat_template", "strict", "tf32",
                            "resume_from_checkpoint", "logging_steps", "flash_attention", "sdp_attention",
                            "lora_fan_in_fan_out", "lora_model_dir", "hub_model_id", "is_llama_derived_model",
                            "eval_table_size", "learning_rate",
                            "unfrozen_parameters"}  # empty: nothing frozen (a pattern list is refused: _unfrozen)


def is_axolotl(data: dict[str, Any]) -> bool:
    return "base_model" in data or len(set(data) & AX_KEYS) >= 2


def read(doc: Doc, ctx: Context) -> Source:
    d = dict(doc.data)
    src = Source("axolotl", doc.path)
    _unfrozen(doc, d)
    fsdp_cfg = d.get("fsdp_config")
    if fsdp_cfg and not d.get("fsdp"):
        d["fsdp"] = "full_shard auto_wrap"  # axolotl turns FSDP on from fsdp_config
        if "fsdp_version" in d and isinstance(fsdp_cfg, dict):
            fsdp_cfg = {**fsdp_cfg, "version": d["fsdp_version"]}
    hub_model(doc, ("base_model",), d.get("base_model"), src, ctx)  # first: "auto" buckets need its hidden size
    # bf16 unset is axolotl's default "auto" (utils/schemas/config.py: bf16 = "auto", on a bf16 GPU true)
    seen = read_trainer_args(doc, {"bf16": "auto", **d, "fsdp_config": fsdp_cfg}, src, ctx,
                             batch_key="micro_batch_size", ckpt_key="gradient_checkpointing")
    seen |= {"base_model", "trust_remote_code", "sequence_len", "adapter", "lora_r", "lora_target_modules",
             "lora_target_linear", "load_in_4bit", "sample_packing", "fsdp_version", "fsdp_config", "fsdp",
             "lora_modules_to_save", "lora_dropout", "plugins", "liger_fused_linear_cross_entropy", "liger_rms_norm",
             "liger_glu_activation", "liger_rope", "liger_layer_norm"}
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
        if "lora_dropout" in d:
            lora_dropout(doc, ("lora_dropout",), d["lora_dropout"], src)
        if d.get("lora_modules_to_save"):
            src.values["lora_modules_to_save"] = ",".join(d["lora_modules_to_save"])
            src.read.append(("lora_modules_to_save", f"--lora-modules-to-save {src.values['lora_modules_to_save']}"))
        four = d.get("load_in_4bit")
        if adapter == "qlora" or (four is not None and as_bool(doc, ("load_in_4bit",), four)):
            src.values["qlora"] = True
            src.read.append(("load_in_4bit", "--qlora (bitsandbytes NF4 base)"))
    elif adapter is not None:
        src.ignored.append(("adapter", f"{adapter}: planned as full fine-tuning"))
    if adapter not in ("lora", "qlora") and "lora_dropout" in d:
        src.read.append(("lora_dropout", "no adapter: no change to memory or time"))
    _bf16_weights(d, src, lora=adapter in ("lora", "qlora"))
    eight = d.get("load_in_8bit")
    if eight is not None and as_bool(doc, ("load_in_8bit",), eight):
        ignore(src, "load_in_8bit", "an 8-bit bitsandbytes base is not planned (planned in the compute dtype)")
    elif eight is not None:
        src.read.append(("load_in_8bit", "false"))
    seen |= _fp8(doc, d, src)
    seen |= {"load_in_8bit"} | attn_implementation(doc, d, src) | _mesh(doc, d, src, ctx)
    plugins = d.get("plugins") or []
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        if "cut_cross_entropy" in str(plugin):
            src.values["cross_entropy"] = "fused"
            src.read.append(("plugins", f"{plugin}: --cross-entropy fused (Cut Cross-Entropy: no logits held)"))
        elif "liger" in str(plugin).lower():
            src.read.append(("plugins", f"{plugin}: its kernels as the liger_* keys say"))
        else:
            ignore(src, "plugins", f"{plugin}: not planned")
    if d.get("sample_packing"):
        flash = d.get("flash_attention") or src.values.get("attention") == "flash"  # or attn_implementation's
        src.values["packed_attention"] = "flash_varlen" if flash else "sdpa_varlen"
        src.read.append(("sample_packing", f"true: --packed-attention {src.values['packed_attention']}"))
    if d.get("flash_attention"):
        src.values["attention"] = "flash"
    if d.get("liger_fused_linear_cross_entropy"):
        src.values["cross_entropy"] = "fused"
        src.read.append(("liger_fused_linear_cross_entropy", "--cross-entropy fused"))
    # axolotl's LigerPlugin keys (axolotl-ai-cloud/axolotl src/axolotl/integrations/liger/args.py)
    for key, field, flag in (("liger_rms_norm", "fused_norm", "--fused-norm"),
                             ("liger_glu_activation", "fused_mlp", "--fused-mlp")):
        if key in d and as_bool(doc, (key,), d[key]):
            src.values[field] = True
            src.read.append((key, flag))
        elif key in d:
            src.read.append((key, "false"))
    for key in ("liger_rope", "liger_layer_norm"):
        if key in d:
            src.read.append((key, "Liger's kernel in place of the eager one: its elementwise bytes are not planned "
                             "apart"))
    unstated(src, ctx, precision=False)  # the launcher's GPUs
    rest(doc, doc.data, src, seen, AX_NO_EFFECT)
    return src


def _bf16_weights(d: dict, src: Source, *, lora: bool) -> None:
    """axolotl loads the model in the dtype of its precision: resolve_dtype sets torch_dtype bfloat16
    for bf16 (true, or auto on a bf16 GPU) (axolotl-ai-cloud/axolotl@067b021c8b87a9e5e380b9173c704cf7340e30f5
    src/axolotl/utils/config/__init__.py). Full fine-tuning under DDP (no deepspeed, no fsdp) then
    trains those bf16 weights: HF Trainer's AdamW steps them with no fp32 master and keeps its states
    in their dtype, which is bf16-pure. (loaders/model.py _configure_embedding_dtypes moves the
    embeddings, lm_head and norms to fp32 outside FSDP: planned in bf16 with the rest.) Under
    DeepSpeed its bf16 optimizer keeps fp32 masters, and accelerate upcasts FSDP's parameters to
    fp32 for mixed precision (huggingface/accelerate@16cb6eb80dd9aa8b4df1a63ef57863e455d53b83
    src/accelerate/utils/fsdp_utils.py fsdp2_prepare_model, src/accelerate/accelerator.py for
    FSDP1): bf16-mixed there, as read."""
    if lora or src.values.get("strategy") != ["ddp"] or src.values.get("precision") != "bf16-mixed":
        return
    src.values["precision"] = "bf16-pure"
    src.read.append(("bf16", f"{d.get('bf16')}: torch_dtype bfloat16 (axolotl's resolve_dtype), full fine-tuning "
                     "under DDP: --precision bf16-pure (bf16 weights, gradients and optimizer states; axolotl's fp32 "
                     "embeddings, lm_head and norms planned in bf16)"))


def _unfrozen(doc: Doc, d: dict) -> None:
    """`unfrozen_parameters`: axolotl freezes every parameter but those its patterns match
    (axolotl-ai-cloud/axolotl@067b021c8b87a9e5e380b9173c704cf7340e30f5 src/axolotl/train.py calls
    src/axolotl/utils/freeze.py freeze_layers_except(model, cfg.unfrozen_parameters): requires_grad
    False, then True for the matches): gradients and optimizer states for a subset of tensors,
    which is neither full fine-tuning nor LoRA, the two the planner plans. Refused, before any
    other key (a DeepSpeed JSON it names included): its run is not plannable whatever they say."""
    pats = d.get("unfrozen_parameters")
    if pats:
        n = len(pats) if isinstance(pats, list) else 1
        raise refuse(doc, ("unfrozen_parameters",), f"{n} pattern(s)", "axolotl trains only the parameters these "
                     "patterns match (utils/freeze.py freeze_layers_except; the rest frozen): the gradients and "
                     "optimizer states of a subset of tensors are not planned (the planner plans full fine-tuning "
                     "or LoRA adapters)")


def _mesh(doc: Doc, d: dict, src: Source, ctx: Context) -> set:
    """axolotl's mesh keys: tensor_parallel_size = --tp; context_parallel_size (or the older
    sequence_parallel_degree) = --cp, as `_context` reads it; dp_replicate_size > 1 beside
    dp_shard_size = HSDP (fsdp-hybrid, whose shard group is dp_shard_size × context_parallel_size:
    FSDP shards over both, as torchtitan's dp_shard_cp); expert parallelism is refused (axolotl's ep
    axis is not the layout plan/experts.py plans). With dp_shard_size given the world size is the
    product, as axolotl requires it (a --gpus given beside the file wins, as every flag does)."""
    sizes = {k: as_count(doc, (k,), d[k]) for k in MESH if d.get(k) is not None}
    if sizes.get("expert_parallel_size", 1) > 1:
        # axolotl-ai-cloud/axolotl@067b021 docs/nd_parallelism.qmd:50: expert_parallel_size × dp_shard_size =
        # world size, FSDP shards the non-expert weights (and each EP slice's experts) over dp_shard only
        raise refuse(doc, ("expert_parallel_size",), sizes["expert_parallel_size"],
                     "axolotl's expert parallelism is a mesh axis of its own (expert_parallel_size × dp_shard_size = "
                     "world size; the non-expert weights sharded over dp_shard only), not the layout shardwise "
                     "plans (ep borrowed from the sharded data-parallel ranks, as torchtitan and Megatron-Core run "
                     "it): plan the run with expert_parallel_size: 1, or compare with --ep on the command line")
    cp = _context(doc, d, src, sizes)
    if not sizes:
        return {"sequence_parallel_degree", "ring_attn_func", "heads_k_stride"}
    tp, rep, shard = (sizes.get(k, 1) for k in ("tensor_parallel_size", "dp_replicate_size", "dp_shard_size"))
    if tp > 1:
        src.values["tp"] = tp
        src.read.append(("tensor_parallel_size", f"--tp {tp} (transformers' tensor parallel plan, DTensor)"))
    if "dp_shard_size" in sizes:
        world = tp * rep * shard * cp
        src.values["gpus"] = world
        src.read.append(("dp_shard_size", f"{shard}: --gpus {world} (dp_shard {shard} × dp_replicate {rep} × tp {tp}"
                         + (f" × cp {cp})" if cp > 1 else ")")))
    if rep > 1 and shard > 1:
        if src.values.get("strategy") != ["fsdp"]:
            raise doc.error(("dp_replicate_size",), rep, f"1 with -s {src.values.get('strategy', ['?'])[0]} (HSDP "
                            "shards with FSDP, full sharding, no offload)")
        src.values["strategy"] = ["fsdp-hybrid"]
        src.shard_group = shard * cp
        src.read.append(("dp_replicate_size", f"{rep}: -s fsdp-hybrid --shard-group {shard * cp} (HSDP"
                         + (f", sharded over dp_shard {shard} × cp {cp})" if cp > 1 else ")")))
    elif "dp_replicate_size" in sizes:
        src.read.append(("dp_replicate_size", f"{rep}: " + ("no replication" if rep == 1 else
                                                           "replicas of the whole model")))
    if "expert_parallel_size" in sizes:
        src.read.append(("expert_parallel_size", "1: none"))
    return {*MESH, "sequence_parallel_degree", "ring_attn_func", "heads_k_stride"}


# axolotl's ring attention functions (utils/schemas/enums.py RingAttnFunc) -> (cp_impl, balanced):
# varlen_llama3 is ring-flash-attn's llama3_flash_attn_varlen_func (K/V all-gathered), the batch
# ones its ring / zigzag / stripe functions (a p2p ring); axolotl slices each row into cp
# consecutive chunks for varlen_llama3 and batch_ring, into 2·cp for zigzag, strided for stripe
# (axolotl-ai-cloud/axolotl src/axolotl/utils/ctx_managers/sequence_parallel.py)
RING_ATTN = {"varlen_llama3": ("allgather", False), "batch_ring": ("ring", False),
             "batch_zigzag": ("ring", True), "batch_stripe": ("ring", True)}


def _context(doc: Doc, d: dict, src: Source, sizes: dict[str, int]) -> int:
    """axolotl's context parallelism: `context_parallel_size` (`sequence_parallel_degree` before it
    was renamed; axolotl migrates the old key) over ring-flash-attn, with `ring_attn_func`
    defaulting to varlen_llama3 under sample_packing, else batch_ring (axolotl's
    `validate_ring_attn_func`); it requires flash attention (`check_context_parallel_size`)."""
    key = "context_parallel_size" if "context_parallel_size" in sizes else "sequence_parallel_degree"
    cp = sizes.get("context_parallel_size") or (
        as_count(doc, (key,), d[key]) if d.get(key) is not None else 1)
    if cp == 1:
        if key in d:
            src.read.append((key, "1: none"))
        return 1
    func = str(d.get("ring_attn_func") or ("varlen_llama3" if d.get("sample_packing") else "batch_ring")).lower()
    if func not in RING_ATTN:
        raise doc.error(("ring_attn_func",), d.get("ring_attn_func"), f"one of {', '.join(RING_ATTN)}")
    impl, balanced = RING_ATTN[func]
    src.values |= {"cp": cp, "cp_impl": impl, "cp_load_balance": balanced}
    src.read.append((key, f"--cp {cp} --cp-impl {impl}" + ("" if balanced else " --no-cp-load-balance")
                     + f" (ring-flash-attn {func}" + ("" if "ring_attn_func" in d else ", axolotl's default")
                     + ("; each row cut into cp consecutive chunks)" if not balanced else ")")))
    if "heads_k_stride" in d:
        src.read.append(("heads_k_stride", "K/V heads gathered at a time: the launches, not the bytes"))
    return cp


def _fp8(doc: Doc, d: dict, src: Source) -> set:
    """axolotl's `fp8`: torchao float8 linears through accelerate's AORecipeKwargs, with the recipe
    `fp8_recipe` (tensorwise unless set) and, tensorwise only, FSDP2's float8 all-gather
    (`fp8_enable_fsdp_float8_all_gather`): axolotl-ai-cloud/axolotl utils/fp8 build_fp8_linear_config
    and its docs/mixed_precision.qmd ("TorchAO library with tensorwise scaling")."""
    fp8 = d.get("fp8")
    if fp8 is None or not as_bool(doc, ("fp8",), fp8):
        if fp8 is not None:
            src.read.append(("fp8", "false"))
        return {"fp8", "fp8_recipe", "fp8_enable_fsdp_float8_all_gather"}
    recipe = str(d.get("fp8_recipe", "tensorwise"))
    if recipe not in ("tensorwise", "rowwise"):
        raise doc.error(("fp8_recipe",), recipe, "tensorwise or rowwise (torchao's float8 recipes axolotl builds)")
    src.values["fp8"] = recipe
    src.read.append(("fp8", f"--fp8 {recipe} (torchao float8 linears{'' if 'fp8_recipe' in d else ', axolotl default recipe'})"))
    if "fp8_recipe" in d:
        src.read.append(("fp8_recipe", f"--fp8 {recipe}"))
    ag = d.get("fp8_enable_fsdp_float8_all_gather")
    if ag is not None and as_bool(doc, ("fp8_enable_fsdp_float8_all_gather",), ag):
        if recipe != "tensorwise":
            raise doc.error(("fp8_enable_fsdp_float8_all_gather",), ag, "false with fp8_recipe rowwise (axolotl raises: "
                            "the float8 all-gather needs tensorwise scaling)")
        src.values["fp8_all_gather"] = True
        src.read.append(("fp8_enable_fsdp_float8_all_gather", "--fp8-all-gather (FSDP2 rows)"))
    elif ag is not None:
        src.read.append(("fp8_enable_fsdp_float8_all_gather", "false"))
    return {"fp8", "fp8_recipe", "fp8_enable_fsdp_float8_all_gather"}
