"""The hostile-input tests' helpers: the user's commands as subprocesses, and short runs trained
once per test session (pytest-xdist workers share them through a file lock; the `trained`
fixture in conftest.py) that each test copies before tampering with."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = {"fsdp-demo": (REPO / "examples" / "demo.yaml", ()),  # the README's demo: fsdp, SFT data
        "zero3-lora": (REPO / "examples" / "lora-demo.yaml", ("lora.save_merged=false",))}


def cli(*args: str, cwd: Path, module: str = "shardwise.train.cli", timeout: float = 300):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, input="y\ny\n")


def train_args(config: Path, out: Path, *extra: str) -> list[str]:
    sets = [f"checkpointing.output_dir={out}", "run.steps=4", "checkpointing.save_every_steps=4",
            "checkpointing.save_final=false", "logging.progress=false", "run.timeout_s=120", *extra]
    return [str(config), "--nproc", "2", *[a for s in sets for a in ("--set", s)]]


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst
