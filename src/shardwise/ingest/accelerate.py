"""An `accelerate config` YAML (what `accelerate config` writes and `accelerate launch
--config_file` reads; key names from accelerate's commands/config/cluster.py and launch.py as
installed): MULTI_GPU, FSDP (versions 1 and 2) or DEEPSPEED (a deepspeed_config_file, or the
plugin's own keys).

Stock semantics, from accelerate's source: FSDP2 `fsdp_reshard_after_forward: true` frees every
decoder layer and the input embedding after forward and keeps the head ([final norm, lm_head],
passed False) and the root (left None) gathered (`fsdp2_prepare_model` since accelerate 1.14:
FSDP2_RESHARDED), false keeps them gathered (fsdp-grad-op); with mixed precision the plugin's
MixedPrecisionPolicy reduces gradients in the compute dtype (`reduce_dtype = param_dtype`,
utils/dataclasses.py: reduce_dtype "param"); under gradient accumulation `Accelerator.no_sync`
turns gradient sync off on FSDP2 (`set_requires_gradient_sync(False)`), so gradients are
reduced once per step; a one-process group is still `fully_shard`ed (single_rank "fsdp").
FSDP1's sharding strategies are planned as the FSDP2 sharding they equal (FULL_SHARD: fsdp,
SHARD_GRAD_OP: fsdp-grad-op, HYBRID_SHARD: fsdp-hybrid, NO_SHARD: ddp).
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.ingest import deepspeed as ds_reader
from shardwise.ingest.common import (
    Context,
    Doc,
    Setting,
    Source,
    as_bool,
    as_count,
    dotted,
    flatten,
    load,
    refuse,
    resolve_path,
    unstated,
)

# FSDP2 with reshard_after_forward true as accelerate prepares a model (huggingface/accelerate
# src/accelerate/utils/fsdp_utils.py `fsdp2_prepare_model`, since 1.14: PR #4015 "Fsdp2
# fully_shard embedding and norm", 60b5c258; 1.16 as installed): every decoder layer and the input
# embedding `fully_shard`ed with the flag, [final norm, lm_head] with False, the root with None
# (torch keeps a root gathered); tied embeddings go with the head. HF Trainer, axolotl and
# LLaMA-Factory prepare FSDP2 through it.
FSDP2_RESHARDED = {"reshard_after_forward": "layers", "wrap_embeddings": True}
FSDP2_RESHARDED_FLAGS = ("--fsdp-reshard-after-forward layers --fsdp-wrap-embeddings (accelerate's fsdp2_prepare_model: "
                         "every layer and the embedding resharded, the head and the root kept)")

PRECISION = {"no": "fp32", "fp16": "fp16-mixed", "bf16": "bf16-mixed"}
# FSDP1 FULL_SHARD frees every unit after forward but the root ("layers": torch's FSDP1
# `_post_forward_reshard` frees a flat parameter only where `not state._is_root`)
FSDP1 = {"FULL_SHARD": ("fsdp", "layers"), "SHARD_GRAD_OP": ("fsdp-grad-op", None), "NO_SHARD": ("ddp", None),
         "HYBRID_SHARD": ("fsdp-hybrid", "layers"), "HYBRID_SHARD_ZERO2": ("fsdp-hybrid", "none")}
FSDP1_NUM = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD", "5": "HYBRID_SHARD_ZERO2"}
NO_EFFECT = {"compute_environment", "debug", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend",
             "same_network", "main_training_function", "enable_cpu_affinity", "use_cpu", "gpu_ids", "downcast_bf16",
             "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "dynamo_config", "fsdp_config.fsdp_state_dict_type",
             "fsdp_config.fsdp_sync_module_states", "fsdp_config.fsdp_use_orig_params",
             "fsdp_config.fsdp_transformer_layer_cls_to_wrap", "deepspeed_config.deepspeed_multinode_launcher",
             "deepspeed_config.zero3_init_flag", "deepspeed_config.zero3_save_16bit_model",
             "deepspeed_config.gradient_clipping", "deepspeed_config.deepspeed_hostfile"}
FSDP_FAMILY = ("fsdp", "fsdp-grad-op", "fsdp+offload", "fsdp-hybrid")


def read(doc: Doc, ctx: Context) -> Source:
    d = doc.data
    kind = str(d.get("distributed_type", "NO")).upper()
    src = Source("accelerate", doc.path)
    seen = {("distributed_type",)}
    src.read.append(("distributed_type", kind))
    if "num_processes" in d:
        seen.add(("num_processes",))
        n = as_count(doc, ("num_processes",), d["num_processes"])
        src.values["gpus"] = n
        src.read.append(("num_processes", f"--gpus {n}"))
        machines = as_count(doc, ("num_machines",), d.get("num_machines", 1))
        seen.add(("num_machines",))
        if n % machines:
            raise doc.error(("num_processes",), n, f"a multiple of num_machines {machines}")
        src.values["gpus_per_node"] = n // machines
        src.read.append(("num_machines", f"--gpus-per-node {n // machines}"))
    elif kind == "NO":  # no distributed launch: one process on one GPU (accelerate launch without --multi_gpu)
        src.values["gpus"] = 1
        src.read.append(("distributed_type", "NO without num_processes: --gpus 1 (one process)"))
    mp = d.get("mixed_precision")
    if mp is not None:
        seen.add(("mixed_precision",))
        if str(mp) == "fp8":
            seen |= _fp8(doc, d, src)
        elif str(mp) not in PRECISION:
            raise doc.error(("mixed_precision",), mp, "no, fp16, bf16 or fp8")
        else:
            src.values["precision"] = PRECISION[str(mp)]
            src.read.append(("mixed_precision", f"--precision {PRECISION[str(mp)]}"))
    if kind == "FSDP":
        seen |= _fsdp(doc, d.get("fsdp_config") or {}, src)
        if isinstance(d.get("parallelism_config"), dict):
            seen |= _hybrid(doc, d["parallelism_config"], src, ctx)
    elif kind == "DEEPSPEED":
        seen |= _deepspeed(doc, d.get("deepspeed_config") or {}, src, ctx)
    elif kind in ("MULTI_GPU", "NO"):
        src.values["strategy"] = ["ddp"]
        # the advice may switch the file to DeepSpeed or FSDP2: its distributed_type and that mode's keys
        src.family = ("ddp", *ds_reader.DS_FAMILY, *FSDP_FAMILY)
        src.read[-1] = ("distributed_type", f"{kind}: -s ddp")
        src.keys_of = lambda s: _switch_keys(kind, s)
    else:
        raise doc.error(("distributed_type",), kind, "NO, MULTI_GPU, FSDP or DEEPSPEED (the GPU data-parallel modes)")
    # beside a deepspeed_config_file accelerate takes the precision from `accelerate launch
    # --mixed_precision` (it refuses mixed_precision in this file then), or the JSON's own fp16/bf16
    ds_file = kind == "DEEPSPEED" and bool((d.get("deepspeed_config") or {}).get("deepspeed_config_file"))
    unstated(src, ctx, precision=not ds_file)
    if ds_file and "precision" not in src.values and "precision" not in ctx.given:
        # accelerate launch sets mixed_precision "no" where neither its flag nor the config file
        # names one (huggingface/accelerate@16cb6eb80dd9aa8b4df1a63ef57863e455d53b83
        # src/accelerate/commands/launch.py _validate_launch_command), and DeepSpeedPlugin.set_mixed_precision
        # (src/accelerate/utils/dataclasses.py) fills the JSON's fp16/bf16 "auto" from it: both false
        src.values["precision"] = "fp32"
        src.read.append(("deepspeed_config.deepspeed_config_file", "fp16/bf16 \"auto\" or unset: --precision fp32 "
                         "(accelerate launch's mixed_precision \"no\")"))
        src.warnings.append("precision: from `accelerate launch --mixed_precision` (the DeepSpeed JSON leaves it "
                            "\"auto\"); planned as fp32, as accelerate runs it without the flag (mixed_precision "
                            "\"no\") — pass --precision bf16-mixed if your launch line sets --mixed_precision bf16")
    for key, _ in flatten(d).items():
        if key in seen:
            continue
        dk = dotted(key)
        if dk in NO_EFFECT:
            src.read.append((dk, "no change to memory or time"))
        else:
            src.ignored.append((dk, "not a key shardwise plans"))
    return src


def _fsdp(doc: Doc, f: dict, src: Source) -> set:
    if not isinstance(f, dict):
        raise doc.error(("fsdp_config",), f, "a mapping of fsdp_* keys")
    seen = set()

    def get(name: str, default: Any = None) -> Any:
        seen.add(("fsdp_config", name))
        return f.get(name, default)

    version = get("fsdp_version", 1)
    if str(version) not in ("1", "2"):
        raise doc.error(("fsdp_config", "fsdp_version"), version, "1 or 2")
    version = int(version)
    fsdp = src.knobs["fsdp"]
    fsdp["single_rank"] = "fsdp"  # accelerate fully_shards a one-process group too
    fsdp["reduce_every_micro_batch"] = False  # Accelerator.no_sync: set_requires_gradient_sync(False)
    reshard = get("fsdp_reshard_after_forward", True if version == 2 else None)
    if version == 2:
        keep = not as_bool(doc, ("fsdp_config", "fsdp_reshard_after_forward"), reshard)
        name, how = "fsdp-grad-op" if keep else "fsdp", None
        if not keep:  # its resharding with the embedding and head units
            fsdp |= FSDP2_RESHARDED
        src.read.append(("fsdp_config.fsdp_version", "2: torch fully_shard"))
        src.read.append(("fsdp_config.fsdp_reshard_after_forward",
                         f"{not keep}: " + ("-s fsdp-grad-op (every unit kept gathered)" if keep else
                                            f"-s fsdp {FSDP2_RESHARDED_FLAGS}")))
    else:
        strat = reshard if reshard is not None else get("fsdp_sharding_strategy", "FULL_SHARD")
        strat = FSDP1_NUM.get(str(strat), str(strat).upper())
        if strat not in FSDP1:
            raise doc.error(("fsdp_config", "fsdp_reshard_after_forward"), strat, ", ".join(FSDP1))
        name, how = FSDP1[strat]
        seen.add(("fsdp_config", "fsdp_sharding_strategy"))
        src.read.append(("fsdp_config.fsdp_version", "1 (FSDP1): planned as the FSDP2 sharding it equals"))
        src.read.append(("fsdp_config.fsdp_reshard_after_forward", f"{strat}: -s {name}"))
        src.notes.append("FSDP1 planned as FSDP2 with the same sharding (FSDP1's flat parameters, its "
                         "limit_all_gathers and prefetch policies are not modelled)")
    if how:
        fsdp["reshard_after_forward"] = how
    if as_bool(doc, ("fsdp_config", "fsdp_offload_params"), get("fsdp_offload_params", False)):
        if name != "fsdp":
            raise doc.error(("fsdp_config", "fsdp_offload_params"), True, f"false with {name} (shardwise plans "
                            "offload with full sharding: fsdp+offload)")
        name = "fsdp+offload"
        src.read.append(("fsdp_config.fsdp_offload_params", "true: -s fsdp+offload (CPUOffloadPolicy)"))
    if as_bool(doc, ("fsdp_config", "fsdp_activation_checkpointing"), get("fsdp_activation_checkpointing", False)):
        src.values["checkpointing"] = "full"
        src.read.append(("fsdp_config.fsdp_activation_checkpointing", "true: --checkpointing full"))
    elif ("fsdp_config", "fsdp_activation_checkpointing") in seen and "fsdp_activation_checkpointing" in f:
        src.values["checkpointing"] = "none"
        src.read.append(("fsdp_config.fsdp_activation_checkpointing", "false: --checkpointing none"))
    policy = get("fsdp_auto_wrap_policy")
    if policy is not None:
        if policy == "TRANSFORMER_BASED_WRAP":
            src.read.append(("fsdp_config.fsdp_auto_wrap_policy", "one unit per decoder layer (the plan's unit)"))
        else:
            src.ignored.append(("fsdp_config.fsdp_auto_wrap_policy", f"{policy}: planned with one unit per decoder "
                                "layer (TRANSFORMER_BASED_WRAP)"))
    for k in ("fsdp_min_num_params", "fsdp_forward_prefetch", "fsdp_backward_prefetch",
              "fsdp_cpu_ram_efficient_loading", "fsdp_activation_checkpointing_offload"):
        if k in f:
            seen.add(("fsdp_config", k))
            if k == "fsdp_cpu_ram_efficient_loading":
                src.read.append((f"fsdp_config.{k}", "weights loaded by rank 0 only: host memory (planned as the "
                                 "sharded load)"))
            else:
                src.ignored.append((f"fsdp_config.{k}", "not planned (FSDP prefetch and wrap-size details)"))
    src.values["strategy"] = [name]
    fsdp["reduce_dtype"] = "param" if src.values.get("precision", "bf16-mixed") != "fp32" else "fp32"
    src.read.append(("mixed_precision", f"FSDP MixedPrecisionPolicy reduce_dtype = the compute dtype "
                     f"(--fsdp-reduce-dtype {fsdp['reduce_dtype']})"))
    src.family = FSDP_FAMILY
    src.keys_of = lambda s: {**_fsdp_keys(s, version), **_batch_keys(s)}
    return seen


PARALLELISM = ("parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size", "parallelism_config_tp_size",
               "parallelism_config_cp_size")


def _hybrid(doc: Doc, p: dict, src: Source, ctx: Context) -> set:
    """accelerate's `parallelism_config` (ParallelismConfig, utils/dataclasses.py; the launcher
    exports each key as PARALLELISM_CONFIG_*): a device mesh of dp_replicate × dp_shard × tp × cp
    ranks, whose product accelerate requires to be num_processes. tp > 1 is transformers' tensor
    parallelism (`--tp`); cp > 1 is torch's context_parallel over the FSDP2 model (`--cp`,
    accelerate's `maybe_context_parallel`, load-balanced by torch's default), its
    `cp_comm_strategy` torch's rotate method; dp_replicate > 1 beside dp_shard > 1 is HSDP
    (fsdp-hybrid, shard group dp_shard × cp: FSDP shards over the cp ranks too)."""
    sizes = {}
    for k in PARALLELISM:
        v = p.get(k)
        sizes[k.removeprefix("parallelism_config_")] = 1 if v is None else as_count(doc, ("parallelism_config", k), v)
    rep, shard, tp, cp = (sizes[k] for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"))
    gpus = src.values.get("gpus")  # the file's num_processes (a --gpus given beside it plans another world)
    if gpus is not None and rep * shard * tp * cp != gpus:
        raise doc.error(("parallelism_config",), sizes, f"sizes whose product is the {gpus} processes "
                        "(accelerate's ParallelismConfig requires dp_replicate × dp_shard × tp × cp = "
                        "num_processes)")
    if tp > 1:
        src.values["tp"] = tp
        src.read.append(("parallelism_config.parallelism_config_tp_size",
                         f"--tp {tp} (transformers' tensor parallel plan over a {tp}-rank mesh axis)"))
    else:
        src.read.append(("parallelism_config.parallelism_config_tp_size", "1: no tensor parallelism"))
    if cp > 1:
        src.values |= {"cp": cp, "cp_impl": "torch"}
        src.read.append(("parallelism_config.parallelism_config_cp_size",
                         f"--cp {cp} --cp-impl torch (torch's context_parallel over the sequence)"))
    else:
        src.read.append(("parallelism_config.parallelism_config_cp_size", "1: no context parallelism"))
    if rep > 1 and shard > 1:
        if src.values.get("strategy") == ["fsdp+offload"]:
            raise doc.error(("parallelism_config", "parallelism_config_dp_replicate_size"), rep,
                            "1 with fsdp_offload_params (shardwise plans offload with full sharding only)")
        src.values["strategy"] = ["fsdp-hybrid"]
        src.shard_group = shard * cp
        src.read.append(("parallelism_config.parallelism_config_dp_shard_size",
                         f"{shard} × dp_replicate_size {rep}: -s fsdp-hybrid --shard-group {shard * cp} (HSDP"
                         + (f", sharded over dp_shard {shard} × cp {cp})" if cp > 1 else ")")))
    elif rep > 1:
        src.values["strategy"] = ["ddp"]
        src.read.append(("parallelism_config.parallelism_config_dp_replicate_size",
                         f"{rep} with dp_shard_size 1: every rank holds the whole model (-s ddp)"))
    else:
        src.read.append(("parallelism_config.parallelism_config_dp_shard_size",
                         f"{shard}: one shard group over the data-parallel ranks (-s {src.values['strategy'][0]})"))
    if "parallelism_config_cp_comm_strategy" in p:
        how = str(p["parallelism_config_cp_comm_strategy"])
        if how not in ("allgather", "alltoall"):
            raise doc.error(("parallelism_config", "parallelism_config_cp_comm_strategy"), how,
                            "allgather or alltoall (torch's rotate methods)")
        src.read.append(("parallelism_config.parallelism_config_cp_comm_strategy",
                         "context parallelism only (cp_size 1): no change to memory or time" if cp == 1 else
                         "allgather: torch's default rotate method" if how == "allgather" else
                         "alltoall: the same bytes as allgather's; planned with allgather's overlap (behind the "
                         "first chunk), where alltoall passes each chunk behind the previous one's attention"))
    return {("parallelism_config", k) for k in p if k in (*PARALLELISM, "parallelism_config_cp_comm_strategy")}


def _fsdp_keys(s: Setting, version: int) -> dict[str, Any]:
    from shardwise.config.strategy import STRATEGIES

    f = STRATEGIES.get(s.strategy)
    out: dict[str, Any] = {}
    if f is not None and f.engine == "fsdp2":
        if version == 2:
            out["fsdp_config.fsdp_reshard_after_forward"] = f.fsdp_sharding != "grad-op"
        else:
            out["fsdp_config.fsdp_reshard_after_forward"] = {"full": "FULL_SHARD", "grad-op": "SHARD_GRAD_OP",
                                                             "hybrid": "HYBRID_SHARD"}[f.fsdp_sharding]
        out["fsdp_config.fsdp_offload_params"] = f.offload_params
    out["fsdp_config.fsdp_activation_checkpointing"] = s.checkpointing != "none"
    return out


def _inline_ds_keys(s: Setting) -> dict[str, Any]:
    """A setting as the keys of accelerate's own deepspeed_config (no deepspeed_config_file)."""
    return {"deepspeed_config.zero_stage": int(s.strategy[4]) if s.strategy.startswith("zero") else None,
            "deepspeed_config.offload_optimizer_device": "cpu" if "offload" in s.strategy else "none",
            "deepspeed_config.offload_param_device": "cpu" if "full-offload" in s.strategy else "none",
            "deepspeed_config.gradient_accumulation_steps": s.grad_accum,
            "TrainingArguments per_device_train_batch_size (or your script's batch size)": s.micro_batch}


