"""A DeepSpeed config JSON (`ds_config.json`, HF's ZeRO-2/ZeRO-3 examples with "auto" values).

Stock semantics: DeepSpeed's own defaults for every key the file leaves out (DeepSpeedKnobs'
defaults are DeepSpeed's; ZeRO-3 fetches per submodule unless `leaf_module` names the layer), and
HF Trainer's / accelerate's fill of "auto" (transformers/integrations/deepspeed.py
`HfTrainerDeepSpeedConfig.trainer_config_process` / `trainer_config_finalize`, accelerate's
`Accelerator._prepare_deepspeed`, both as installed): batch, accumulation, clipping, precision and
optimizer values from the trainer's arguments (here: the flags, or the TrainingArguments /
LLaMA-Factory / axolotl file that names this JSON; a JSON read alone, TrainingArguments' defaults:
`trainer_defaults`), and from the model's hidden size h
`reduce_bucket_size` = h², `stage3_prefetch_bucket_size` = int(0.9·h²),
`stage3_param_persistence_threshold` = 10·h (the last two under ZeRO-3 only).

Model parallelism as the file states it: `tensor_parallel.autotp_size` (DeepSpeed's AutoTP
training, deepspeed/runtime/tensor_parallel/config.py `TPTrainingConfig`), `pipeline.stages`
(DeepSpeed's `pipeline` block, deepspeed/runtime/config.py `get_pipeline_config`; its engine takes
the stage count from `PipelineModule(num_stages=...)` or Megatron-DeepSpeed's
`--pipeline-model-parallel-size`, so the key is the file's statement of it) and the spellings
configs carry beside them (`pipeline_parallel_size`, `tensor_parallel.tp_size`): each key read or
ignored is listed with why (`_pipeline`, `_tensor_parallel`).
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
    as_number,
    dotted,
    flatten,
    ignore,
    refuse,
    unstated,
)

AUTO = "auto"
DS_FAMILY = ("zero0", "zero1", "zero2", "zero3", "zero1+opt-offload", "zero2+opt-offload", "zero3+opt-offload",
             "zero3+full-offload")
# file key -> DeepSpeedKnobs field (integers)
COUNT_KNOBS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
}
# DeepSpeed's field names for the stage3_ keys: DeepSpeedZeroConfig (deepspeed/runtime/zero/config.py)
# declares each field under the short name with the stage3_ key as its alias, and its pydantic
# config populates a field by either name
ALIASES = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
           "max_live_parameters": "stage3_max_live_parameters",
           "max_reuse_distance": "stage3_max_reuse_distance",
           "param_persistence_threshold": "stage3_param_persistence_threshold"}
BOOL_KNOBS = {"overlap_comm": "overlap_comm", "contiguous_gradients": "contiguous_gradients",
              "reduce_scatter": "reduce_scatter", "use_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce"}
# Keys read that change nothing the plan counts (memory, traffic, time).
NO_EFFECT = {
    "gradient_clipping": "clipping: no change to memory or time",
    "steps_per_print": "logging", "wall_clock_breakdown": "logging", "zero_allow_untested_optimizer": "a check",
    "zero_force_ds_cpu_optimizer": "a check", "prescale_gradients": "scaling, not bytes",
    "gradient_predivide_factor": "scaling, not bytes", "optimizer.params.lr": "learning rate",
    "optimizer.params.betas": "Adam betas", "optimizer.params.eps": "Adam eps",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "at save time only",
    "zero_optimization.gather_16bit_weights_on_model_save": "at save time only",
    "zero_optimization.offload_optimizer.pin_memory": "pinned host buffers (the plan assumes pinned)",
    "zero_optimization.offload_param.pin_memory": "pinned host buffers (the plan assumes pinned)",
    "zero_optimization.allgather_partitions": "DeepSpeed's default all-gather",
    "optimizer.params.adam_w_mode": "AdamW's decoupled decay",
    "fp16.loss_scale": "loss scaling", "fp16.initial_scale_power": "loss scaling",
    "fp16.loss_scale_window": "loss scaling", "fp16.hysteresis": "loss scaling", "fp16.min_loss_scale": "loss scaling",
    "fp16.auto_cast": "autocast of inputs", "bf16.immediate_grad_update": "fp32 grad accumulation timing",
    "pipeline.seed_layers": "per-layer random seeds at initialisation",
    "pipeline.use_reentrant": "the checkpoint function (reentrant or not: the same saved inputs)",
}
IGNORED = {
    "activation_checkpointing": "DeepSpeed's checkpointing API, used only by models that call "
    "deepspeed.checkpointing (Megatron-style); HF models checkpoint through gradient_checkpointing (--checkpointing)",
    "zero_optimization.sub_group_size": "the optimizer step's sub-groups (offload memory) are not planned",
    "zero_optimization.round_robin_gradients": "not planned",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hierarchical partitioning is not planned",
    "zero_optimization.zero_quantized_weights": "ZeRO++ quantized weights are not planned",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ quantized gradients are not planned",
    "zero_optimization.offload_optimizer.buffer_count": "NVMe buffers are not planned",
    "zero_optimization.offload_param.buffer_count": "NVMe buffers are not planned",
    "zero_optimization.offload_param.buffer_size": "NVMe buffers are not planned",
    "zero_optimization.offload_param.max_in_cpu": "NVMe buffers are not planned",
    "zero_optimization.offload_optimizer.nvme_path": "NVMe offload is planned as CPU offload",
    "zero_optimization.offload_param.nvme_path": "NVMe offload is planned as CPU offload",
    "zero_optimization.offload_optimizer.fast_init": "initialisation only",
    "zero_optimization.offload_optimizer.ratio": "partial offload is not planned",
    "pipeline.partition": "which layers each stage holds: planned as runs of decoder layers of near-equal length "
    "(specs.pipeline.stage_layers; PipelineModule's partition_method, set in code, decides it in DeepSpeed)",
    "pipeline.partition_method": "which layers each stage holds: planned as runs of decoder layers of near-equal "
    "length (specs.pipeline.stage_layers; DeepSpeed reads partition_method from PipelineModule's arguments, not "
    "from its config)",
    "pipeline.pipe_partitioned": "stage-to-stage activations split over the TP ranks: their traffic is not planned "
    "per key",
    "pipeline.grad_partitioned": "stage-to-stage gradients split over the TP ranks: their traffic is not planned "
    "per key",
}
NO_EFFECT_PREFIXES = ("scheduler.",)  # the learning-rate schedule


def is_deepspeed(data: dict[str, Any]) -> bool:
    """DeepSpeed's own keys; its fp16/bf16 are sections (a trainer's `bf16: true` is not one)."""
    return (any(k in data for k in ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
                                    "zero_allow_untested_optimizer"))
            or any(isinstance(data.get(k), dict) for k in ("fp16", "bf16"))) and "output_dir" not in data


def read(doc: Doc, ctx: Context) -> Source:
    src = Source("deepspeed", doc.path, family=DS_FAMILY)
    flat = read_into(doc, doc.data, src, ctx, under="HF Trainer / accelerate (flags)")
    stated = any((sec, "enabled") in flat for sec in ("bf16", "fp16", "bfloat16"))
    unstated(src, ctx, precision=not stated)
    trainer_defaults(flat, src, ctx)
    src.keys_of = lambda s: {**zero_keys(s, flat, ctx, src), **(
        pipeline_keys(s) if (ctx.value("pp", src) or 1) > 1 else trainer_keys(s, flat))}
    return src


# TrainingArguments' defaults (huggingface/transformers@00349ae87eddc872ffa21a8a54f264375a0056a8
# src/transformers/training_args.py: per_device_train_batch_size=8, gradient_accumulation_steps=1,
# fp16=False, bf16=False), which HfTrainerDeepSpeedConfig.trainer_config_process
# (huggingface/transformers@02348331baea70aaedce3b76c18481b2b441fe2d
# src/transformers/integrations/deepspeed.py) writes into the "auto" keys: fill_match
# replaces a value "auto" with the argument's (train_micro_batch_size_per_gpu <-
# per_device_train_batch_size, gradient_accumulation_steps, train_batch_size <- world_size × both,
# fp16.enabled <- fp16 or fp16_full_eval, bf16.enabled <- bf16 or bf16_full_eval)
HF_MICRO_BATCH, HF_GRAD_ACCUM = 8, 1


def trainer_defaults(flat: dict[tuple, Any], src: Source, ctx: Context) -> None:
    """A DeepSpeed JSON read alone: its "auto" batch and precision keys as HF Trainer fills them
    from TrainingArguments' defaults (micro-batch 8, accumulation 1, neither bf16 nor fp16: DeepSpeed
    then runs fp32; accelerate launch's mixed_precision "no" fills fp16/bf16 "auto" alike:
    huggingface/accelerate@16cb6eb80dd9aa8b4df1a63ef57863e455d53b83 src/accelerate/utils/dataclasses.py
    DeepSpeedPlugin.set_mixed_precision). What the
    script really passes is unknown: each is said in the plan's first lines, with the flag to pass.
    A flag given beside the file wins (it is the trainer's argument)."""
    filled = []
    for file_key, name, value, arg in (("train_micro_batch_size_per_gpu", "micro_batch", HF_MICRO_BATCH,
                                        "per_device_train_batch_size"),
                                       ("gradient_accumulation_steps", "grad_accum", HF_GRAD_ACCUM,
                                        "gradient_accumulation_steps")):
        if not is_auto(flat.get((file_key,))) or name in src.values or name in ctx.given:
            continue
        src.values[name] = value
        src.read.append((file_key, f"\"auto\": --{name.replace('_', '-')} {value} (TrainingArguments' {arg} "
                         "default, as HF Trainer fills it)"))
        if name == "micro_batch":
            filled.append(f"--micro-batch {value} (HF Trainer's per_device_train_batch_size default)")
    autos = [sec for sec in ("bf16", "fp16", "bfloat16") if is_auto(flat.get((sec, "enabled")))]
    if autos and "precision" not in src.values and "precision" not in ctx.given:
        src.values["precision"] = "fp32"
        src.read.append(("/".join(f"{s}.enabled" for s in autos),
                         "\"auto\": --precision fp32 (TrainingArguments' bf16=False and fp16=False, as HF Trainer "
                         "fills it; accelerate launch's mixed_precision \"no\" alike)"))
        filled.append("--precision fp32 (bf16/fp16 \"auto\" filled from HF Trainer's bf16=False, fp16=False)")
    if filled:
        src.warnings.append(f"{src.path.name}: \"auto\" values planned as HF Trainer fills them from its defaults: "
                            f"{'; '.join(filled)} — pass --micro-batch / --precision (e.g. --precision bf16-mixed "
                            "for --bf16) as your run sets them")


def is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == AUTO


def read_into(doc: Doc, data: dict[str, Any], src: Source, ctx: Context, *, under: str,
              prefix: tuple = ()) -> dict[tuple, Any]:
    """Read a DeepSpeed config (`data`, at `prefix` inside `doc`) into `src`: the strategy, ZeRO
    knobs, and batch / precision / optimizer where concrete ("auto": the trainer's value, already in
    `src.values` or the flags). `under`: who fills "auto" (for the read list)."""
    flat = flatten(data)
    seen: set[tuple] = set()

    def key(*k: str) -> tuple:
        return (*prefix, *k)

    def got(*k: str) -> Any:
        seen.add(tuple(k))
        return flat.get(tuple(k))

    zero = data.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise doc.error(key("zero_optimization"), zero, "a mapping of ZeRO settings")
    if "zenflow" in zero:
        # DeepSpeed turns ZenFlow on for any zenflow section that is not null (deepspeedai/DeepSpeed@
        # edaa7221267243c7be7fb49c5d5f5c4fb97b4641 deepspeed/runtime/zero/config.py DeepSpeedZeroConfig.zenflow,
        # deepspeed/runtime/zenflow/engine.py configure_zenflow; runtime/engine.py then builds
        # ZenFlowZeroOptimizer in place of the ZeRO-1/2 optimizer)
        for k in [k for k in flat if k[:2] == ("zero_optimization", "zenflow")]:
            seen.add(k)
        if zero["zenflow"] is not None:
            raise refuse(doc, key("zero_optimization", "zenflow"), "{...}", "ZenFlow's optimizer (the top-k "
                         "gradient columns stepped on the GPU, the rest on the host asynchronously every "
                         "update_interval steps) is not in shardwise's planner; plain ZeRO with optimizer offload "
                         "is planned without the zenflow section")
        src.read.append((dotted(key("zero_optimization", "zenflow")), "null: ZenFlow off"))
    stage = got("zero_optimization", "stage")
    stage = 0 if stage is None else as_count(doc, key("zero_optimization", "stage"), stage, zero=True)
    if stage > 3:
        raise doc.error(key("zero_optimization", "stage"), stage, "0, 1, 2 or 3")
    off: dict[str, bool] = {}
    for part in ("offload_optimizer", "offload_param"):
        device = got("zero_optimization", part, "device")
        if part in zero and not isinstance(zero[part], dict):
            raise doc.error(key("zero_optimization", part), zero[part], "a mapping with device: cpu | nvme | none")
        if device is None or device == "none":
            off[part] = False
            continue
        if device not in ("cpu", "nvme"):
            raise doc.error(key("zero_optimization", part, "device"), device, "cpu, nvme or none")
        off[part] = True
        if device == "nvme":
            src.notes.append(f"{dotted(key('zero_optimization', part, 'device'))}: nvme planned as CPU offload "
                             "(host memory and PCIe; the NVMe reads are not priced)")
    name = f"zero{stage}"
    if off["offload_param"]:
        if stage != 3:
            raise doc.error(key("zero_optimization", "offload_param", "device"), "cpu",
                            f"offload_param needs ZeRO stage 3 (this file has stage {stage})")
        if not off["offload_optimizer"]:
            # DeepSpeed then keeps the optimizer (fp32 master, states, gradient partition) on the GPU
            # and streams the parameters from the host (deepspeedai/DeepSpeed@edaa7221267243c7be7fb49c5d5f5c4fb97b4641
            # deepspeed/runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3._configure_offloading: the
            # optimizer is offloaded only where offload_optimizer names a device); STRATEGIES has no such row (zero3+full-offload moves the optimizer step
            # to the host too, zero3 keeps the parameters on the GPU), so neither is this run
            raise refuse(doc, key("zero_optimization", "offload_param", "device"), zero["offload_param"]["device"],
                         "offload_param without offload_optimizer keeps the optimizer states, fp32 master and "
                         "gradients on the GPU and only the parameters on the host; shardwise plans parameter "
                         "offload only beside optimizer offload (zero3+full-offload: set "
                         "zero_optimization.offload_optimizer.device too) or no offload (zero3)")
        name = "zero3+full-offload"
    elif off["offload_optimizer"]:
        if stage == 0:
            raise doc.error(key("zero_optimization", "offload_optimizer", "device"), "cpu",
                            "optimizer offload needs ZeRO stage 1, 2 or 3 (this file has stage 0)")
        name = f"zero{stage}+opt-offload"
    src.values["strategy"] = [name]
    src.read.append((dotted(key("zero_optimization", "stage")), f"-s {name}"))

    ds = src.knobs["ds"]
    hidden: int | None = None
    for short, long in ALIASES.items():
        if short in zero and long in zero:
            raise doc.error(key("zero_optimization", short), zero[short], f"one of {short} and {long} (DeepSpeed's "
                            "name and its alias for one setting; this file gives both)")
    for file_key, field in COUNT_KNOBS.items():
        v = got("zero_optimization", file_key)
        short = next((a for a, b in ALIASES.items() if b == file_key), None)
        if v is None and short is not None and short in zero:
            if is_auto(zero[short]):
                raise doc.error(key("zero_optimization", short), zero[short], f"a number (HF Trainer and accelerate "
                                f"fill \"auto\" under the name {file_key} only)")
            v, file_key = got("zero_optimization", short), short
        if v is None:
            continue
        k = dotted(key("zero_optimization", file_key))
        if is_auto(v):
            if file_key not in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                "stage3_param_persistence_threshold"):
                raise doc.error(key("zero_optimization", file_key), v, "a number (HF fills \"auto\" here only for "
                                "reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold)")
            if file_key != "reduce_bucket_size" and stage != 3:
                src.ignored.append((k, f"\"auto\" under stage {stage}: HF fills it for ZeRO-3 only"))
                continue
            hidden = hidden or ctx.hidden_size(src)
            n = {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                 "stage3_param_persistence_threshold": 10 * hidden}[file_key]
            formula = {"reduce_bucket_size": "h²", "stage3_prefetch_bucket_size": "0.9·h²",
                       "stage3_param_persistence_threshold": "10·h"}[file_key]
            ds[field] = n
            src.read.append((k, f"\"auto\" = {formula} = {n:,} (h = hidden_size {hidden}, as HF Trainer/accelerate "
                             "fill it)"))
            continue
        ds[field] = as_count(doc, key("zero_optimization", file_key), v, zero=file_key.startswith("stage3") or
                             file_key in ALIASES)
        src.read.append((k, f"{field} {ds[field]:,}"))
    for file_key, field in BOOL_KNOBS.items():
        v = got("zero_optimization", file_key)
        if v is not None:
            ds[field] = as_bool(doc, key("zero_optimization", file_key), v)
            src.read.append((dotted(key("zero_optimization", file_key)), f"{field} {ds[field]}"))
    leaf = zero.get("leaf_module")
    for k in [k for k in flat if k[:2] == ("zero_optimization", "leaf_module")]:
        seen.add(k)
    if stage == 3:
        if leaf:
            classes = leaf.get("classes", []) if isinstance(leaf, dict) else []
            ds["fetch_unit"] = "layer" if classes else "module"
            src.read.append((dotted(key("zero_optimization", "leaf_module")),
                             f"fetch_unit {ds['fetch_unit']} (ZeRO-3 fetches each {', '.join(classes) or 'module'})"))
        else:
            ds["fetch_unit"] = "module"  # DeepSpeed's default: hooks on every submodule
            src.notes.append("ZeRO-3 without leaf_module: DeepSpeed fetches every submodule (fetch_unit module)")
    comm = got("communication_data_type")
    if comm is not None:
        dtype = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
                 "bfloat16": "bf16"}.get(str(comm).lower())
        if dtype is None:
            raise doc.error(key("communication_data_type"), comm, "fp32, fp16 or bf16")
        ds["communication_data_type"] = dtype
        src.read.append((dotted(key("communication_data_type")), f"communication_data_type {dtype}"))

    pp = _pipeline(doc, data, src, got, key, stage)
    _tensor_parallel(doc, data, src, got, key, stage, pp)
    _batch(doc, flat, src, ctx, got, key, under)
    _precision(doc, src, got, key, under, stage)
    _optimizer(doc, data, src, got, key, under)
    for k in flat:
        if k in seen:
            continue
        d = ".".join(k)
        why = next((w for p, w in IGNORED.items() if d == p or d.startswith(p + ".")), None)
        if d in NO_EFFECT or d.startswith(NO_EFFECT_PREFIXES):
            src.read.append((dotted(key(*k)), f"{NO_EFFECT.get(d, 'learning-rate schedule')} (no change to the plan)"))
        elif why:
            src.ignored.append((dotted(key(*k)), why))
        else:
            src.ignored.append((dotted(key(*k)), "not a key shardwise plans"))

    return flat


