"""The exported files all have the same mode, the umask's (`model.safetensors`
was once 0600, safetensors' temp-file mode, while config.json and the rest were 0644)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.config.schema import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def umask():
    """umask(m): set this process's umask for the test (restored after)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def tiny_cfg(tmp_path: Path, **extra) -> TrainConfig:
    return TrainConfig.model_validate({"model": {"name": "tiny-llama"}, "precision": "fp32",
                                       "checkpointing": {"output_dir": str(tmp_path / "run")}, **extra})  # fmt: skip


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_exported_model_safetensors_has_the_umask_mode_like_config_json(tmp_path, umask, mask, expected):
    from shardwise.train.export.hf_dir import export_hf

    umask(mask)
    out = export_hf(tiny_cfg(tmp_path), {"model.embed_tokens.weight": torch.zeros(4, 4)}, tmp_path / "model")
    assert mode(out / "model.safetensors") == expected
    assert mode(out / "config.json") == expected
    assert mode(out) == 0o777 & ~mask  # the directory too


def test_every_exported_file_is_0644_under_umask_022(tmp_path, umask):
    """With SFT data the tokenizer is copied beside the weights: one mode for the whole directory."""
    from shardwise.train.export.hf_dir import export_hf

    out = export_hf(tiny_cfg(tmp_path), {"model.embed_tokens.weight": torch.zeros(4, 4)}, tmp_path / "model")
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in files}
    assert {p.name: oct(mode(p)) for p in files} == {p.name: oct(0o644) for p in files}


def test_exported_lora_adapter_has_the_umask_mode(tmp_path, umask):
    from shardwise.run import run_spec
    from shardwise.train.export.hf_dir import export_lora
    from shardwise.train.model.build import trainable_shapes

    umask(0o027)
    cfg = tiny_cfg(tmp_path, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    adapters = {n: torch.zeros(s) for n, s in trainable_shapes(run_spec(cfg, 1, "cpu", environ={})).items()}
    out = export_lora(cfg, adapters, tmp_path / "adapter", merged=False)
    assert mode(out / "adapter_model.safetensors") == 0o640
    assert mode(out / "adapter_config.json") == 0o640


def test_train_save_final_exports_0644_files(tmp_path):
    """The issue's reproduction: `shardwise train` with save_final, then the export's modes."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "shardwise.train.cli", str(REPO / "examples" / "fsdp-synthetic-cpu.yaml"),
            "--nproc", "1"]
    for s in (f"checkpointing.output_dir={out}", "run.steps=1", "checkpointing.save_final=true",
              "checkpointing.save_every_minutes=null", "logging.progress=false"):  # fmt: skip
        argv += ["--set", s]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, check=False,
                       preexec_fn=lambda: os.umask(0o022))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted((out / "model").iterdir())
    assert {p.name for p in files} >= {"model.safetensors", "config.json"}
    assert {p.name: oct(mode(p)) for p in files} == {p.name: oct(0o644) for p in files}
