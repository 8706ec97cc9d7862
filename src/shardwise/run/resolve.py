"""What a run decides from its config for the device, torch-free and once, in the run bridge
(`shardwise.run.bridge`), so that the plan and the build agree: whether the decoder layers are
compiled (shardwise.train.model.compile) and what keeps packed documents apart
(shardwise.train.model.packed_attention)."""

from __future__ import annotations

import importlib.util
from typing import Any

from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError

COMPILED_ENGINES = ("fsdp2", "ddp")


def compile_enabled(cfg: TrainConfig, device: str, engine: str) -> bool:
    """Whether the run compiles its decoder layers (`run.compile`; None = on for CUDA with the
    FSDP2 and DDP engines). Refuses an explicit request the engine cannot honour."""
    want = cfg.run.compile
    if want and engine not in COMPILED_ENGINES:
        raise ShardwiseError(
            f"{cfg.source}: run.compile is true, but strategy {cfg.strategy.name!r} runs on DeepSpeed, whose ZeRO "
            "hooks are not compiled here; compile runs with fsdp* and ddp strategies (set run.compile: false)")
    if want is None:
        return device == "cuda" and engine in COMPILED_ENGINES
    return bool(want)


# Analytic families whose transformers causal-LM class has no SDPA path (`_supports_sdpa` False
# in transformers 5.24; tests/train/test_inputs_checked.py checks every family against the
# installed transformers): gemma2 (attention logit softcapping), mpt (eager-only MptAttention).
# They run eager attention, so packed rows run dense.
NO_SDPA = ("gemma2", "mpt")
CHOICES = ("auto", "varlen", "flex", "dense")
# Analytic families whose transformers class has no FlexAttention path (`_supports_flex_attn`
# False in transformers 5.24; tests/train/test_packed_attention.py checks them): packed rows
# take sdpa_varlen there under `auto`.
NO_FLEX = ("gpt2", "mpt")


def packed_attention(choice: str, *, data_kind: str, device: str, attention: str, family: str, precision: str,
            source: str = "<config>", flash_attn: bool | None = None) -> str:
    """What packs documents apart for a run (a `TrainSpec.packed_attention` value). `flash_attn`:
    whether flash-attn is importable (None: look). Refuses what cannot run, naming the field."""
    if data_kind != "sft":
        return "none"  # synthetic rows: one sequence each, positions 0..S-1, causal only
    field = f"{source}: data.sft.packed_attention {choice!r}"
    eager = attention == "eager" or family in NO_SDPA
    if choice == "dense" or (choice == "auto" and eager):
        return "dense"
    if eager:
        why = "model.attention is 'eager'" if attention == "eager" else f"{family} runs eager attention"
        raise ShardwiseError(f"{field}: {why}, which attends packed rows through the dense mask; set "
                             "data.sft.packed_attention: dense (or auto), or model.attention: sdpa")
    if flash_attn is None:
        flash_attn = importlib.util.find_spec("flash_attn") is not None
    flash = device == "cuda" and flash_attn and precision != "fp32"  # flash-attn has no fp32 kernel
    if choice == "flex":
        if device != "cuda":
            raise ShardwiseError(f"{field}: FlexAttention has no backward on {device} in torch 2.13 (\"FlexAttention "
                                 "does not support backward on CPU\"); use auto or varlen (one SDPA call per document)")
        if family in NO_FLEX:
            raise ShardwiseError(f"{field}: transformers has no FlexAttention path for {family}; use auto or varlen")
        return "flex"
    if choice == "varlen":
        return "flash_varlen" if flash else "sdpa_varlen"
    if choice != "auto":
        raise ShardwiseError(f"{field}: expected one of {', '.join(CHOICES)}")
    if flash:
        return "flash_varlen"
    return "flex" if device == "cuda" and family not in NO_FLEX else "sdpa_varlen"