def _pipeline(doc: Doc, data: dict[str, Any], src: Source, got, key, stage: int) -> int:
    """The pipeline degree the file states (`pipeline.stages`, or a top-level `pipeline_parallel_size`),
    planned as DeepSpeed's pipeline engine runs it: ZeRO stage 0 or 1 (deepspeed/runtime/pipe/engine.py
    asserts `zero_optimization_stage() < ZeroStageEnum.gradients`), the stages' micro-batches the
    file's accumulation steps; `pipeline.activation_checkpoint_interval` above 0 checkpoints the
    stages' layers (`--checkpointing full`). Returns the degree (1: none)."""
    block = data.get("pipeline")
    if block is not None and not isinstance(block, dict):
        raise doc.error(key("pipeline"), block, "a mapping of pipeline settings (stages, partition, "
                        "activation_checkpoint_interval, ...)")
    block = block or {}
    found: dict[tuple, int] = {}
    for k in (("pipeline", "stages"), ("pipeline_parallel_size",)):
        v = got(*k)
        if v is None:
            continue
        if is_auto(v):  # DeepSpeed's own default for pipeline.stages
            src.ignored.append((dotted(key(*k)), "\"auto\": the stage count is PipelineModule's (num_stages or its "
                                "topology); pass --pp"))
            continue
        found[k] = as_count(doc, key(*k), v)
    if len(set(found.values())) > 1:
        (k1, v1), (k2, v2) = found.items()
        raise doc.error(key(*k2), v2, f"{v1}, the {dotted(key(*k1))} of the same file (one pipeline degree)")
    pp = next(iter(found.values()), 1)
    for k, v in found.items():
        if k == ("pipeline_parallel_size",):
            why = ("DeepSpeed's config parser does not read this key (launchers that build the pipeline do); the "
                   "file's pipeline degree")
        else:
            why = ("DeepSpeed's pipeline engine takes the stage count from PipelineModule(num_stages=...) or "
                   "Megatron-DeepSpeed's --pipeline-model-parallel-size, which this key states")
        src.read.append((dotted(key(*k)), f"--pp {v} ({why})" if v > 1 else f"{v}: no pipeline stages"))
    if pp > 1:
        if stage > 1:
            k = next(iter(found))
            raise doc.error(key(*k), pp, f"ZeRO stage 0 or 1 with pipeline stages (this file has stage {stage}: "
                            "DeepSpeed's pipeline engine asserts \"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                            "parallelism\")")
        src.values["pp"] = pp
        src.notes.append("pipeline stages planned as DeepSpeed's pipeline engine runs them over the micro-batches "
                         "of a step (its TrainSchedule alternates forwards and backwards: planned as pp_schedule "
                         "1f1b); shardwise train runs pipelines with FSDP2 stages (strategy fsdp*), and the "
                         "recommendation names that run at this layout")
    interval = got("pipeline", "activation_checkpoint_interval")
    if interval is not None:
        n = as_count(doc, key("pipeline", "activation_checkpoint_interval"), interval, zero=True)
        k = dotted(key("pipeline", "activation_checkpoint_interval"))
        if n == 0:  # DeepSpeed then keeps the module's own interval (runtime/pipe/engine.py)
            src.read.append((k, "0: the module's own checkpointing (no change to the plan)"))
        elif pp == 1:
            src.ignored.append((k, "read by DeepSpeed's pipeline engine only, and this file has no pipeline stages"))
        else:
            src.values["checkpointing"] = "full"
            src.read.append((k, f"--checkpointing full (the pipeline engine checkpoints every {n} layer(s)"
                             + (": planned per layer, a group's recompute held at once is not" if n > 1 else "")
                             + ")"))
    return pp