def _switch_keys(kind: str, s: Setting) -> dict[str, Any]:
    """A MULTI_GPU/NO file's setting, DDP or the DeepSpeed / FSDP2 one it switches to: its
    distributed_type and that mode's own keys (as `accelerate config` writes them)."""
    if s.strategy in ds_reader.DS_FAMILY:  # accelerate's defaults (no offload, accumulation 1) left unsaid
        return {"distributed_type": "DEEPSPEED", **{k: v for k, v in _inline_ds_keys(s).items() if not (
            (k.endswith("_device") and v == "none") or (k.endswith("gradient_accumulation_steps") and v == 1))}}
    if s.strategy in FSDP_FAMILY:  # FSDP2; its defaults (resharded, no offload or checkpointing) left unsaid
        keys = {k: v for k, v in _fsdp_keys(s, 2).items() if v is not False or k.endswith("reshard_after_forward")}
        if keys.get("fsdp_config.fsdp_reshard_after_forward") is True:
            del keys["fsdp_config.fsdp_reshard_after_forward"]
        return {"distributed_type": "FSDP", "fsdp_config.fsdp_version": 2, **keys, **_batch_keys(s)}
    return {"distributed_type": kind, **_batch_keys(s)}


def _batch_keys(s: Setting) -> dict[str, Any]:
    return {"TrainingArguments per_device_train_batch_size (or your script's batch size)": s.micro_batch,
            "TrainingArguments gradient_accumulation_steps (or Accelerator(gradient_accumulation_steps=))":
                s.grad_accum}


