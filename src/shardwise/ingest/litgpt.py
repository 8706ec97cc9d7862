"""A LitGPT finetune config YAML (`litgpt finetune lora|full --config FILE`; Lightning-AI/litgpt
config_hub/finetune/*, read by jsonargparse into `litgpt/finetune/{lora,full}.py` `setup`). The
method is the command's, not a key: a file with `lora_r` (or `quantize`) is planned as
`litgpt finetune lora`, one without as `litgpt finetune full`; a `*adapter*` file
(LLaMA-Adapter) is refused.

Stock semantics, from Lightning-AI/litgpt@00af8b0d (file:line there):
- `checkpoint_dir: checkpoints/<org>/<name>`: the Hugging Face checkpoint LitGPT converted; the
  model as `--model <org>/<name>` (a local directory with config.json is read as such). LitGPT's
  GPT keeps lm_head apart from the embedding even where the checkpoint ties them
  (litgpt/model.py:25-32; scripts/convert_hf_checkpoint.py copies it): said first for tied models.
- `precision` (lora.py:84, default `get_default_supported_precision(training=True)`, utils.py:354:
  bf16-mixed on a bf16 GPU): bf16-true → bf16-pure, bf16-mixed → bf16-mixed, 32-true → fp32,
  16-mixed → fp16-mixed; 16-true (fp16 weights and states) is not plannable.
- `devices` × `num_nodes` = 1: strategy "auto", the bare module, no activation checkpointing →
  `-s ddp --gpus 1 --checkpointing none`; more: FSDPStrategy(auto_wrap_policy={Block},
  activation_checkpointing_policy={Block}) (lora.py:139-152): Lightning's FULL_SHARD per Block,
  every block checkpointed → `-s fsdp --checkpointing full --fsdp-reshard-after-forward layers`,
  gradients held unsharded between micro-batches (`fabric.no_backward_sync`: FSDP's no_sync) and
  reduced in the param dtype (Lightning FSDPPrecision: bf16 for bf16-true and bf16-mixed).
  Lightning's bf16-mixed FSDP gathers fp32 parameters and autocasts: planned as bf16 gathers (said first).
- `train.micro_batch_size` (default 1), `train.global_batch_size` (default 16): accumulation
  global // devices // micro (litgpt/args.py:53-63: `devices`, not × num_nodes);
  `train.max_seq_length` (default None: each batch's longest sample, up to the model's block size).
- LoRA: `lora_r` (8), `lora_dropout` (0.05), `lora_query` (true), `lora_key` (false), `lora_value`
  (true), `lora_projection`, `lora_mlp`, `lora_head` (false) (lora.py:53-61) → PEFT's names
  (Phi-3's fused qkv_proj / gate_up_proj); LoRA on lm_head is not planned (said first);
  `quantize: bnb.nf4[-dq]`/`bnb.fp4[-dq]` → `--qlora` (4-bit; LitGPT refuses it with more than one
  device or a mixed precision, lora.py:127-147, and so does the plan), `bnb.int8-training` not planned.
- `optimizer` (default "AdamW"): torch's AdamW with no fused/foreach argument (`--optimizer-impl
  foreach`), weight_decay from its init_args (torch's default 0.01); SGD; with quantize,
  bitsandbytes' 32-bit PagedAdamW (lora.py:180-183 at 5895df10), planned as a fused AdamW.
- no gradient clipping (max_norm is unsupported: lora.py:413) → `--grad-pass none`; the loss on
  128-token chunks of bf16 logits (utils.py chunked_cross_entropy) → `--cross-entropy chunked-output`.
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.ingest.common import (
    Context,
    Doc,
    Source,
    as_bool,
    as_count,
    as_number,
    hub_model,
    ignore,
    lora_dropout,
    refuse,
)
from shardwise.ingest.training_args import rest

PRECISIONS = {"bf16-true": "bf16-pure", "bf16-mixed": "bf16-mixed", "32-true": "fp32", "16-mixed": "fp16-mixed"}
# lora.py setup(): the adapted parts' defaults
LORA_PARTS = {"lora_query": True, "lora_key": False, "lora_value": True, "lora_projection": False,
              "lora_mlp": False, "lora_head": False}
FOUR_BIT = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq")
NO_EFFECT = {"out_dir", "data", "eval", "logger_name", "seed", "access_token", "resume", "lora_alpha"}
TRAIN_NO_EFFECT = {"save_interval", "log_interval", "lr_warmup_steps", "lr_warmup_fraction", "epochs", "max_tokens",
                   "max_steps", "min_lr", "tie_embeddings", "learning_rate", "beta1", "beta2"}


def is_litgpt(data: dict[str, Any]) -> bool:
    return "checkpoint_dir" in data and isinstance(data.get("train", {}), dict)


def read(doc: Doc, ctx: Context) -> Source:
    d = doc.data
    src = Source("litgpt", doc.path)
    if "adapter" in doc.path.stem:
        raise refuse(doc, ("checkpoint_dir",), d.get("checkpoint_dir"), f"{doc.path.name} is a `litgpt finetune "
                     "adapter` config (LLaMA-Adapter's prompts, not planned); LoRA and full configs are")
    hub_model(doc, ("checkpoint_dir",), _hub_id(doc, d.get("checkpoint_dir")), src, ctx)
    lora = "lora_r" in d or d.get("quantize") is not None
    seen = {"checkpoint_dir", "precision", "quantize", "devices", "num_nodes", "train", "optimizer", "lora_r",
            "lora_dropout", *LORA_PARTS}
    precision = _precision(doc, d, src, lora)
    gpus = _layout(doc, d, src, ctx, precision)
    _batch(doc, d, src, gpus)
    quantized = _lora(doc, d, src, ctx, lora, precision, gpus)
    _optimizer(doc, d, src, quantized)
    src.values |= {"grad_pass": "none", "cross_entropy": "chunked-output"}
    src.read.append(("(litgpt finetune)", "--grad-pass none (max_norm unsupported) --cross-entropy chunked-output "
                     "(the loss on 128-token chunks of the logits)"))
    _untied_head(src, ctx)
    rest(doc, d, src, seen, NO_EFFECT)
    return src


def _hub_id(doc: Doc, value: Any) -> str:
    """`checkpoints/<org>/<name>` → `<org>/<name>`: LitGPT's download layout; a directory holding
    config.json is kept as it is (hub_model reads it)."""
    if not isinstance(value, str) or not value.strip():
        raise doc.error(("checkpoint_dir",), value, "a checkpoint directory, checkpoints/<org>/<name>")
    from pathlib import Path

    if (Path(value).expanduser() / "config.json").is_file():
        return value
    parts = [p for p in value.strip().rstrip("/").split("/") if p]
    return "/".join(parts[-2:]) if len(parts) >= 2 else value


def _precision(doc: Doc, d: dict, src: Source, lora: bool) -> str:
    raw = d.get("precision")
    if raw is None:
        src.values["precision"] = "bf16-mixed"
        src.read.append(("precision", "--precision bf16-mixed (LitGPT's default on a bf16 GPU)"))
        return "bf16-mixed"
    if not isinstance(raw, str) or raw not in PRECISIONS:
        why = ("fp16 weights, gradients and AdamW states (16-true) are not in the planner's precisions"
               if raw == "16-true" else "expected bf16-true, bf16-mixed, 32-true or 16-mixed")
        raise refuse(doc, ("precision",), raw, why)
    src.values["precision"] = PRECISIONS[raw]
    src.read.append(("precision", f"--precision {PRECISIONS[raw]}"))
    return raw


def _layout(doc: Doc, d: dict, src: Source, ctx: Context, precision: str) -> int:
    """The strategy and GPUs; returns `devices` (the accumulation's divisor)."""
    devices = d.get("devices", 1)
    if not isinstance(devices, int) or isinstance(devices, bool):
        raise doc.error(("devices",), devices, "a whole number of GPUs per node (plan with --gpus for 'auto')")
    devices = as_count(doc, ("devices",), devices)
    nodes = as_count(doc, ("num_nodes",), d.get("num_nodes", 1))
    gpus = devices * nodes
    src.values["gpus"] = gpus
    if nodes > 1:
        src.values["gpus_per_node"] = devices
    if gpus == 1:
        src.values |= {"strategy": ["ddp"], "checkpointing": "none"}
        src.read.append(("devices", "1: -s ddp --gpus 1 --checkpointing none (strategy 'auto': the bare module)"))
        return devices
    src.values |= {"strategy": ["fsdp"], "checkpointing": "full"}
    src.knobs["fsdp"] |= {"reshard_after_forward": "layers", "reduce_every_micro_batch": False,
                          "reduce_dtype": "fp32" if precision == "32-true" else "param"}
    src.read.append(("devices", f"{devices} × num_nodes {nodes}: -s fsdp --gpus {gpus} --checkpointing full "
                     "(FSDPStrategy: FULL_SHARD per Block, every Block checkpointed, no_sync under accumulation)"))
    if precision == "bf16-mixed":
        src.warnings.append(f"{src.path.name}: precision bf16-mixed under FSDP: Lightning gathers fp32 parameters "
                            "and autocasts (FSDPPrecision param_dtype float32); planned with bf16 gathers")
    return devices


def _batch(doc: Doc, d: dict, src: Source, devices: int) -> None:
    t = d.get("train") or {}
    if not isinstance(t, dict):
        raise doc.error(("train",), t, "a mapping of LitGPT's TrainArgs")
    micro = as_count(doc, ("train", "micro_batch_size"), t.get("micro_batch_size", 1))
    glob = as_count(doc, ("train", "global_batch_size"), t.get("global_batch_size", 16))
    accum = glob // devices // micro
    if accum < 1:
        raise doc.error(("train", "global_batch_size"), glob, f"at least devices ({devices}) × micro_batch_size "
                        f"({micro}): LitGPT asserts gradient_accumulation_iters > 0 (litgpt/args.py)")
    src.values |= {"micro_batch": micro, "grad_accum": accum}
    src.read.append(("train.micro_batch_size", f"--micro-batch {micro}"))
    src.read.append(("train.global_batch_size", f"--grad-accum {accum} ({glob} // {devices} device(s) // {micro})"))
    seq = t.get("max_seq_length")
    if seq is None:
        src.warnings.append(f"{src.path.name}: train.max_seq_length unset: LitGPT pads each batch to its longest "
                            "sample, up to the model's block size; planned at --seq-len (pass the longest)")
    else:
        src.values["seq_len"] = as_count(doc, ("train", "max_seq_length"), seq)
        src.read.append(("train.max_seq_length", f"--seq-len {src.values['seq_len']} (the longest batch)"))
    if t.get("max_norm") is not None:
        src.read.append(("train.max_norm", "not applied by LitGPT's finetune scripts: no change"))
    for k in t:
        if k in ("micro_batch_size", "global_batch_size", "max_seq_length", "max_norm", "weight_decay"):
            continue
        if k in TRAIN_NO_EFFECT:
            src.read.append((f"train.{k}", "no change to memory or time"))
        else:
            src.ignored.append((f"train.{k}", "not a key shardwise plans"))


def _lora(doc: Doc, d: dict, src: Source, ctx: Context, lora: bool, precision: str, gpus: int) -> bool:
    """The adapters; returns whether the base is quantized."""
    if not lora:
        src.values["lora_rank"] = 0
        src.read.append(("(no lora_r)", "litgpt finetune full: --lora-rank 0"))
        return False
    rank = as_count(doc, ("lora_r",), d.get("lora_r", 8))
    parts = {k: as_bool(doc, (k,), d.get(k, default)) for k, default in LORA_PARTS.items()}
    from shardwise.plan.planner import resolve_model

    model = resolve_model(*(ctx.value(n, src) for n in ("model", "model_config", "params")))
    fused = model.family == "phi3"
    targets: list[str] = []
    qkv = [name for part, name in (("lora_query", "q_proj"), ("lora_key", "k_proj"), ("lora_value", "v_proj"))
           if parts[part]]
    if qkv:
        targets += ["qkv_proj"] if fused else qkv
    if parts["lora_projection"]:
        targets.append("o_proj")
    if parts["lora_mlp"]:
        targets += ["gate_up_proj", "down_proj"] if fused else ["gate_proj", "up_proj", "down_proj"]
    if not targets:
        raise doc.error(("lora_query",), False, "at least one adapted part (lora_query, lora_key, lora_value, "
                        "lora_projection or lora_mlp)")
    src.values |= {"lora_rank": rank, "lora_targets": ",".join(targets)}
    src.read.append(("lora_r/lora_*", f"--lora-rank {rank} --lora-targets {','.join(targets)}"))
    lora_dropout(doc, ("lora_dropout",), d.get("lora_dropout", 0.05), src,
                 "" if "lora_dropout" in d else "LitGPT's default 0.05")
    if parts["lora_head"]:
        ignore(src, "lora_head", "the LoRA adapter on lm_head and its activations")
    q = d.get("quantize")
    if q is None:
        return False
    if q == "bnb.int8-training":
        ignore(src, "quantize", "an 8-bit bitsandbytes base (planned in the compute dtype)")
        return True
    if not isinstance(q, str) or q not in FOUR_BIT:
        raise doc.error(("quantize",), q, f"one of {', '.join((*FOUR_BIT, 'bnb.int8-training'))}")
    if gpus > 1:
        raise refuse(doc, ("quantize",), q, "LitGPT raises NotImplementedError for quantize with more than one "
                     "device (litgpt/finetune/lora.py)")
    if "mixed" in precision:
        raise refuse(doc, ("quantize",), q, "LitGPT raises 'Quantization and mixed precision is not supported' "
                     "(litgpt/finetune/lora.py)")
    src.values["qlora"] = True
    src.read.append(("quantize", f"{q}: --qlora (bitsandbytes 4-bit base)"))
    return True


def _optimizer(doc: Doc, d: dict, src: Source, quantized: bool) -> None:
    opt = d.get("optimizer", "AdamW")
    name, args = (opt, {}) if isinstance(opt, str) else (
        (opt.get("class_path"), opt.get("init_args") or {}) if isinstance(opt, dict) else (None, {}))
    if not isinstance(args, dict):
        raise doc.error(("optimizer", "init_args"), args, "a mapping of the optimizer's arguments")
    short = str(name).rsplit(".", 1)[-1] if name else None
    if short not in ("AdamW", "SGD"):
        raise doc.error(("optimizer",), opt, "AdamW or SGD (a name or {class_path: torch.optim.AdamW, init_args})")
    train = d.get("train") or {}
    if "weight_decay" in args:
        key, wd = ("optimizer", "init_args", "weight_decay"), args["weight_decay"]
    elif train.get("weight_decay") is not None:  # the older TrainArgs (2024-04) held the optimizer's arguments
        key, wd = ("train", "weight_decay"), train["weight_decay"]
    else:
        key, wd = ("optimizer",), 0.01 if short == "AdamW" else 0.0  # torch's defaults
    wd = as_number(doc, key, wd)
    if short == "SGD":
        src.values |= {"optimizer": "sgd", "weight_decay": wd}
        src.read.append(("optimizer", f"SGD: --optimizer sgd --weight-decay {wd:g}"))
        return
    impl = "fused" if quantized else "foreach"
    src.values |= {"optimizer": "adamw", "optimizer_impl": impl, "weight_decay": wd}
    src.read.append(("optimizer", f"AdamW: --optimizer adamw --optimizer-impl {impl} --weight-decay {wd:g}"
                     + (" (bitsandbytes' 32-bit PagedAdamW under quantize: one kernel a tensor)" if quantized
                        else " (torch's, no fused/foreach argument: foreach on CUDA)")))


def _untied_head(src: Source, ctx: Context) -> None:
    from shardwise.plan.planner import resolve_model

    try:
        model = resolve_model(*(ctx.value(n, src) for n in ("model", "model_config", "params")))
    except ShardwiseError:
        return
    if model.tie_embeddings:
        src.warnings.append(f"{src.path.name}: LitGPT keeps lm_head apart from the embedding ({model.name} ties them; "
                            "its checkpoint conversion copies it): planned tied, one vocabulary × hidden matrix less")
