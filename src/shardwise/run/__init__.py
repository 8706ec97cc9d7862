"""One description of a run, from the trainer's YAML to the planner's specs and the engines'
configs (docs/architecture.md "The run bridge"). Torch-free."""

from shardwise.run.bridge import (
    CPU_BUCKET_ELEMENTS,
    RunSpec,
    config_dict,
    model_spec,
    run_spec,
    seq_len,
    to_config,
    train_spec,
    trainer_knobs,
)
from shardwise.run.deepspeed import deepspeed_config, zero_section

__all__ = [
    "CPU_BUCKET_ELEMENTS",
    "RunSpec",
    "config_dict",
    "deepspeed_config",
    "model_spec",
    "run_spec",
    "seq_len",
    "to_config",
    "train_spec",
    "trainer_knobs",
    "zero_section",
]