def _deepspeed(doc: Doc, p: dict, src: Source, ctx: Context) -> set:
    if not isinstance(p, dict):
        raise doc.error(("deepspeed_config",), p, "a mapping of deepspeed_* keys")
    seen = {("deepspeed_config", k) for k in ("deepspeed_config_file", "zero_stage", "offload_optimizer_device",
                                              "offload_param_device", "gradient_accumulation_steps") if k in p}
    src.family = ds_reader.DS_FAMILY
    file = p.get("deepspeed_config_file")
    if file:
        path = resolve_path(doc, ("deepspeed_config", "deepspeed_config_file"), file)
        inner = load(path)
        src.read.append(("deepspeed_config.deepspeed_config_file", f"{path} (read below; \"auto\" filled as "
                         "accelerate fills it)"))
        flat = ds_reader.read_into(inner, inner.data, src, ctx, under="accelerate launch / the flags")
        if ds_reader.is_auto(flat.get(("train_micro_batch_size_per_gpu",))) and "micro_batch" not in ctx.given:
            # accelerate fills it from the script's DataLoader (Accelerator._prepare_deepspeed: batch_size_per_device)
            src.warnings.append(f"{path.name}: train_micro_batch_size_per_gpu \"auto\" is your script's DataLoader "
                                f"batch size (accelerate fills it when it prepares DeepSpeed); planned as --micro-batch "
                                f"{ctx.value('micro_batch', src)} — pass --micro-batch")
        src.read = [(f"{path.name}: {k}" if not k.startswith("deepspeed_config") and k not in (
            "distributed_type", "num_processes", "num_machines", "mixed_precision") else k, v) for k, v in src.read]
        src.ignored = [(f"{path.name}: {k}", v) for k, v in src.ignored]
        src.keys_of = lambda s: {**ds_reader.zero_keys(s, flat, ctx, src, where=f"in {path.name}: "),
                                 **ds_reader.trainer_keys(s, flat)}
        return seen
    stage = as_count(doc, ("deepspeed_config", "zero_stage"), p.get("zero_stage", 2), zero=True)
    if stage > 3:
        raise doc.error(("deepspeed_config", "zero_stage"), stage, "0, 1, 2 or 3")
    opt = str(p.get("offload_optimizer_device", "none")).lower()
    par = str(p.get("offload_param_device", "none")).lower()
    name = f"zero{stage}"
    if par in ("cpu", "nvme") and stage != 3:
        raise doc.error(("deepspeed_config", "offload_param_device"), par, f"none: parameter offload needs ZeRO stage 3 "
                        f"(this file has zero_stage {stage})")
    if par in ("cpu", "nvme") and opt in ("cpu", "nvme"):
        name = "zero3+full-offload"
    elif par in ("cpu", "nvme"):  # as a DeepSpeed JSON's offload_param alone (ingest.deepspeed)
        raise refuse(doc, ("deepspeed_config", "offload_param_device"), par,
                     "offload_param_device without offload_optimizer_device keeps the optimizer states, fp32 master "
                     "and gradients on the GPU and only the parameters on the host; shardwise plans parameter "
                     "offload only beside optimizer offload (zero3+full-offload: set offload_optimizer_device too) "
                     "or no offload (zero3)")
    elif opt in ("cpu", "nvme"):
        name = f"zero{stage}+opt-offload"
    try:
        from shardwise.specs import Strategy

        Strategy.from_name(name)
    except ShardwiseError:
        raise doc.error(("deepspeed_config", "zero_stage"), stage, f"a stage that offload runs with ({name} is not "
                        "a DeepSpeed configuration)") from None
    src.values["strategy"] = [name]
    src.read.append(("deepspeed_config.zero_stage", f"-s {name}"))
    if "gradient_accumulation_steps" in p:
        src.values["grad_accum"] = as_count(doc, ("deepspeed_config", "gradient_accumulation_steps"),
                                            p["gradient_accumulation_steps"])
        src.read.append(("deepspeed_config.gradient_accumulation_steps", f"--grad-accum {src.values['grad_accum']}"))
    src.knobs["ds"]["fetch_unit"] = "module"  # no leaf_module: DeepSpeed hooks every submodule
    src.keys_of = _inline_ds_keys
    for k in ("offload_optimizer_device", "offload_param_device"):
        if k in p:
            src.read.append((f"deepspeed_config.{k}", f"{p[k]}"))
    return seen


