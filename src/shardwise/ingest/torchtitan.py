"""A torchtitan job config TOML (`torchtitan/train.py --job.config_file FILE`; the TOML configs of
pytorch/torchtitan up to 9810191 (which moved them to Python registries), keys and defaults from
torchtitan/config/job_config.py there, the layout from torchtitan/models/llama3/infra/parallelize.py
and torchtitan/distributed/parallel_dims.py. The older layout (its 2024 configs: [training] batch_size,
*_parallel_degree and compile, [experimental] pipeline/context degrees, [float8], [model] norm_type)
is read with that era's sharding (9dec370 parallelize_llama.py: every block but the last resharded
after forward, the root freed at pp 1, no separate embedding or head units).

Stock semantics (job_config.py defaults where a key is absent):
- the model is `[model] name` and `flavor` (llama3 8B/70B/405B are Llama 3.1's shapes, as their
  hf_assets_path says; qwen3, deepseek_v3, llama2 flavors likewise); `converters` "float8" (or
  "quantize.linear.float8") swaps the linears for torchao Float8Linear, `recipe_name` default
  tensorwise, `enable_fsdp_float8_all_gather` its all-gather; "mx" (or "quantize.linear.mx") MXFP8 through torchao's MXLinear.
- FSDP2 over data_parallel_shard_degree (-1: the GPUs left) × context_parallel_degree, HSDP with
  data_parallel_replicate_degree > 1, DDP (`replicate`) where the shard degree is 1;
  MixedPrecisionPolicy(param bfloat16, reduce float32); `apply_fsdp` shards the token embedding
  and every block resharded after forward, and norm + output as one unit kept gathered
  (`fsdp_reshard_after_forward` "default"; "always" frees it too, "never" keeps every unit:
  SHARD_GRAD_OP; under PP the default keeps every unit as well); `training.enable_cpu_offload`:
  CPUOffloadPolicy.
- local_batch_size (default 8) sequences per data-parallel rank; global_batch_size (-1: no
  accumulation) gives the accumulation; under PP the local batch is cut into micro-batches of
  pipeline_parallel_microbatch_size (default 1).
- activation_checkpoint mode (default selective with selective_ac_option "2": every second block
  whole), "op": the per-op policy; compile; AdamW `implementation` (default fused) and
  weight_decay (default 0.1); max_norm clipping (default 1.0); tensor, pipeline (schedule
  1F1B / GPipe / Interleaved1F1B), context (torch's context_parallel) and expert degrees.
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.ingest.common import Context, Doc, Source, as_bool, as_count, ignore, refuse, unstated

# ([model] name, flavor) -> the catalog entry with that flavor's shape (torchtitan/models/<name>/__init__.py)
MODELS = {
    ("llama3", "8B"): "llama-3.1-8b", ("llama3", "70B"): "llama-3.1-70b", ("llama3", "405B"): "llama-3.1-405b",
    ("llama2", "7B"): "llama-2-7b", ("llama2", "13B"): "llama-2-13b", ("llama2", "70B"): "llama-2-70b",
    ("qwen3", "0.6B"): "qwen3-0.6b", ("qwen3", "1.7B"): "qwen3-1.7b", ("qwen3", "4B"): "qwen3-4b",
    ("qwen3", "8B"): "qwen3-8b", ("qwen3", "14B"): "qwen3-14b", ("qwen3", "32B"): "qwen3-32b",
    ("qwen3", "30B-A3B"): "qwen3-30b-a3b", ("qwen3", "235B-A22B"): "qwen3-235b-a22b",
    ("deepseek_v3", "671B"): "deepseek-v3",
}
# pipeline_parallel_schedule -> --pp-schedule (the schedules the planner prices)
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved-1f1b"}
FP8_CONVERTERS = ("float8", "quantize.linear.float8")
MX_CONVERTERS = ("mx", "quantize.linear.mx")
TT_NO_EFFECT = {"job", "profiling", "metrics", "lr_scheduler", "checkpoint", "validation", "comm", "fault_tolerance",
                "memory_estimation", "debug"}


def is_torchtitan(doc: Doc) -> bool:
    return doc.kind == "toml" and isinstance(doc.data.get("model"), dict) and "name" in doc.data["model"]


def _get(d: dict, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def read(doc: Doc, ctx: Context) -> Source:
    d = doc.data
    src = Source("torchtitan", doc.path)
    _model(doc, d, src, ctx)
    par = {**(d.get("experimental") or {}), **(d.get("training") or {}), **(d.get("parallelism") or {})}
    degrees = {k: _degree(doc, d, par, k) for k in DEGREES}
    _layout(doc, d, par, degrees, src, ctx, older=_older(d))
    _training(doc, d, par, degrees, src, ctx)
    _memory_and_kernels(doc, d, src)
    _fp8(doc, d, src)
    # no "what to change" edits: they are written back in the file's format, which TOML is not yet
    unstated(src, ctx, precision=False)
    for k in d:
        if k in TT_NO_EFFECT:
            src.read.append((k, "no change to memory or time"))
        elif k not in ("model", "training", "parallelism", "experimental", "optimizer", "activation_checkpoint",
                       "compile", "float8", "quantize"):
            src.ignored.append((k, "not a section shardwise plans"))
    return src


DEGREES = ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
           "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree")


def _degree(doc: Doc, d: dict, par: dict, key: str) -> int:
    """A parallelism degree: a count, or -1 for the data-parallel shard degree (the GPUs left)."""
    v = par.get(key, -1 if key == "data_parallel_shard_degree" else 1)
    if v == -1 and key == "data_parallel_shard_degree":
        return -1
    return as_count(doc, _where(d, key), v)


def _older(d: dict) -> bool:
    """A config of the older layout (torchtitan's 2024 TOMLs)."""
    t = d.get("training") or {}
    return "experimental" in d or "float8" in d or "batch_size" in t or "compile" in t


def _where(d: dict, key: str) -> tuple:
    """The key path of a parallelism key: [parallelism], or the older [training] / [experimental]."""
    for section in ("parallelism", "training", "experimental"):
        if key in (d.get(section) or {}):
            return (section, key)
    return ("parallelism", key)


def _model(doc: Doc, d: dict, src: Source, ctx: Context) -> None:
    name, flavor = str(_get(d, "model", "name")), str(_get(d, "model", "flavor") or "debugmodel")
    if any(k in ctx.given for k in ("model", "model_config", "params")):
        src.read.append(("model.name/flavor", f"{name} {flavor} (overridden by the --model/--model-config/--params "
                         "given)"))
        return
    if (name, flavor) not in MODELS:
        known = ", ".join(f"{n} {f}" for n, f in MODELS)
        raise doc.error(("model", "flavor"), f"{name} {flavor}", f"a torchtitan model flavor of shardwise's catalog "
                        f"({known}), or pass --model (or --model-config) for it")
    src.values["model"] = MODELS[(name, flavor)]
    src.read.append(("model.name/flavor", f"--model {src.values['model']} (torchtitan's {name} {flavor})"))


def _layout(doc: Doc, d: dict, par: dict, deg: dict, src: Source, ctx: Context, older: bool) -> None:
    rep, shard, tp, pp, cp, ep = (deg[k] for k in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                                                    "tensor_parallel_degree", "pipeline_parallel_degree",
                                                    "context_parallel_degree", "expert_parallel_degree"))
    if shard != -1 and "gpus" not in ctx.given:
        src.values["gpus"] = rep * shard * cp * tp * pp  # parallel_dims.py: their product is the world size
        src.read.append(("parallelism degrees", f"--gpus {src.values['gpus']} (their product)"))
    elif shard == -1:
        src.read.append(("parallelism.data_parallel_shard_degree", "-1: the GPUs the other degrees leave (--gpus)"))
    offload = as_bool(doc, ("training", "enable_cpu_offload"), _get(d, "training", "enable_cpu_offload") or False)
    policy = str(par.get("fsdp_reshard_after_forward", "default"))
    if policy not in ("default", "always", "never"):
        raise doc.error(_where(d, "fsdp_reshard_after_forward"), policy, "default, always or never")
    if shard == 1 and rep > 1:
        strategy = "ddp"  # torchtitan's replicate(): DDP over the replicas
    elif offload:
        strategy = "fsdp+offload"
    elif policy == "never" or (policy == "default" and pp > 1):
        strategy = "fsdp-grad-op"
    elif rep > 1:
        strategy = "fsdp-hybrid"
        if shard != -1:
            src.shard_group = shard * cp
    else:
        strategy = "fsdp"
    src.values["strategy"] = [strategy]
    src.family = ("ddp",) if strategy == "ddp" else ("fsdp", "fsdp-grad-op", "fsdp+offload")
    src.read.append(("parallelism", f"-s {strategy} (replicate {rep}, shard {shard}, fsdp_reshard_after_forward "
                     f"{policy}{', cpu offload' if offload else ''})"))
    if strategy != "ddp":
        fsdp: dict[str, Any] = {"reduce_every_micro_batch": True}
        if older and strategy != "fsdp-grad-op":  # every block but the last, the root freed at pp 1
            fsdp |= {"reshard_after_forward": "not-last", "reshard_root": pp == 1}
        elif strategy != "fsdp-grad-op":
            # apply_fsdp: the embedding and each block resharded, norm + output one unit kept gathered
            # (the root's: wrap_embeddings) unless "always"; MixedPrecisionPolicy(param bf16, reduce fp32)
            always = policy == "always"
            fsdp |= {"wrap_embeddings": True, "reshard_after_forward": "all" if always else "layers",
                     "reshard_root": always}
        src.knobs["fsdp"] |= fsdp
    for key, flag, n in (("tensor_parallel_degree", "tp", tp), ("pipeline_parallel_degree", "pp", pp),
                         ("context_parallel_degree", "cp", cp), ("expert_parallel_degree", "ep", ep)):
        if n > 1:
            src.values[flag] = n
            src.read.append((".".join(_where(d, key)), f"--{flag} {n}"))
    if tp > 1 and as_bool(doc, _where(d, "enable_async_tensor_parallel"), par.get("enable_async_tensor_parallel",
                                                                                  False)):
        src.values["tp_comm_overlap"] = True
        src.read.append((".".join(_where(d, "enable_async_tensor_parallel")), "--tp-comm-overlap (async TP)"))
    if tp > 1 and par.get("disable_loss_parallel"):
        ignore(src, "parallelism.disable_loss_parallel", "the loss over the whole vocabulary on each TP rank is not "
               "planned: planned with loss_parallel")
    if cp > 1:
        src.values["cp_impl"] = "torch"
        src.read.append(("parallelism.context_parallel_degree", f"--cp {cp} --cp-impl torch (torch's context_parallel)"))
    if ep > 1:
        etp = as_count(doc, _where(d, "expert_tensor_parallel_degree"), par.get("expert_tensor_parallel_degree", 1))
        if etp != 1:
            src.values["etp"] = etp
        src.read.append(("parallelism.expert_parallel_degree", f"--ep {ep}" + (f" --etp {etp}" if etp != 1 else "")))
    if pp > 1:
        sched = str(par.get("pipeline_parallel_schedule", "1F1B"))
        if sched not in SCHEDULES:
            raise refuse(doc, _where(d, "pipeline_parallel_schedule"), sched, "the planner prices "
                         + ", ".join(SCHEDULES) + " (zero-bubble and custom CSV schedules are not planned)")
        src.values["pp_schedule"] = SCHEDULES[sched]
        if SCHEDULES[sched] == "interleaved-1f1b":
            per_stage = par.get("pipeline_parallel_layers_per_stage")
            if per_stage is None:
                raise refuse(doc, _where(d, "pipeline_parallel_schedule"), sched, "give "
                             "pipeline_parallel_layers_per_stage: the stages a rank runs follow from it")
            layers = _layers(src, ctx)
            stages = -(-layers // as_count(doc, _where(d, "pipeline_parallel_layers_per_stage"), per_stage))
            src.values["pp_virtual_stages"] = max(2, stages // pp)
        src.read.append(("parallelism.pipeline_parallel_schedule", f"--pp-schedule {src.values['pp_schedule']}"))


def _layers(src: Source, ctx: Context) -> int:
    """Decoder layers of the model planned (the file's, or the --model/--model-config given)."""
    from shardwise.plan.planner import resolve_model

    return resolve_model(*(ctx.value(n, src) for n in ("model", "model_config", "params"))).num_layers


def _training(doc: Doc, d: dict, par: dict, deg: dict, src: Source, ctx: Context) -> None:
    t = d.get("training") or {}
    key = "local_batch_size" if "local_batch_size" in t else "batch_size"
    local = as_count(doc, ("training", key), t.get(key, 8))
    seq = as_count(doc, ("training", "seq_len"), t.get("seq_len", 2048))
    src.values["seq_len"] = seq
    src.read.append(("training.seq_len", f"--seq-len {seq}" + ("" if "seq_len" in t else " (torchtitan's default)")))
    accum = 1
    glob = t.get("global_batch_size", -1)
    if glob != -1:
        dp = deg["data_parallel_replicate_degree"] * deg["data_parallel_shard_degree"]
        if deg["data_parallel_shard_degree"] == -1:
            gpus = ctx.given.get("gpus")
            if gpus is None:
                raise ShardwiseError(f"{doc.where('training', 'global_batch_size')}: training.global_batch_size with "
                                     "data_parallel_shard_degree -1: pass --gpus, which the accumulation follows from")
            dp = gpus // (deg["tensor_parallel_degree"] * deg["pipeline_parallel_degree"]
                          * deg["context_parallel_degree"])
        per = local * dp
        if as_count(doc, ("training", "global_batch_size"), glob) % per:
            raise doc.error(("training", "global_batch_size"), glob, f"a multiple of local_batch_size × the "
                            f"data-parallel degree ({per})")
        accum = glob // per
    micro = local
    if deg["pipeline_parallel_degree"] > 1 and _older(d):
        # the 2024 layout cuts the batch into pipeline_parallel_microbatches (default: the PP degree;
        # 9dec370 pipelining_utils.py)
        n = as_count(doc, _where(d, "pipeline_parallel_microbatches"),
                     par.get("pipeline_parallel_microbatches") or deg["pipeline_parallel_degree"])
        if local % n:
            raise doc.error(_where(d, "pipeline_parallel_microbatches"), n, f"a divisor of {key} {local}")
        micro, accum = local // n, accum * n
    elif deg["pipeline_parallel_degree"] > 1:  # the local batch cut into the schedule's micro-batches
        micro = as_count(doc, _where(d, "pipeline_parallel_microbatch_size"),
                         par.get("pipeline_parallel_microbatch_size", 1))
        if local % micro:
            raise doc.error(_where(d, "pipeline_parallel_microbatch_size"), micro, f"a divisor of {key} {local}")
        accum *= local // micro
    src.values |= {"micro_batch": micro, "grad_accum": accum}
    src.read.append((f"training.{key}", f"--micro-batch {micro} --grad-accum {accum}"
                     + ("" if key in t else " (torchtitan's default local batch 8)")))
    dtype = str(t.get("dtype", "float32"))
    param = str(t.get("mixed_precision_param", "bfloat16"))
    if dtype == "bfloat16":
        src.values["precision"] = "bf16-pure"
    else:
        src.values["precision"] = "bf16-mixed" if param == "bfloat16" else "fp32"
    src.read.append(("training.mixed_precision_param", f"{param}: --precision {src.values['precision']}"
                     + (" (FSDP2 MixedPrecisionPolicy, fp32 reduction)" if src.values["precision"] == "bf16-mixed"
                        else "")))
    if src.values["precision"] != "bf16-pure" and "fsdp" in src.values["strategy"][0]:
        src.knobs["fsdp"]["reduce_dtype"] = "fp32"
    opt = d.get("optimizer") or {}
    name = str(opt.get("name", "AdamW"))
    if name not in ("AdamW", "Adam"):
        raise refuse(doc, ("optimizer", "name"), name, "its states are not planned (AdamW and Adam are)")
    impl = {"fused": "fused", "foreach": "foreach", "for-loop": "forloop"}.get(str(opt.get("implementation", "fused")))
    if impl is None:
        raise doc.error(("optimizer", "implementation"), opt.get("implementation"), "fused, foreach or for-loop")
    wd = opt.get("weight_decay", 0.1 if name == "AdamW" else 0.0)
    src.values |= {"optimizer": "adamw", "optimizer_impl": impl, "weight_decay": float(wd)}
    src.read.append(("optimizer", f"--optimizer adamw --optimizer-impl {impl} --weight-decay {float(wd):g}"))
    if as_bool(doc, ("optimizer", "early_step_in_backward"), opt.get("early_step_in_backward", False)):
        src.values |= {"optimizer_in_backward": True, "grad_pass": "none"}
        src.read.append(("optimizer.early_step_in_backward", "--optimizer-in-backward --grad-pass none"))
    else:
        src.values["grad_pass"] = "clip"
        src.read.append(("training.max_norm", f"{t.get('max_norm', 1.0)}: --grad-pass clip (clip_grad_norm_)"))


def _memory_and_kernels(doc: Doc, d: dict, src: Source) -> None:
    ac = d.get("activation_checkpoint") or {}
    mode = str(ac.get("mode", "selective"))
    option = str(ac.get("selective_ac_option", "2"))
    if mode == "memory_budget":
        raise refuse(doc, ("activation_checkpoint", "mode"), mode, "the compiler's memory-budget recomputation "
                     "is not planned (none, full and the per-op selective policy are)")
    if mode not in ("none", "full", "selective"):
        raise doc.error(("activation_checkpoint", "mode"), mode, "none, selective, full or memory_budget")
    if mode == "selective" and option != "op":
        ckpt = "full"
        if option != "1":
            ignore(src, "activation_checkpoint.selective_ac_option", f"{option}: every {option}th block "
                   "checkpointed whole; planned as every block (the memory a lower bound, the recompute an "
                   "upper one)")
    else:
        ckpt = mode
    src.values["checkpointing"] = ckpt
    src.read.append(("activation_checkpoint.mode", f"{mode}{' ' + option if mode == 'selective' else ''}: "
                     f"--checkpointing {ckpt}" + ("" if "mode" in ac else " (torchtitan's default)")))
    key = ("training", "compile") if "compile" in (d.get("training") or {}) else ("compile", "enable")
    on = as_bool(doc, key, _get(d, *key) or False)
    src.values["fused_kernels"] = on
    src.read.append((".".join(key), f"{on}: " + ("--fused-kernels" if on else "--no-fused-kernels")))
    if _get(d, "model", "norm_type") == "fused_rmsnorm":
        src.values["fused_norm"] = True
        src.read.append(("model.norm_type", "fused_rmsnorm: --fused-norm"))


def _fp8(doc: Doc, d: dict, src: Source) -> None:
    converters = [str(c) for c in (_get(d, "model", "converters") or [])]
    old = d.get("float8") or {}  # the older layout: [float8] enable_float8_linear
    f8 = _get(d, "quantize", "linear", "float8") or old
    if (stale := [c for c in converters if c in ("float8", "mx")]) and "quantize" in d:
        # the [quantize.*] layout registers quantize.linear.float8 / quantize.linear.mx
        # (components/quantization/float8.py, mx.py): build_model_converters raises KeyError on the
        # short names before training starts
        raise refuse(doc, ("model", "converters"), converters, f"torchtitan with the [quantize.*] sections registers "
                     f"its converters as quantize.linear.{stale[0]}: {stale[0]!r} stops the run at startup; name it "
                     f"quantize.linear.{stale[0]}")
    if any(c in MX_CONVERTERS for c in converters):
        src.values["fp8"] = "mxfp8-torchao"
        src.read.append(("model.converters", "mx: --fp8 mxfp8-torchao (torchao's MXLinear)"))
        return
    if not (any(c in FP8_CONVERTERS for c in converters) or old.get("enable_float8_linear")):
        return

    recipe = str(f8.get("recipe_name") or "tensorwise")
    if recipe not in ("tensorwise", "rowwise"):
        raise refuse(doc, ("quantize", "linear", "float8", "recipe_name"), recipe, "rowwise_with_gw_hp is not "
                     "planned (tensorwise and rowwise are)")
    src.values["fp8"] = recipe
    all_gather = recipe == "tensorwise" and bool(f8.get("enable_fsdp_float8_all_gather"))
    if all_gather:
        src.values["fp8_all_gather"] = True
    src.read.append(("model.converters", f"float8: --fp8 {recipe}" + (" --fp8-all-gather" if all_gather else "")))

