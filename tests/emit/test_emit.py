"""`shardwise plan --emit`: every emitted file is accepted by the tool that will read it.

DeepSpeed JSON -> `deepspeed.runtime.config.DeepSpeedConfig` (the HF "auto" file first goes
through transformers' `HfTrainerDeepSpeedConfig`, as HF Trainer does: DeepSpeed itself refuses
"auto"); accelerate YAML -> accelerate's loader, its launcher's argument processing and the
DeepSpeed/FSDP plugin built from the launcher's environment; shardwise.yaml -> the trainer's
`load_config`; scripts -> `bash -n`.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path
from unittest import mock

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before any deepspeed import: no CUDA here

from shardwise.catalog import build_hardware, get_model
from shardwise.config.load import load_config
from shardwise.config.schema import TrainConfig
from shardwise.config.strategy import STRATEGY_NAMES
from shardwise.emit import accelerate_config, emit_configs, emitted_run
from shardwise.errors import ShardwiseError
from shardwise.run import deepspeed_config, run_spec
from shardwise.specs import Strategy, TrainSpec

TRAIN = TrainSpec(seq_len=2048, micro_batch=2, grad_accum=4, checkpointing="full")
HYPER = TrainConfig()  # emitted configs carry the trainer's default optimizer values and steps
# What a user does before training an emitted shardwise.yaml: fill its two placeholders (here:
# the catalog architecture from random weights, on some data file).
FILLED = ["model.path=", "data.sft.train_files=[train.jsonl]"]


def hardware(name: str):
    # fsdp-hybrid needs more than one node to have something to replicate across.
    return build_hardware(gpus=16, gpus_per_node=8) if name == "fsdp-hybrid" else build_hardware(gpus=8)


def ds_config_obj(cfg: dict, world: int, monkeypatch):
    """DeepSpeedConfig as a rank of a `world`-rank job sees it.

    Without a process group DeepSpeedConfig takes world size 1 and its batch assertion
    (train = micro × accumulation × world) would test nothing; a stub `dist` gives it the
    planned world size without starting `world` processes.
    """
    import deepspeed.runtime.config as dsc

    monkeypatch.setattr(dsc, "dist", types.SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda *a: world))
    return dsc.DeepSpeedConfig(cfg)


def hf_fill(cfg: dict, world: int, hidden: int) -> dict:
    """Fill "auto" exactly as HF Trainer does, with TrainingArguments equal to the plan."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    o = HYPER.optimizer
    args = types.SimpleNamespace(
        world_size=world, per_device_train_batch_size=TRAIN.micro_batch,
        gradient_accumulation_steps=TRAIN.grad_accum, max_grad_norm=o.max_grad_norm,
        learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        adam_epsilon=o.eps, weight_decay=o.weight_decay, save_on_each_node=False,
        fp16=TRAIN.compute_dtype == "fp16", fp16_full_eval=False, bf16=TRAIN.compute_dtype == "bf16",
        bf16_full_eval=False, get_warmup_steps=lambda n: HYPER.schedule.warmup_steps,
    )
    hf = HfTrainerDeepSpeedConfig(cfg)
    try:  # it registers itself globally (zero3 detection): never leak it into other tests
        hf.trainer_config_process(args)
        model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden))
        hf.trainer_config_finalize(args, model, HYPER.run.steps)  # raises on any mismatch
        return hf.config
    finally:
        unset_hf_deepspeed_config()