# accelerate's fp8 backends (huggingface/accelerate utils/dataclasses.py FP8RecipeKwargs / TERecipeKwargs /
# AORecipeKwargs): TE runs Transformer Engine's DelayedScaling recipe; AO torchao's Float8LinearConfig(),
# whose default is tensorwise scaling. The rest of the model runs under bf16 autocast
# (utils/modeling.py get_mixed_precision_context_manager: "bf16" and "fp8" alike).
FP8_BACKENDS = {"TE": "delayed", "AO": "tensorwise"}


def _fp8(doc: Doc, d: dict, src: Source) -> set:
    cfg = d.get("fp8_config") or {}
    if not isinstance(cfg, dict):
        raise doc.error(("fp8_config",), cfg, "a mapping (backend, fp8_format, amax_history_len, ...)")
    backend = str(cfg.get("backend", "TE")).upper().replace("-", "")
    if backend not in FP8_BACKENDS:
        raise refuse(doc, ("fp8_config", "backend"), cfg.get("backend"), "MS-AMP's fp8 optimizer states and "
                     "weights are not planned (TE and AO are)")
    src.values["precision"] = "bf16-mixed"
    src.values["fp8"] = FP8_BACKENDS[backend]
    src.read.append(("mixed_precision", f"fp8: --precision bf16-mixed --fp8 {FP8_BACKENDS[backend]} "
                     f"(fp8_config.backend {backend})"))
    seen = {("fp8_config",)}
    for k in cfg:
        seen.add(("fp8_config", k))
        src.read.append((f"fp8_config.{k}", f"{cfg[k]}: " + (f"--fp8 {FP8_BACKENDS[backend]}" if k == "backend"
                                                             else "no change to memory or time")))
    return seen