def _tensor_parallel(doc: Doc, data: dict[str, Any], src: Source, got, key, stage: int, pp: int) -> None:
    """The TP degree the file states. `tensor_parallel.autotp_size` (DeepSpeed's AutoTP training,
    >= 0.16.4; ZeRO 0-2) at pp 1 is planned as AutoTP (`--tp N`; the autotp TP scheme: decoder linears
    split, no sequence parallelism). Beside pipeline stages, or spelled `tensor_parallel.tp_size`
    (deepspeed.init_inference's key, which DeepSpeed's training config refuses), the degree is
    planned as the tensor parallelism a DeepSpeed pipeline runs with: Megatron-DeepSpeed's (the
    model axis of its PipeModelDataParallelTopology). `tensor_parallel.tp.tp_size` must match
    autotp_size (DeepSpeed's engine raises otherwise)."""
    tp = data.get("tensor_parallel")
    if tp is None:
        return
    if not isinstance(tp, dict):
        raise doc.error(key("tensor_parallel"), tp, "a mapping with autotp_size")
    for k in flatten(tp):
        got("tensor_parallel", *k)  # read here: what is not planned is named below
    sizes: dict[str, int] = {}
    for name in ("autotp_size", "tp_size"):
        v = tp.get(name)
        if v is not None and not is_auto(v):
            sizes[name] = as_count(doc, key("tensor_parallel", name), v, zero=True)
    inner = tp.get("tp")
    inner_size = inner.get("tp_size") if isinstance(inner, dict) else None
    if inner_size is not None and not is_auto(inner_size):
        inner_size = as_count(doc, key("tensor_parallel", "tp", "tp_size"), inner_size, zero=True)
        if inner_size not in (1, sizes.get("autotp_size", inner_size)):
            raise doc.error(key("tensor_parallel", "tp", "tp_size"), inner_size,
                            f"1 or {sizes['autotp_size']}, the tensor_parallel.autotp_size (DeepSpeed's engine raises "
                            "\"tensor_parallel.tp.tp_size ... does not match tensor_parallel.autotp_size\")")
    if len(set(sizes.values())) > 1:
        raise doc.error(key("tensor_parallel", "tp_size"), sizes["tp_size"],
                        f"{sizes['autotp_size']}, the tensor_parallel.autotp_size of the same file (one TP degree)")
    if not sizes:
        src.ignored.append((dotted(key("tensor_parallel")), "no autotp_size: AutoTP training is off"))
        return
    name, size = next(iter(sizes.items()))
    k = dotted(key("tensor_parallel", name))
    if size <= 1:
        src.read.append((k, f"{size}: no tensor parallelism"))
        return
    if name == "autotp_size" and stage == 3 and pp == 1:
        raise doc.error(key("tensor_parallel", "autotp_size"), size,
                        "ZeRO stage 0, 1 or 2 with autotp_size (DeepSpeed's AutoTP training does not run under ZeRO-3)")
    src.values["tp"] = size
    if pp > 1:
        src.read.append((k, f"--tp {size} (beside pipeline stages: Megatron-DeepSpeed's tensor parallelism, "
                         "sequence parallel, vocabulary-parallel; the model axis of DeepSpeed's "
                         "PipeModelDataParallelTopology)"))
    elif name == "tp_size":
        src.read.append((k, f"--tp {size} (Megatron-DeepSpeed's tensor parallelism: its --tensor-model-parallel-size)"))
    else:
        src.read.append((k, f"--tp {size} (DeepSpeed's AutoTP: the decoder linears split, embedding, lm_head and "
                         "norms whole, no sequence parallelism)"))
    if name == "tp_size":
        src.notes.append(f"{k}: deepspeed.init_inference's key; DeepSpeed's training config refuses it (its "
                         "TPTrainingConfig allows no other key: write tensor_parallel.autotp_size for DeepSpeed's "
                         f"own TP, or pass --tensor-model-parallel-size {size} to Megatron-DeepSpeed); planned as "
                         f"tp {size}, as the file states it")
    elif pp == 1 and tp.get("vocab_parallel_lm_head") is not False:
        src.notes.append(f"{dotted(key('tensor_parallel'))}: lm_head planned whole on every TP rank (as with "
                         "vocab_parallel_lm_head: false, what shardwise train writes); DeepSpeed may shard a tied "
                         "lm_head over the vocabulary when the key is left out")
    for k in tp:
        if k not in ("autotp_size", "tp_size", "vocab_parallel_lm_head", "tp"):
            src.ignored.append((dotted(key("tensor_parallel", k)), "AutoTP's layer specs are planned as the "
                                "standard q/k/v, gate/up column-wise and o/down row-wise split"))
    if isinstance(inner, dict):
        for k in inner:
            if k == "tp_size":
                src.read.append((dotted(key("tensor_parallel", "tp", k)), "checked: 1 or autotp_size (DeepSpeed sets "
                                 "it to autotp_size; no change to the plan)"))
            else:
                src.ignored.append((dotted(key("tensor_parallel", "tp", k)), "DeepSpeed's TP group settings: not "
                                    "planned"))


