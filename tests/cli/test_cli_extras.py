"""A planner-only install.

`pip install -e .` installs the planner (pydantic, typer, rich, PyYAML). Its `train`, `bench`,
`export`, `calibrate` and `data` used to answer with a 63-line ModuleNotFoundError traceback;
now each is one message naming the extra to install, exit 2. Nothing is uninstalled here: the
CLI runs in a subprocess whose import system refuses torch and the other packages of the
`train` extra, the way a missing package is refused.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# The packages of the `train` extra, as import names.
BLOCKED = ("torch", "transformers", "deepspeed", "datasets", "safetensors", "tokenizers", "peft", "accelerate",
           "matplotlib", "tensorboard", "pyarrow", "bitsandbytes")  # fmt: skip
BLOCKER = '''
import importlib.abc, importlib.machinery, sys

BLOCKED = set({blocked!r})
MODE = {mode!r}


class NotInstalled(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """As if the train extra were not installed. "find": the finder refuses the name, as the
    import system does for a package that is absent; "load": the package is found but its
    import fails, as a package half-removed would."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in BLOCKED:
            return None
        if MODE == "find":
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ModuleNotFoundError(f"No module named {{module.__name__!r}}", name=module.__name__)


sys.meta_path.insert(0, NotInstalled())
sys.argv = ["shardwise", *{args!r}]
from shardwise.cli.app import main

main()
'''


def planner_only(args: list[str], tmp_path: Path, mode: str = "find") -> subprocess.CompletedProcess:
    code = BLOCKER.format(blocked=BLOCKED, mode=mode, args=args)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path, env=env)  # fmt: skip


def train_config(tmp_path: Path) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "some words to learn"}) + "\n")
    raw = {"model": {"name": "tiny-llama"}, "precision": "fp32",
           "data": {"kind": "sft", "sft": {"train_files": [str(data)], "max_length": 32}},
           "run": {"device": "cpu", "steps": 1, "nproc": 1}, "checkpointing": {"output_dir": str(tmp_path / "out")}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def verb_args(verb: str, tmp_path: Path) -> list[str]:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "some words"}) + "\n")
    return {"train": ["train", str(train_config(tmp_path))], "bench": ["bench", str(train_config(tmp_path))],
            "export": ["export", str(tmp_path / "out"), str(tmp_path / "exported")],
            "calibrate": ["calibrate", "--quick", "--out", str(tmp_path / "profile.json")],
            "data": ["data", "inspect", str(data)]}[verb]  # fmt: skip


def assert_names_the_extra(r: subprocess.CompletedProcess, verb: str) -> None:
    err = r.stdout + r.stderr
    assert r.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "ModuleNotFoundError" not in err, err[-3000:]
    assert "pip install 'shardwise[train]'" in err and f"shardwise {verb}" in err, err
    assert len(r.stderr.strip().splitlines()) <= 3, r.stderr  # one message, not a traceback


def test_train_extra_is_what_pyproject_names():
    """The message's extra exists and installs torch, transformers and deepspeed."""
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; the project supports 3.10)
    block = re.search(r"^train = \[(.*?)^\]", text, re.S | re.M).group(1)
    names = set(re.findall(r'^\s*"([A-Za-z0-9_-]+)', block, re.M))
    assert {"torch", "transformers", "deepspeed", "datasets", "tokenizers", "peft"} <= names
    from shardwise.cli.app import EXTRA_OF, NEEDS

    assert {m for need in NEEDS.values() for m in need} <= set(EXTRA_OF) and EXTRA_OF["bitsandbytes"] == "qlora"


@pytest.mark.parametrize("verb", ["train", "bench", "export", "calibrate", "data"])
def test_a_planner_only_install_names_the_extra_for_each_verb(tmp_path, verb):
    r = planner_only(verb_args(verb, tmp_path), tmp_path)
    assert_names_the_extra(r, verb)
    assert not (tmp_path / "out").exists()  # refused before the command did anything


@pytest.mark.parametrize("verb", ["train", "calibrate", "data"])
def test_an_import_failing_inside_the_command_is_the_same_message(tmp_path, verb):
    """The package is found but does not import (the up-front check passes): the command's own
    import of it fails, and the answer is still one message, exit 2."""
    r = planner_only(verb_args(verb, tmp_path), tmp_path, mode="load")
    assert_names_the_extra(r, verb)


def test_plan_and_help_still_work_without_the_extra(tmp_path):
    r = planner_only(["plan", "-m", "tiny-llama", "--gpus", "2", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["recommended"]
    r = planner_only(["train", "--help"], tmp_path)
    assert r.returncode == 0 and "YAML config" in r.stdout, r.stderr[-3000:]
