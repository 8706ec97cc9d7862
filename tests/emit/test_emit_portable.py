"""`plan --emit` writes what was planned, portably: a config.json from any
directory, the model named from its config, no emitted file naming the directory it was written
to (the directory moved, then launched through fake `scontrol`/`srun`/`accelerate`), the planned
AdamW in the HF Trainer command (parsed by transformers' own argument parser), the loss the plan
assumed named in the table, `--accounting` in the recommendation, and "Nothing fits" exit 3."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from shardwise.catalog import build_hardware
from shardwise.cli.app import NOTHING_FITS_EXIT, app
from shardwise.config.schema import LossSection, TrainConfig
from shardwise.emit import emitted_run
from shardwise.specs import ModelSpec, Strategy, TrainSpec

runner = CliRunner()

# TinyLlama-1.1B's config.json as transformers saves it (hub id in _name_or_path)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 22,
        "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "_name_or_path": "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "torch_dtype": "bfloat16"}


def _config_dir(root: Path, dirname: str, doc: dict) -> Path:
    d = root / dirname
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(doc))
    return d / "config.json"


def _plan(*args):
    return runner.invoke(app, ["plan", *args])


def _emit(tmp_path: Path, cfg: Path, out: Path, *extra) -> None:
    res = _plan("--model-config", str(cfg), "--gpus", "2", "--emit", str(out), *extra)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("dirname", ["my-finetune-v3", "llama-2-7b"])
def test_model_config_from_any_directory_emits_the_planned_model(tmp_path, dirname):
    # a directory not named like a catalog model was refused (the bridge read back
    # "/path/to/<dir>"); one named like a catalog model was read back as that catalog model
    cfg = _config_dir(tmp_path, dirname, TINY)
    out = tmp_path / "out"
    _emit(tmp_path, cfg, out, "--emit-strategy", "zero2")
    readme = (out / "README.md").read_text()
    assert "TinyLlama-1.1B-intermediate-step-1431k-3T" in readme and dirname not in readme
    planned = ModelSpec.from_hf_config(cfg)
    run, _ = emitted_run(planned, build_hardware(gpus=2), TrainSpec(), Strategy.from_name("zero2"))
    assert run.model == planned  # the config.json's spec, not llama-2-7b's
    # the README's memory is the plan's, for that model
    doc = json.loads(_plan("--json", "--model-config", str(cfg), "--gpus", "2", "-s", "zero2").output)
    total = doc["strategies"][0]["memory"]["total"] / 2**30
    assert f"{total:,.2f} GiB" in readme


def test_model_named_from_its_config_not_its_directory(tmp_path):
    named = ModelSpec.from_hf_config(_config_dir(tmp_path, "checkpoint-500", TINY))
    assert named.name == "TinyLlama-1.1B-intermediate-step-1431k-3T"
    # a local path in _name_or_path names nothing: the family and size (Ψ = 1.10e9) do
    local = dict(TINY, _name_or_path="/home/me/ckpt/checkpoint-500")
    spec = ModelSpec.from_hf_config(_config_dir(tmp_path, "a", local))
    assert spec.name == f"llama-{spec.params / 1e9:.3g}b" == "llama-1.1b"
    bare = {k: v for k, v in TINY.items() if k != "_name_or_path"}
    assert ModelSpec.from_hf_config(_config_dir(tmp_path, "b", bare)).name == "llama-1.1b"


def _all_text(out: Path) -> str:
    return "\n".join(p.read_text() for p in out.iterdir() if p.is_file())


def _fake_bin(d: Path, name: str, body: str) -> None:
    d.mkdir(exist_ok=True)
    (d / name).write_text("#!/usr/bin/env bash\n" + body)
    (d / name).chmod(0o755)


def test_emitted_files_name_no_absolute_path_and_run_after_a_move(tmp_path):
    emitted = tmp_path / "first" / "emit"
    _emit(tmp_path, _config_dir(tmp_path, "m", TINY), emitted, "--emit-strategy", "zero3")
    text = _all_text(emitted)
    assert str(emitted) not in text and str(emitted.resolve()) not in text and str(tmp_path) not in text
    moved = tmp_path / "elsewhere" / "run1"
    moved.parent.mkdir()
    shutil.move(emitted, moved)

    # sbatch runs a spooled copy: the script finds the directory it was submitted from
    bin_dir, log = tmp_path / "bin", tmp_path / "srun.args"
    _fake_bin(bin_dir, "scontrol", f"""case "$1 $2" in
  "show job") echo "JobId=7 JobName=x"; echo "   Command={moved}/slurm.sbatch" ;;
  "show hostnames") echo node001 ;;