def _batch(doc: Doc, flat, src: Source, ctx: Context, got, key, under: str) -> None:
    micro, ga, total = (got(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                         "train_batch_size"))
    vals = {}
    for file_key, value, name in (("train_micro_batch_size_per_gpu", micro, "micro_batch"),
                                  ("gradient_accumulation_steps", ga, "grad_accum")):
        if value is None or is_auto(value):
            if value is not None:
                src.read.append((dotted(key(file_key)), f"\"auto\": --{name.replace('_', '-')} from {under}"))
            continue
        vals[name] = as_count(doc, key(file_key), value)
        trainer = src.values.get(name)
        if trainer is not None and trainer != vals[name]:  # HF Trainer refuses it the same way
            raise doc.error(key(file_key), value, f"{trainer}, the trainer's value (HF Trainer: \"Please correct the "
                            "following DeepSpeed config values that mismatch TrainingArguments values\"); or \"auto\"")
        src.values[name] = vals[name]
        src.read.append((dotted(key(file_key)), f"--{name.replace('_', '-')} {vals[name]}"))
    if total is None or is_auto(total):
        if total is not None:
            src.read.append((dotted(key("train_batch_size")), f"\"auto\": micro-batch × accumulation × GPUs ({under})"))
        return
    total = as_count(doc, key("train_batch_size"), total)
    gpus, ranks = batch_ranks(ctx, src)
    mb, acc = ctx.value("micro_batch", src), ctx.value("grad_accum", src)
    if "micro_batch" in vals and "grad_accum" not in vals and "grad_accum" not in ctx.given:
        acc, rem = divmod(total, mb * gpus)
        if rem or acc < 1:
            raise doc.error(key("train_batch_size"), total, f"a multiple of train_micro_batch_size_per_gpu {mb} × "
                            f"{ranks} (DeepSpeed derives gradient_accumulation_steps from it)")
        src.values["grad_accum"] = acc
        src.read.append((dotted(key("train_batch_size")), f"--grad-accum {acc} (= {total} / ({mb} × {ranks}))"))
        return
    if "grad_accum" in vals and "micro_batch" not in vals and "micro_batch" not in ctx.given:
        mb, rem = divmod(total, acc * gpus)
        if rem or mb < 1:
            raise doc.error(key("train_batch_size"), total, f"a multiple of gradient_accumulation_steps {acc} × {ranks}")
        src.values["micro_batch"] = mb
        src.read.append((dotted(key("train_batch_size")), f"--micro-batch {mb} (= {total} / ({acc} × {ranks}))"))
        return
    if mb * acc * gpus != total:
        raise doc.error(key("train_batch_size"), total, f"micro-batch {mb} × accumulation {acc} × {ranks} = "
                        f"{mb * acc * gpus} (DeepSpeed asserts train_batch_size = micro × accumulation × "
                        "data-parallel ranks); fix the file or --gpus")
    src.read.append((dotted(key("train_batch_size")), f"checked: {mb} × {acc} × {ranks}"))


