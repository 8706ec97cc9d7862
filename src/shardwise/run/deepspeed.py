"""The one DeepSpeed config builder: the trainer's engine, `plan --emit` and the benches all
pass a RunSpec through it, so the JSON DeepSpeed receives is the JSON that was planned.

Pure (no torch, no deepspeed import). Settings made explicit because DeepSpeed's defaults
would break parity with DDP/FSDP2 or differ from the plan:
- `gradient_clipping` = optimizer.max_grad_norm (DeepSpeed's default is 1.0 in 0.19, 0.0 = off in
  earlier releases: never left to the version);
- AdamW `weight_decay` explicit (torch's AdamW default is 0.01);
- `prescale_gradients: false`, `gradient_predivide_factor: 1.0`: a plain average over ranks;
- `communication_data_type` when the strategy's knob is not DeepSpeed's default;
- fp16 dynamic loss scaling from 2^16, as torch's GradScaler;
- the ZeRO knobs of the strategy, under DeepSpeed's own key names, and ZeRO-3's fetch unit
  (`leaf_module`: the decoder layer where the plan chose it; DeepSpeedKnobs.fetch_unit).
The learning rate: shardwise's loop sets it on every step (`Engine.set_lr`), so the scheduler
block only matters to scripts of your own that use this JSON; it approximates the configured
schedule with DeepSpeed's nearest one (docs/emit.md).
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.run.bridge import RunSpec
from shardwise.specs import ModelSpec, Strategy
from shardwise.specs.layer_class import layer_class

# The trainer logs every step itself; DeepSpeed's periodic prints would only repeat it.
STEPS_PER_PRINT = 2**31 - 1


def zero_section(strategy: Strategy, model: ModelSpec, *, pin_memory: bool = True) -> dict[str, Any]:
    """The `zero_optimization` block: every knob the plan assumed, under DeepSpeed's key names."""
    stage = strategy.zero_stage or 0
    k = strategy.ds
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": k.reduce_bucket_size,
        "allgather_bucket_size": k.allgather_bucket_size,
        "overlap_comm": k.overlap(stage),
        "contiguous_gradients": k.contiguous_gradients,
        "reduce_scatter": k.reduce_scatter,
        "use_multi_rank_bucket_allreduce": k.use_multi_rank_bucket_allreduce,
    }
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": k.prefetch_bucket_size,
            "stage3_max_live_parameters": k.max_live_parameters,
            "stage3_max_reuse_distance": k.max_reuse_distance,
            "stage3_param_persistence_threshold": k.param_persistence_threshold,
            # lets `save_16bit_model()` write one consolidated checkpoint (memory at save only)
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        if k.zero3_unit(model.params_per_layer / strategy.tp) == "layer":
            # each decoder layer is one fetch/release (its submodules get no hooks); this
            # replaces DeepSpeed's default leaves (MoE blocks), which a layer contains
            zero["leaf_module"] = {"classes": [layer_class(model)]}
    # pinned host buffers: the PCIe copies the plan's offload timing assumes are pinned
    if strategy.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if strategy.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return zero


