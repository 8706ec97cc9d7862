"""accelerate `--config_file` YAML for a planned strategy (DEEPSPEED, FSDP v2 or MULTI_GPU).

Keys are the ones `accelerate config` writes and `accelerate launch` maps to its flags
(`fsdp_config.fsdp_*` -> `--fsdp_*`); unknown keys there would be silently dropped, so the
test pushes every file through accelerate's launcher argument processing as well.
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.specs import HardwareSpec, ModelSpec, ParallelLayout, Strategy, TrainSpec
from shardwise.specs.layer_class import layer_class

DS_HF_FILE = "ds_config_hf.json"

# accelerate's mixed_precision: bf16-pure has no accelerate mode of its own (it is the
# model loaded in bf16 with bf16 autocast); "bf16" is the closest and the README says so.
MIXED_PRECISION = {"bf16-mixed": "bf16", "bf16-pure": "bf16", "fp16-mixed": "fp16", "fp32": "no"}


def check_emittable(strategy: Strategy) -> None:
    """Emission covers what `shardwise train` runs (`Strategy.trainable`): data parallelism, TP
    with FSDP2 or ZeRO-1/2, PP with FSDP2. The refusal names the tool that runs the configuration
    instead."""
    if not strategy.trainable:
        from shardwise.plan.recommend import tool_for

        raise ShardwiseError(
            f"config emission supports data parallelism, and tensor parallelism with FSDP2 or ZeRO-1/2 and pipeline "
            f"parallelism with FSDP2 (no offload); {strategy.name} has tp {strategy.tp}, pp {strategy.pp}: it is "
            f"plan-only, run it with {tool_for(strategy, TrainSpec())}"
        )


def accelerate_launches(strategy: Strategy) -> bool:
    """Whether an accelerate config runs this plan: accelerate launches a user's script on its own
    FSDP or DeepSpeed, which applies neither the trainer's tensor-parallel plan nor its pipeline
    stages, so TP and PP runs go through `shardwise train` only."""
    return strategy.tp == 1 and strategy.pp == 1


def accelerate_config(
    model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, *, ds_config_file: str = DS_HF_FILE,
) -> dict[str, Any]:
    """The accelerate config dict; `ds_config_file` is where DEEPSPEED reads its JSON from."""
    check_emittable(strategy)
    if not accelerate_launches(strategy):
        raise ShardwiseError(f"no accelerate config for {strategy.name} with tp {strategy.tp}, pp {strategy.pp}: "
                             "accelerate's FSDP and DeepSpeed plugins run neither the trainer's TP plan nor its "
                             "pipeline stages; launch shardwise train (launch_torchrun.sh, slurm.sbatch)")
    world = hw.world_size
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "mixed_precision": MIXED_PRECISION[train.precision],
        "num_machines": hw.nodes,
        "num_processes": world,  # total over all machines, as accelerate counts them
        # Placeholders: launch_accelerate.sh overrides these per node from the environment.
        "machine_rank": 0,
        "main_process_ip": "127.0.0.1",
        "main_process_port": 29500,
        "rdzv_backend": "static" if hw.nodes == 1 else "c10d",
        "same_network": True,
        "main_training_function": "main",
        "enable_cpu_affinity": False,
        "use_cpu": False,
        "gpu_ids": "all",
        "downcast_bf16": False,
    }
    if strategy.engine == "deepspeed":
        # accelerate refuses mixed_precision from the config file beside a deepspeed_config_file
        # (DeepSpeedPlugin: "will be ignored"); the JSON's "auto" precision is filled from
        # `accelerate launch --mixed_precision` (launch_accelerate.sh) or HF Trainer's --bf16.
        del cfg["mixed_precision"]
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            # With a config file accelerate refuses the per-key deepspeed_* settings: all in the JSON.
            "deepspeed_config_file": ds_config_file,
            "deepspeed_multinode_launcher": "standard",
            # Build the model already partitioned under ZeRO-3 (no full copy per rank at load).
            "zero3_init_flag": strategy.zero_stage == 3,
        }
    elif strategy.engine == "fsdp2":
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            # One bool for every unit in accelerate's FSDP2 (fsdp2_prepare_model passes it to each
            # fully_shard; FullyShardedDataParallelPlugin refuses a non-bool): true is "all" or
            # "layers" (how accelerate treats the root depends on its version); "not-last" has no
            # key, true is its nearest.
            "fsdp_reshard_after_forward": strategy.resharding != "none",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_class(model),
            "fsdp_offload_params": strategy.offload_params or strategy.offload_optimizer,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": train.checkpointing != "none",
        }
        if strategy.fsdp_sharding == "hybrid":
            # FSDP2's HSDP is a 2-D mesh in accelerate: shard inside a group, replicate across.
            layout = ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
            cfg["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": layout.dp_replicate,
                "parallelism_config_dp_shard_size": layout.dp_shard,
            }
    else:  # ddp
        cfg["distributed_type"] = "MULTI_GPU" if world > 1 else "NO"
    return cfg