def batch_ranks(ctx: Context, src: Source) -> tuple[int, str]:
    """The ranks DeepSpeed counts in `train_batch_size`, and how to say them: every GPU without
    pipeline stages (AutoTP's ranks too: DeepSpeedConfig without an mpu takes the default group);
    with them the data-parallel degree, GPUs / (pp × tp) (the pipeline grid's, as PipelineEngine
    asserts it)."""
    gpus = ctx.value("gpus", src)
    pp, tp = ctx.value("pp", src) or 1, ctx.value("tp", src) or 1
    if pp == 1:
        return gpus, f"{gpus} GPUs"
    return gpus // (pp * tp), f"{gpus // (pp * tp)} data-parallel ranks ({gpus} GPUs / (pp {pp} × tp {tp}))"


def _precision(doc: Doc, src: Source, got, key, under: str, stage: int = 0) -> None:
    """fp16/bf16 `enabled` as DeepSpeed reads them; "auto" is the trainer's (HF fills bf16 and fp16
    from its own bf16/fp16 arguments: transformers integrations/deepspeed.py `trainer_config_process`),
    so an "auto" beside an explicit false leaves the precision to the trainer. `fp8.enabled: true`
    is refused: fp8 compute is not plannable."""
    fp8 = got("fp8", "enabled")
    if fp8 is not None and not is_auto(fp8) and as_bool(doc, key("fp8", "enabled"), fp8):
        raise refuse(doc, key("fp8", "enabled"), fp8, "shardwise plans bf16, fp16 and fp32 compute, not fp8 "
                     "(its scaled matmuls and their memory)")
    on, auto = {}, False
    for sec in ("bf16", "fp16", "bfloat16"):
        v = got(sec, "enabled")
        if v is None:
            continue
        if is_auto(v):
            auto = True
            src.read.append((dotted(key(sec, "enabled")), f"\"auto\": --precision from {under}"))
            continue
        on[sec] = as_bool(doc, key(sec, "enabled"), v)
    if on.get("bf16") or on.get("bfloat16"):
        src.values["precision"] = "bf16-mixed"
        _master_weights(doc, src, got, key, stage, "bf16" if on.get("bf16") else "bfloat16")
    elif on.get("fp16"):
        src.values["precision"] = "fp16-mixed"
        fp16_master = got("fp16", "fp16_master_weights_and_grads")
        if fp16_master is not None and as_bool(doc, key("fp16", "fp16_master_weights_and_grads"), fp16_master):
            # DeepSpeedFP16Config (runtime/precision_config.py, same commit as _master_weights')
            ignore(src, dotted(key("fp16", "fp16_master_weights_and_grads")), "fp16 master weights and gradients: "
                   "the planner has no fp16 precision without fp32 masters; planned as fp16-mixed")
    elif on and not auto:
        src.values["precision"] = "fp32"
    else:
        if on:
            src.read.append(("/".join(dotted(key(s, "enabled")) for s in on), "false: the \"auto\" one decides"))
        return
    src.read.append(("/".join(dotted(key(s, "enabled")) for s in on), f"--precision {src.values['precision']}"))


