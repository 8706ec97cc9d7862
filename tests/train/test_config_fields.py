"""Every number of the training YAML is checked when the config is validated, before any rank
starts: a boolean, a float or a string is not a count, NaN and ±Inf are not numbers a run can
use, seeds lie in the range every RNG a rank seeds accepts, the learning rate, the betas and the
timeout lie in the ranges the optimizer and the process group accept, a `--set` key has no empty
part and a path field is not blank. Each refusal is a ShardwiseError naming the field (and the
`--set` or YAML line) that the CLI turns into exit 2 without a traceback."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from shardwise.config.fields import MAX_COUNT, SEED_RANGE
from shardwise.config.load import load_config
from shardwise.config.schema import MAX_LR, MAX_TIMEOUT_S, MIN_TIMEOUT_S, TrainConfig
from shardwise.errors import ShardwiseError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"


def refused(*sets: str) -> str:
    with pytest.raises(ShardwiseError) as e:
        load_config(CONFIG, list(sets))
    return " ".join(str(e.value).split())


# ---------------------------------------------------------------- the cases a probe found


@pytest.mark.parametrize(("setting", "fragments"), [
    ("optimizer.betas=[1.5, -1]", ["'optimizer.betas.0' = 1.5", "'optimizer.betas.1' = -1", "at least 0 and below 1",
                                   "torch.optim.AdamW's range"]),
    ("run.seed=-5", ["'run.seed' = -5", f"from 0 to {SEED_RANGE[1]}", "numpy's seed range"]),
    ("run.seed=100000000000000000000000", ["'run.seed' = 100000000000000000000000", f"from 0 to {SEED_RANGE[1]}"]),
    ("run.seed=1.0e+23", ["'run.seed' = 1e+23", "valid integer"]),
    ("optimizer.lr=1e300", ["'optimizer.lr' = '1e300'", f"above 0 and at most {MAX_LR:g}", "AdamW moves each weight"]),
    ("run.steps=true", ["'run.steps' = True", "valid integer"]),
    ("run.steps=100000000000000000000000", ["'run.steps' = 100000000000000000000000", "2**53"]),
    ("run.steps=1.0e+23", ["'run.steps' = 1e+23", "valid integer"]),
    ("run.steps=2.0", ["'run.steps' = 2.0", "valid integer"]),
    ("checkpointing.output_dir=''", ["'checkpointing.output_dir' = ''", "non-empty", "working directory"]),
    ("run.timeout_s=1e-9", ["'run.timeout_s' = '1e-9'", f"at least {MIN_TIMEOUT_S:g}", "fails healthy runs"]),
], ids=["betas", "seed_negative", "seed_1e23_int", "seed_1e23_float", "lr_1e300", "steps_true", "steps_1e23_int",
        "steps_1e23_float", "steps_float", "output_dir_empty", "timeout_1e-9"])  # fmt: skip
def test_value_the_probe_found_is_refused_naming_the_set_and_field(setting, fragments):
    msg = refused(setting)
    assert f"--set {setting}:" in msg, msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


@pytest.mark.parametrize("setting", ["run..steps=2", ".run.steps=2", "run.steps.=2", "=2", " . =2"])
def test_set_key_with_an_empty_part_is_refused(setting):
    msg = refused(setting)
    assert f"--set {setting!r}" in msg and "empty part" in msg, msg


def test_a_section_check_failing_after_a_set_names_the_set():
    """Found by tests/security/test_fuzz_run_config.py: the model section's own check (a name or
    a path) blamed the file's line when a --set inside the section had emptied the name."""
    msg = refused("model.name=")
    assert "--set model.name=: field 'model'" in msg and "give model.name" in msg, msg


def test_a_bad_value_in_the_file_names_its_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  steps: 10\noptimizer:\n  lr: 1e-4\n  betas: [0.9, 1.0]\n")
    with pytest.raises(ShardwiseError) as e:
        load_config(p)
    assert f"{p}:5: field 'optimizer.betas.1' = 1.0" in str(e.value), str(e.value)