def accelerate_env(path: Path, extra: list[str] = ()) -> tuple[types.SimpleNamespace, dict[str, str]]:
    """The environment `accelerate launch --config_file path` would give the training processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), *extra, "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # what launch_command adds before deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_emitted_files_load_in_their_tools(name, tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    model, hw, strategy = get_model("llama-2-7b"), hardware(name), Strategy.from_name(name)
    paths = emit_configs(model, hw, TRAIN, strategy, tmp_path)
    names = {p.name for p in paths}
    ds = strategy.engine == "deepspeed"
    expected = {"shardwise.yaml", "accelerate.yaml", "launch_torchrun.sh", "launch_accelerate.sh",
                "slurm.sbatch", "README.md"}  # fmt: skip
    assert names == expected | ({"ds_config.json", "ds_config_hf.json", "launch_deepspeed.sh"} if ds else set())

    # DeepSpeed: concrete file as is; HF file after Trainer's fill, which must give the same config.
    if ds:
        concrete = json.loads((tmp_path / "ds_config.json").read_text())
        c = ds_config_obj(concrete, hw.world_size, monkeypatch)
        assert c.zero_optimization_stage == strategy.zero_stage
        assert c.train_batch_size == TRAIN.micro_batch * TRAIN.grad_accum * hw.world_size
        assert c.gradient_clipping == HYPER.optimizer.max_grad_norm
        assert c.bfloat16_config.enabled and not c.float16_config.enabled
        off_opt, off_par = c.zero_config.offload_optimizer, c.zero_config.offload_param
        assert (off_opt is not None and off_opt.pin_memory) == strategy.offload_optimizer
        assert (off_par is not None and off_par.pin_memory) == strategy.offload_params
        assert c.zero_config.reduce_bucket_size == strategy.ds.reduce_bucket_size
        filled = hf_fill(json.loads((tmp_path / "ds_config_hf.json").read_text()), hw.world_size, model.hidden_size)
        assert filled == concrete
        ds_config_obj(filled, hw.world_size, monkeypatch)

    # accelerate: its loader, then its launcher's processing, then the plugin the processes build.
    acc = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert acc.num_processes == hw.world_size and acc.num_machines == hw.nodes
    # what launch_accelerate.sh passes: precision, and the JSON beside the script (accelerate.yaml
    # names it relative to the launch directory: no emitted file carries the emit directory)
    extra = ["--mixed_precision", "bf16", "--deepspeed_config_file", str(tmp_path / "ds_config_hf.json")] if ds else []
    if ds:
        assert acc.deepspeed_config["deepspeed_config_file"] == "ds_config_hf.json"
        assert '--deepspeed_config_file "$HERE/ds_config_hf.json"' in (tmp_path / "launch_accelerate.sh").read_text()
    args, env = accelerate_env(tmp_path / "accelerate.yaml", extra)
    assert args.num_processes == hw.world_size
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with mock.patch.dict(os.environ, env):
        if ds:
            assert acc.distributed_type.value == "DEEPSPEED"
            plugin = DeepSpeedPlugin()  # refuses settings that conflict with the JSON file
            assert plugin.hf_ds_config.config["zero_optimization"]["stage"] == strategy.zero_stage
            assert acc.deepspeed_config["zero3_init_flag"] == (strategy.zero_stage == 3)
        elif strategy.engine == "fsdp2":
            assert acc.distributed_type.value == "FSDP" and acc.fsdp_config["fsdp_version"] == 2
            fsdp = FullyShardedDataParallelPlugin()
            assert fsdp.fsdp_version == 2
            assert fsdp.reshard_after_forward == (strategy.resharding != "none")
            assert fsdp.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
            assert fsdp.activation_checkpointing
            # FSDP2: the base OffloadPolicy means "keep on GPU", its CPUOffloadPolicy subclass offloads.
            assert (type(fsdp.cpu_offload).__name__ == "CPUOffloadPolicy") == strategy.offload_params
            if name == "fsdp-hybrid":
                assert env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"
                assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == "8"
        else:
            assert acc.distributed_type.value == "MULTI_GPU" and args.multi_gpu

    # shardwise's own trainer config: refused until its placeholders are filled, then the plan's.
    with pytest.raises(ShardwiseError, match=r"shardwise.yaml:\d+: field 'model.path'(.|\n)*'data.sft.train_files'"):
        load_config(tmp_path / "shardwise.yaml")
    cfg = load_config(tmp_path / "shardwise.yaml", FILLED)
    assert cfg.strategy.name == name and cfg.precision == "bf16-mixed"
    assert (cfg.run.micro_batch, cfg.run.grad_accum, cfg.run.nproc) == (2, 4, hw.gpus_per_node)
    assert cfg.checkpointing.activation == "full" and cfg.model.name == "llama-2-7b"
    # the planned layout, read back through the bridge (hybrid: a node of 8 per shard group)
    lay = run_spec(cfg, hw.world_size, "cuda", environ={}).layout
    assert (lay.dp_shard, lay.dp_replicate) == ((8, 2) if name == "fsdp-hybrid" else
                                                (1, 8) if not strategy.shards_optimizer else (8, 1))

    for script in names - {"shardwise.yaml", "accelerate.yaml", "README.md"} - {n for n in names if "json" in n}:
        r = subprocess.run(["bash", "-n", str(tmp_path / script)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"{script}: {r.stderr}"
        assert "-m shardwise.train.cli" in (tmp_path / script).read_text() or "--module shardwise.train.cli" in (
            tmp_path / script
        ).read_text()
    readme = (tmp_path / "README.md").read_text()
    assert "GiB" in readme and ("--deepspeed ds_config_hf.json" in readme) == ds


@pytest.mark.parametrize(("model_name", "layer"), [
    ("qwen2.5-7b", "Qwen2DecoderLayer"), ("mistral-7b", "MistralDecoderLayer"),
    ("mixtral-8x7b", "MixtralDecoderLayer"),
])  # fmt: skip
def test_fsdp_wraps_the_family_decoder_layer(model_name, layer):
    cfg = accelerate_config(get_model(model_name), build_hardware(gpus=8), TRAIN, Strategy.from_name("fsdp"))
    assert cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == layer


def test_fp16_and_unsupported_plan_settings_are_mapped_and_noted(tmp_path):
    train = TrainSpec(precision="fp16-mixed", checkpointing="selective", attention="flash", optimizer="sgd")
    hw, s = build_hardware(gpus=8), Strategy.from_name("zero2")
    ds = deepspeed_config(emitted_run(get_model("llama-2-7b"), hw, train, s)[0])
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"] and ds["fp16"]["loss_scale"] == 0
    emit_configs(get_model("llama-2-7b"), hw, train, s, tmp_path)
    cfg = load_config(tmp_path / "shardwise.yaml", FILLED)
    assert (cfg.precision, cfg.checkpointing.activation, cfg.model.attention) == ("fp16-mixed", "full", "sdpa")
    text = (tmp_path / "shardwise.yaml").read_text()
    assert "selective" in text and "'sgd'" in text and "flash" in text  # the NOTE header lines
    assert accelerate_env(tmp_path / "accelerate.yaml", ["--mixed_precision", "fp16"])[1][
        "ACCELERATE_MIXED_PRECISION"] == "fp16"  # fmt: skip


def test_emission_refuses_what_it_cannot_express(tmp_path):
    hw = build_hardware(gpus=8)
    with pytest.raises(ShardwiseError, match=r"data parallelism, and tensor parallelism with FSDP2.*plan-only, run it with Megatron-DeepSpeed"):
        emit_configs(get_model("llama-2-7b"), hw, TRAIN, Strategy.from_name("zero3", tp=2), tmp_path)
    with pytest.raises(ShardwiseError, match="run it with torchtitan"):  # FSDP2 stages run without offload only
        emit_configs(get_model("llama-2-7b"), hw, TRAIN, Strategy.from_name("fsdp+offload", pp=2), tmp_path)
    with pytest.raises(ShardwiseError, match=r"run it with DeepSpeed's pipeline engine"):
        accelerate_config(get_model("llama-2-7b"), hw, TRAIN, Strategy.from_name("zero1", pp=2))
    with pytest.raises(ShardwiseError, match=r"no accelerate config for fsdp with tp 1, pp 2"):  # shardwise train's
        accelerate_config(get_model("llama-2-7b"), hw, TRAIN, Strategy.from_name("fsdp", pp=2))
    with pytest.raises(ShardwiseError, match="not DeepSpeed"):
        deepspeed_config(emitted_run(get_model("llama-2-7b"), hw, TRAIN, Strategy.from_name("fsdp"))[0])