esac
""")
    _fake_bin(bin_dir, "srun", f'printf "%s\\n" "$@" > {log}\n')
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(moved / "slurm.sbatch", spool / "slurm_script")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node001",
           "SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": str(tmp_path)}
    r = subprocess.run(["bash", str(spool / "slurm_script")], cwd=spool, env=env, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert f"{moved}/shardwise.yaml" in log.read_text().splitlines()
    # a directory without shardwise.yaml is refused by name, not launched
    env["EMIT_DIR"] = str(spool)
    r = subprocess.run(["bash", str(spool / "slurm_script")], cwd=spool, env=env, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2 and f"no shardwise.yaml in {spool}" in r.stderr

    # accelerate launch from any directory gets the JSON beside the script
    alog = tmp_path / "accelerate.args"
    _fake_bin(bin_dir, "accelerate", f'printf "%s\\n" "$@" > {alog}\n')
    r = subprocess.run(["bash", str(moved / "launch_accelerate.sh")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr
    args = alog.read_text().splitlines()
    ds = Path(args[args.index("--deepspeed_config_file") + 1])
    assert ds == moved / "ds_config_hf.json" and ds.is_file()
    assert args[args.index("--config_file") + 1] == f"{moved}/accelerate.yaml"


def _trainer_command(readme: str) -> list[str]:
    block = readme.split("## Hugging Face Trainer", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def test_hf_trainer_command_carries_the_planned_optimizer(tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    out = tmp_path / "out"
    res = _plan("--emit", str(out), "--emit-strategy", "zero2", "--weight-decay", "0.1")
    assert res.exit_code == 0, res.output
    cmd = _trainer_command((out / "README.md").read_text())
    assert cmd[0] == "deepspeed" and "--bf16" in cmd
    script = cmd.index("train_sft.py")
    args = [a for a in cmd[script + 1:] if a != "--bf16"]  # bf16 needs a GPU to construct
    i = args.index("--deepspeed")
    del args[i:i + 2]  # the file is read relative to the run's directory
    parsed, = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args)
    opt = TrainConfig().optimizer
    # Trainer's own defaults are (0.9, 0.999) and no decay: the planned AdamW must be passed
    assert (parsed.adam_beta1, parsed.adam_beta2) == opt.betas == (0.9, 0.95)
    assert parsed.adam_epsilon == opt.eps and parsed.weight_decay == 0.1
    assert parsed.learning_rate == opt.lr and parsed.max_grad_norm == opt.max_grad_norm
    run = TrainConfig().run  # a bare plan plans the schema's batch
    assert parsed.per_device_train_batch_size == run.micro_batch and parsed.gradient_accumulation_steps == run.grad_accum
    assert parsed.lr_scheduler_type.value == "linear"  # the emitted schedule: warmup_decay


def test_the_table_names_the_loss_it_assumed():
    assert LossSection().implementation == "chunked"  # the schema's default, which a bare plan plans
    flat = " ".join(_plan("--cross-entropy", "standard").output.split())
    assert "loss standard (shardwise train's default is chunked: plan it with --cross-entropy chunked)" in flat
    flat = " ".join(_plan().output.split())
    assert "loss chunked (1024 tokens a chunk)" in flat and "default is chunked" not in flat


def _rec(*args) -> dict:
    res = _plan("--json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.mark.parametrize("accounting", ["paper", "deepspeed"])
def test_accounting_changes_the_recommendations_numbers(accounting):
    engine, other = _rec("-s", "zero2"), _rec("-s", "zero2", "--accounting", accounting)
    rec = other["recommended_setting"]
    assert rec["memory_total"] != engine["recommended_setting"]["memory_total"]
    # the recommendation's memory is its table row under the same accounting
    row = _rec("-s", "zero2", "--accounting", accounting, "--micro-batch", str(rec["micro_batch"]),
               "--grad-accum", str(rec["grad_accum"]), "--checkpointing", rec["checkpointing"])
    assert row["strategies"][0]["memory"]["total"] == pytest.approx(rec["memory_total"])
    reason = other["reason"]
    assert f"{rec['memory_total'] / 2**30:.1f} of" in reason


def test_nothing_fits_exits_non_zero_with_the_plan_printed():
    args = ["-m", "llama-2-70b", "--gpu", "rtx-4090", "-s", "zero1", "-s", "zero2"]
    res = _plan(*args)
    assert res.exit_code == NOTHING_FITS_EXIT == 3
    assert "Nothing fits" in res.output and "zero2" in res.output
    res = _plan("--json", *args)
    assert res.exit_code == 3
    doc = json.loads(res.output)
    assert doc["recommended"] is None and re.search(r"no configuration of llama-2-70b", doc["reason"])
    assert _plan().exit_code == 0