def test_the_edges_of_each_range_are_accepted():
    cfg = load_config(CONFIG, ["run.seed=0", "data.synthetic.seed=4294967295", "optimizer.betas=[0, 0.999999]",
                               f"optimizer.lr={MAX_LR}", "run.timeout_s=1", f"run.steps={MAX_COUNT}",
                               "optimizer.lr=1e-4", "checkpointing.output_dir=."])  # fmt: skip
    assert (cfg.run.seed, cfg.data.synthetic.seed, cfg.optimizer.betas) == (0, 2**32 - 1, (0.0, 0.999999))
    assert (cfg.optimizer.lr, cfg.run.timeout_s, cfg.run.steps) == (1e-4, 1.0, 2**53)
    assert cfg.checkpointing.output_dir == "."
    assert load_config(CONFIG, [f"run.timeout_s={MAX_TIMEOUT_S}"]).run.timeout_s == 7 * 24 * 3600


# ---------------------------------------------------------------- every numeric field of the schema


def _kind(annotation) -> str | None:
    """'int' or 'float' for a numeric field (optional or not), None for anything else (a union
    with str, like export.max_shard_size, has its own parser)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] \
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) else [annotation]  # fmt: skip
    if len(args) != 1:
        return None
    base = args[0]
    while typing.get_origin(base) is typing.Annotated:
        base = typing.get_args(base)[0]
    return {int: "int", float: "float"}.get(base)


def _sections(model: type[BaseModel], prefix: tuple[str, ...] = ()):
    for name, f in model.model_fields.items():
        ann = f.annotation
        inner = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else (inner[0] if inner else None)
        if sub is not None:
            yield from _sections(sub, (*prefix, name))
        elif _kind(ann):
            yield ".".join((*prefix, name)), _kind(ann)


NUMERIC = sorted(_sections(TrainConfig))
# YAML spellings of values no numeric field may take, by kind
BAD = {"int": ["true", "false", "2.5", "3.0", "'7'", ".nan", str(2**64)],
       "float": ["true", ".nan", ".inf", "-.inf", "1.0e+400"]}


def test_the_audit_sees_every_section():
    seen = {n.rsplit(".", 1)[0] for n, _ in NUMERIC}
    assert {"run", "optimizer", "schedule", "checkpointing", "lora", "loss", "hardware", "logging", "data.sft",
            "data.synthetic", "strategy", "strategy.deepspeed", "strategy.ddp"} <= seen, seen  # fmt: skip
    assert len(NUMERIC) >= 35, NUMERIC


@pytest.mark.parametrize(("field", "kind"), NUMERIC, ids=[n for n, _ in NUMERIC])
def test_every_numeric_field_refuses_what_is_not_its_kind(field, kind):
    """A boolean, NaN, ±Inf, a float or string as a count, a count beyond 2**53: each one error
    naming the field and the --set, never accepted and never another exception."""
    for value in BAD[kind]:
        msg = refused(f"{field}={value}")
        assert f"field '{field}'" in msg and f"--set {field}={value}:" in msg, (value, msg)


def test_floats_of_the_schema_are_finite_and_counts_are_exact():
    """What the schema hands the ranks: every default is of its kind (a float finite)."""
    cfg = TrainConfig(lora={})
    for field, kind in NUMERIC:
        value = cfg
        for part in field.split("."):
            value = getattr(value, part)
        if value is None:
            continue
        assert isinstance(value, int if kind == "int" else float) and not isinstance(value, bool), (field, value)
        assert kind == "int" or math.isfinite(value), (field, value)


# ---------------------------------------------------------------- as the user runs it


@pytest.mark.parametrize(("setting", "fragment"), [
    ("optimizer.betas=[1.5, -1]", "field 'optimizer.betas.0' = 1.5"),
    ("run.seed=-5", "field 'run.seed' = -5"),
    ("checkpointing.output_dir=''", "field 'checkpointing.output_dir' = ''"),
], ids=["betas", "seed", "output_dir"])  # fmt: skip
def test_cli_refuses_before_any_rank_starts(tmp_path, setting, fragment):
    """`shardwise train` with the probe's values: exit 2, the field named, no traceback, and
    nothing written (the working directory, where output_dir '' would write, stays empty)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    sets = [] if setting.startswith("checkpointing.output_dir") else [f"checkpointing.output_dir={tmp_path / 'out'}"]
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG)]
    for s in (*sets, "logging.trackers=[]", setting):
        argv += ["--set", s]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, env=env, check=False)
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and f"--set {setting}: {fragment}" in msg, r.stderr[-3000:]
    assert not (tmp_path / "out").exists() and not any(cwd.iterdir()), "a rank started (it wrote outputs)"