def _master_weights(doc: Doc, src: Source, got, key, stage: int, sec: str) -> None:
    """`bf16.bf16_master_weights_and_grads` / `bf16_optimizer_states` as DeepSpeed runs them
    (deepspeedai/DeepSpeed@edaa7221267243c7be7fb49c5d5f5c4fb97b4641 deepspeed/runtime/precision_config.py
    DeepSpeedBF16Config, runtime/config.py asserts ZeRO stage 1-3 for both and the master weights
    for the states, runtime/base_optimizer.py _configure_master_weights): both on keep the ZeRO
    optimizer's master weights, gradients and Adam states in bf16, which is bf16-pure; the master
    weights alone keep the states fp32 on the host (DeepSpeedCPUAdam under ZeRO-Offload), a split
    no precision of the planner's has."""
    master, states = got(sec, "bf16_master_weights_and_grads"), got(sec, "bf16_optimizer_states")
    master = master is not None and as_bool(doc, key(sec, "bf16_master_weights_and_grads"), master)
    states = states is not None and as_bool(doc, key(sec, "bf16_optimizer_states"), states)
    if not (master or states):
        return
    k = dotted(key(sec, "bf16_optimizer_states" if states else "bf16_master_weights_and_grads"))
    if stage == 0:
        raise doc.error(key(sec, "bf16_master_weights_and_grads"), True, "false with ZeRO stage 0 (DeepSpeed asserts "
                        "\"Bf16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3\")")
    if states and not master:
        raise doc.error(key(sec, "bf16_optimizer_states"), True, "false without bf16_master_weights_and_grads "
                        "(DeepSpeed asserts \"bf16_optimizer_states requires bf16_master_weights_and_grads\")")
    if states:
        src.values["precision"] = "bf16-pure"
        src.read.append((f"{dotted(key(sec, 'bf16_master_weights_and_grads'))}/{k}", "--precision bf16-pure (master "
                         "weights, gradients and Adam states in bf16)"))
    else:
        ignore(src, dotted(key(sec, "bf16_master_weights_and_grads")), "bf16 master weights and gradients beside "
               "fp32 Adam states (DeepSpeed keeps those on the host, DeepSpeedCPUAdam): no precision of the planner's "
               "splits them so; planned as bf16-mixed (fp32 masters and gradients)")