def _scheduler(run: RunSpec, pick) -> dict[str, Any]:
    """DeepSpeed's nearest scheduler to the configured one (linear warmup in all of them)."""
    cfg = run.config
    sched, lr, total = cfg.schedule, cfg.optimizer.lr, max(1, cfg.run.steps)
    # deepspeed >= 0.19.6 rejects warmup_num_steps <= 0 (HF clamps to 1 the same way)
    warmup = max(1, sched.warmup_steps)
    common = {"warmup_num_steps": pick(warmup), "warmup_type": "linear"}
    if sched.kind == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": pick(total), "warmup_min_ratio": 0.0,
            "cos_min_ratio": sched.min_lr_ratio, **common}}
    if sched.kind == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": pick(0.0), "warmup_max_lr": pick(lr), **common}}
    # warmup_decay and linear: linear decay to 0 at the last step (DeepSpeed has no floor here)
    return {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": pick(0.0), "warmup_max_lr": pick(lr), "total_num_steps": pick(total), **common}}


def uses_torch_adam(run: RunSpec) -> bool:
    """torch's AdamW unless offloading from a GPU, where DeepSpeedCPUAdam's SIMD step is what
    makes offload usable (on CPU torch's avoids building the C++ op)."""
    return run.device == "cpu" or not run.strategy.offload_optimizer


# AutoTP's partition of a Llama/Qwen2/Mistral decoder layer (the families specs.layout's
# trainer_tp_gap lets through): Megatron's column-wise q/k/v and gate/up, row-wise o/down, by
# the parameter name of the linear. `use_default_specs: false`: with a partition_config AutoTP
# shards only what a spec names (module_inject/auto_tp.py, "rely only on explicit specs and skip
# unmatched layers"), so the embedding, the norms and lm_head stay whole on every TP rank and
# the chunked loss runs on the replicated lm_head as without TP.
AUTOTP_LAYER_SPECS = (
    {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(gate|up)_proj\.weight$"],
     "partition_type": "column"},
    {"patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"],
     "partition_type": "row"},
)


def autotp_section(tp: int) -> dict[str, Any]:
    """The `tensor_parallel` block of ZeRO-1/2 × TP (DeepSpeed's AutoTP training, >= 0.16.4)."""
    return {"autotp_size": tp, "vocab_parallel_lm_head": False,
            "partition_config": {"use_default_specs": False, "layer_specs": [dict(s) for s in AUTOTP_LAYER_SPECS]}}


def _tp_batch(run: RunSpec) -> int:
    """DeepSpeed 0.19 asserts `train_batch_size` against the world size of the default group
    (`DeepSpeedConfig` without an mpu: runtime/config.py `_batch_assertion`), not against the
    data-parallel degree AutoTP leaves: with `tensor_parallel.autotp_size` the "batch" it checks
    counts every TP rank's copy of its group's batch."""
    return run.layout.tp


def deepspeed_config(run: RunSpec, *, hf_auto: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of `run`; `hf_auto` puts "auto" where Hugging Face Trainer fills the
    value from TrainingArguments (batch, optimizer, scheduler, precision, clipping). The ZeRO
    knobs stay concrete in both: HF's "auto" reduce_bucket_size (hidden²) is not what was planned."""
    s = run.strategy
    if s.engine != "deepspeed":
        raise ShardwiseError(f"strategy {s.name!r} runs on {s.engine}, not DeepSpeed: no DeepSpeed config")

    def pick(concrete: Any) -> Any:
        return "auto" if hf_auto else concrete

    cfg, train = run.config, run.train
    o = cfg.optimizer
    adam: dict[str, Any] = {"lr": pick(o.lr), "betas": pick(list(o.betas)), "eps": pick(o.eps),
                            "weight_decay": pick(o.weight_decay)}
    torch_adam = uses_torch_adam(run)
    if torch_adam:
        adam["torch_adam"] = True
        if o.fused if o.fused is not None else run.device == "cuda":
            adam["fused"] = True
    dtype = train.compute_dtype
    comm = s.ds.communication_data_type
    return {
        "train_micro_batch_size_per_gpu": pick(train.micro_batch),
        "gradient_accumulation_steps": pick(train.grad_accum),
        # DeepSpeed asserts train = micro × accumulation × data-parallel ranks
        "train_batch_size": pick(train.micro_batch * train.grad_accum * run.layout.dp * _tp_batch(run)),
        "gradient_clipping": pick(o.max_grad_norm),
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "optimizer": {"type": "AdamW", "params": adam},
        "scheduler": _scheduler(run, pick),
        "zero_optimization": zero_section(s, run.model, pin_memory=run.device == "cuda"),
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": not torch_adam,
        "bf16": {"enabled": pick(dtype == "bf16")},
        "fp16": {"enabled": pick(dtype == "fp16"), "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        **({} if comm == "auto" else {"communication_data_type": comm}),
        **({"tensor_parallel": autotp_section(run.layout.tp)} if run.layout.tp > 1 else {}),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
