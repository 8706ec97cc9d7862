"""`shardwise plan --from FILE`: the run a training setup already describes, read by content.

One module per format, each returning a `Source` (shardwise.ingest.common): the plan's inputs
under plan's parameter names, the engine knobs, and the keys read and ignored. `advice` adds
"what to change in that file". Torch-free (docs/from.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.ingest.common import FORMAT_NAMES, Context, Doc, Source, load

__all__ = ["FORMAT_NAMES", "Source", "detect", "read_source"]


def detect(doc: Doc) -> str:
    """The format of a parsed file, from its keys (not its name)."""
    from shardwise.ingest import (
        axolotl,
        deepspeed,
        litgpt,
        llama_factory,
        shardwise_yaml,
        torchtitan,
        torchtune,
        training_args,
    )

    d = doc.data
    if torchtitan.is_torchtitan(doc):
        return "torchtitan"
    if deepspeed.is_deepspeed(d):
        return "deepspeed"
    if "distributed_type" in d or "compute_environment" in d:
        return "accelerate"
    if torchtune.is_torchtune(d):  # before shardwise's: both have a `model` section
        return "torchtune"
    if litgpt.is_litgpt(d):
        return "litgpt"
    if shardwise_yaml.is_shardwise(d):
        return "shardwise"
    if axolotl.is_axolotl(d):
        return "axolotl"
    if llama_factory.is_llama_factory(d):
        return "llama_factory"
    if training_args.is_training_args(d):
        return "training_args"
    top = ", ".join(list(d)[:8]) or "(empty)"
    raise ShardwiseError(
        f"{doc.path}: not a format plan --from reads ({', '.join(FORMAT_NAMES.values())}); its top-level keys "
        f"({top}) match none: a DeepSpeed JSON has zero_optimization or train_micro_batch_size_per_gpu, an "
        "accelerate config distributed_type, a shardwise YAML sections such as strategy and run, TrainingArguments "
        "per_device_train_batch_size, LLaMA-Factory model_name_or_path with stage/finetuning_type, axolotl base_model, "
        "a torchtune config model._component_ naming a torchtune builder, a torchtitan TOML [model] name, a LitGPT "
        "finetune config checkpoint_dir with its train section")


def read_source(path: Path, *, given: dict[str, Any], defaults: dict[str, Any], sets: list[str],
                cli_knobs: dict[str, dict[str, Any]]) -> Source:
    import importlib

    doc = load(path)
    fmt = detect(doc)
    if sets and fmt != "shardwise":
        raise ShardwiseError(f"--set {sets[0]}: --set overrides a shardwise training YAML; {path} is a "
                             f"{FORMAT_NAMES[fmt]}: override its values with plan's flags")
    ctx = Context(given=given, defaults=defaults, sets=list(sets), cli_knobs=cli_knobs)
    module = importlib.import_module("shardwise.ingest." + {'shardwise': 'shardwise_yaml'}.get(fmt, fmt))
    return module.read(doc, ctx)