def _optimizer(doc: Doc, data: dict, src: Source, got, key, under: str) -> None:
    opt = data.get("optimizer")
    if opt is None:
        return
    kind = str(got("optimizer", "type") or "")
    if kind.lower() in ("adam", "adamw", "fusedadam", "cpuadam"):
        src.values["optimizer"] = "adamw"
        src.read.append((dotted(key("optimizer", "type")), "--optimizer adamw"))
    elif kind:
        src.ignored.append((dotted(key("optimizer", "type")), f"{kind}: planned as AdamW (its state bytes)"))
    wd = got("optimizer", "params", "weight_decay")
    if wd is not None and not is_auto(wd):
        src.values["weight_decay"] = as_number(doc, key("optimizer", "params", "weight_decay"), wd)
        src.read.append((dotted(key("optimizer", "params", "weight_decay")), f"--weight-decay {src.values['weight_decay']:g}"))
    elif wd is not None:
        src.read.append((dotted(key("optimizer", "params", "weight_decay")), f"\"auto\": --weight-decay from {under}"))
    torch_adam = got("optimizer", "params", "torch_adam")
    fused = got("optimizer", "params", "fused")
    if torch_adam is not None:
        impl = "fused" if (not as_bool(doc, key("optimizer", "params", "torch_adam"), torch_adam)
                           or (fused is not None and as_bool(doc, key("optimizer", "params", "fused"), fused))) \
            else "foreach"
        src.values["optimizer_impl"] = impl
        src.read.append((dotted(key("optimizer", "params", "torch_adam")), f"--optimizer-impl {impl}"))
    if fused is not None and torch_adam is None:
        src.read.append((dotted(key("optimizer", "params", "fused")), "no effect without torch_adam"))