def check_pipeline(run: Any) -> None:
    """Refuse, before any rank starts, what the trainer's pipeline (strategy.pp > 1,
    shardwise.train.engines.pipeline) does not run: the rule is shardwise.specs.pipeline's
    `trainer_pp_gap`, which the recommender asks too."""
    from shardwise.specs.pipeline import stage_engine_refusal, trainer_pp_gap

    pp = run.layout.pp
    if pp == 1:
        return
    s = run.strategy
    why = trainer_pp_gap(run.model, s, run.train)
    if why:
        named = f" with strategy {s.name!r}" if stage_engine_refusal(s) else ""
        raise ShardwiseError(f"{run.config.source}: strategy.pp {pp}{named}: {why}")


def check_fsdp_units(run: Any) -> None:
    """Refuse, before any rank starts, `strategy.fsdp.wrap_embeddings` where the trainer cannot
    carve the embedding and head units (train/engines/fsdp.carved_units), for the reason
    plan/stage.embedding_units_refusal gives (a tied lm_head, pipeline stages)."""
    s = run.strategy
    if s.engine != "fsdp2" or not s.fsdp.wrap_embeddings:
        return
    from shardwise.plan.stage import embedding_units_refusal

    why = embedding_units_refusal(run.model.tie_embeddings, run.layout.pp)
    if why:
        pp = f" with strategy.pp {run.layout.pp}" if run.layout.pp > 1 else ""
        raise ShardwiseError(f"{run.config.source}: strategy.fsdp.wrap_embeddings{pp}: {why}; set "
                             "strategy.fsdp.wrap_embeddings: false")


def check_tensor_parallel(run: Any) -> None:
    """Refuse, before any rank starts, what the trainer's TP (FSDP2: shardwise.train.model.tensor_parallel;
    ZeRO-1/2: DeepSpeed's AutoTP, shardwise.run.deepspeed.autotp_section) cannot split or does not run."""
    tp = run.layout.tp
    if tp == 1:
        return
    cfg, m = run.config, run.model
    where = f"{cfg.source}: strategy.tp {tp}"
    from shardwise.specs.layout import trainer_tp_gap

    gap = trainer_tp_gap(m, tp, run.strategy.tp_scheme.vocab_parallel)
    if gap:
        raise ShardwiseError(f"{where}: {gap}; set strategy.tp: 1")
    engine, stage = run.strategy.engine, run.strategy.zero_stage
    if engine == "deepspeed" and stage not in (1, 2):
        raise ShardwiseError(f"{where} with strategy {run.strategy.name!r}: ZeRO × TP runs through DeepSpeed's "
                             "AutoTP with ZeRO-1 or ZeRO-2 (strategy zero1 or zero2; the checkpoint mapping of "
                             "AutoTP's shards is built and tested for those stages only), or use strategy fsdp")
    if engine not in ("fsdp2", "deepspeed"):
        raise ShardwiseError(f"{where} with strategy {run.strategy.name!r}: tensor parallelism runs with FSDP2 "
                             "(strategy fsdp, fsdp-grad-op or fsdp-hybrid; with tp = world size it is TP alone) "
                             "or DeepSpeed's AutoTP (zero1, zero2); DDP does not take DTensor parameters")
    if run.strategy.offload_params or run.strategy.offload_optimizer:
        raise ShardwiseError(f"{where}: CPU offload with tensor parallelism is not supported; use strategy "
                             + ("zero1 or zero2" if engine == "deepspeed" else "fsdp"))
    if run.train.compute_dtype == "fp16":
        why = ("its GradScaler does not unscale DTensor gradients across TP ranks" if engine == "fsdp2" else
               "DeepSpeed's fp16 loss scaler under AutoTP is not verified by shardwise's parity tests")
        raise ShardwiseError(f"{where}: fp16-mixed with tensor parallelism is not supported ({why}); "
                             "use precision bf16-mixed")
    if cfg.lora is not None:
        kind = "QLoRA (an nf4 base)" if cfg.lora.quantization == "nf4" else "LoRA"
        raise ShardwiseError(f"{where}: {kind} with tensor parallelism is not supported: PEFT's adapters are plain "
                             "tensors beside the TP-sharded base linears (DTensors, or AutoTP's LinearLayer), and sharding them to match "
                             "(A column-wise of a row-wise base, B row-wise of a column-wise one) is not built; "
                             "set strategy.tp: 1")