def stage_keys(name: str) -> dict[str, Any]:
    from shardwise.config.strategy import STRATEGIES

    f = STRATEGIES[name]
    return {"zero_optimization.stage": f.zero_stage,
            "zero_optimization.offload_optimizer.device": "cpu" if f.offload_optimizer else "none",
            "zero_optimization.offload_param.device": "cpu" if f.offload_params else "none"}


def zero_keys(s: Setting, flat: dict, ctx: Context, src: Source, where: str = "") -> dict[str, Any]:
    """A setting's DeepSpeed JSON keys (`where`: "in FILE: " when the JSON is named by another
    config); batch keys only where the JSON gives a number (an "auto" one is the trainer's)."""
    out = {where + k: v for k, v in stage_keys(s.strategy).items()} if s.strategy in DS_FAMILY else {}
    for file_key, value in (("train_micro_batch_size_per_gpu", s.micro_batch),
                            ("gradient_accumulation_steps", s.grad_accum)):
        if flat.get((file_key,)) is not None and not is_auto(flat[(file_key,)]):
            out[where + file_key] = value
    if flat.get(("train_batch_size",)) is not None and not is_auto(flat[("train_batch_size",)]):
        out[where + "train_batch_size"] = s.micro_batch * s.grad_accum * batch_ranks(ctx, src)[0]
    return out


def pipeline_keys(s: Setting) -> dict[str, Any]:
    """A pipeline's checkpointing: DeepSpeed's pipeline engine checkpoints every
    `activation_checkpoint_interval` layers (0: the module's own setting; HF Trainer, whose
    gradient_checkpointing the other configs use, does not run a PipelineModule)."""
    return {"pipeline.activation_checkpoint_interval": 0 if s.checkpointing == "none" else 1}


def trainer_keys(s: Setting, flat: dict) -> dict[str, Any]:
    """What HF TrainingArguments sets for a DeepSpeed JSON used through HF Trainer."""
    out = {}
    for file_key, value, trainer in (("train_micro_batch_size_per_gpu", s.micro_batch, "per_device_train_batch_size"),
                                     ("gradient_accumulation_steps", s.grad_accum, "gradient_accumulation_steps")):
        if flat.get((file_key,)) is None or is_auto(flat[(file_key,)]):
            out[f"TrainingArguments {trainer}"] = value
    out["TrainingArguments gradient_checkpointing"] = s.checkpointing != "none"
    return out
