"""Config validation, overrides and the pre-launch checks: each bad input is one clear error
naming the file/line, the field, the value and what is accepted — before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.config.load import apply_override, load_config
from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.train.preflight import preflight

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_invalid_enum_value_names_file_line_field_value_and_choices(tmp_path):
    p = write(tmp_path, "model:\n  name: tiny-llama\nprecision: bf17\n")
    with pytest.raises(ShardwiseError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:3" in msg and "'precision'" in msg and "'bf17'" in msg
    assert "fp32" in msg and "bf16-mixed" in msg


def test_unknown_strategy_suggests_the_closest(tmp_path):
    p = write(tmp_path, "strategy:\n  name: zero4\n")
    with pytest.raises(ShardwiseError, match=r"cfg.yaml:2.*strategy.name.*zero4.*Did you mean 'zero[0-3]'"):
        load_config(p)


def test_unknown_field_is_refused_with_suggestion(tmp_path):
    p = write(tmp_path, "optimizer:\n  learning_rate: 0.1\n")
    with pytest.raises(
        ShardwiseError, match=r"cfg.yaml:2: unknown field 'optimizer.learning_rate'. Valid choices: .*\blr\b"
    ):
        load_config(p)


def test_set_overrides_are_typed_and_validated(tmp_path):
    p = write(tmp_path, "strategy:\n  name: fsdp\n")
    cfg = load_config(
        p, ["strategy.name=zero3", "optimizer.lr=3e-4", "run.steps=7", "logging.trackers=[wandb, mlflow]"]
    )
    assert (cfg.strategy.name, cfg.optimizer.lr, cfg.run.steps, cfg.logging.trackers) == (
        "zero3",
        3e-4,
        7,
        ["wandb", "mlflow"],
    )
    with pytest.raises(ShardwiseError, match=r"run\.steps"):
        load_config(p, ["run.steps=-1"])
    with pytest.raises(ShardwiseError, match="KEY=VALUE"):
        apply_override({}, "run.steps")


def test_strategy_the_world_size_cannot_support():
    cfg = TrainConfig.model_validate(
        {"strategy": {"name": "fsdp-hybrid", "shard_group": 4}, "data": {"kind": "synthetic"}}
    )
    with pytest.raises(ShardwiseError, match=r"fsdp-hybrid.*cannot run on 2 rank"):
        preflight(cfg, world_size=2, device="cpu")


def test_missing_data_file():
    cfg = TrainConfig.model_validate({"data": {"sft": {"train_files": ["/nonexistent/train.jsonl"]}}})
    with pytest.raises(ShardwiseError, match=r"train_files.*/nonexistent/train.jsonl.*not found"):
        preflight(cfg, world_size=1, device="cpu")


def test_model_path_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    cfg = TrainConfig.model_validate({"model": {"path": str(tmp_path)}, "data": {"kind": "synthetic"}})
    with pytest.raises(
        ShardwiseError, match=r"model.path .* has no weights .*model.safetensors.*random_init"
    ):
        preflight(cfg, world_size=1, device="cpu")


def test_remote_code_refused_unless_asked(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}})
    )
    (tmp_path / "model.safetensors").write_bytes(b"")
    cfg = TrainConfig.model_validate({"model": {"path": str(tmp_path)}, "data": {"kind": "synthetic"}})
    with pytest.raises(ShardwiseError, match="trust_remote_code"):
        preflight(cfg, world_size=1, device="cpu")


def test_memory_check_refuses_with_numbers_and_nearest_fit(tmp_path, monkeypatch, disk_free, host_memory):
    monkeypatch.chdir(tmp_path)  # the passing preflights create the default output_dir (runs/shardwise)
    disk_free(1 << 50)  # their 7B checkpoint needs ~75 GiB; the space check has its own tests (test_outputs.py)
    host_memory(1 << 50)  # 8 ranks building a random 7B in fp32 need 205 GiB of host (test_host_memory_check.py)
    cfg = TrainConfig.model_validate(
        {
            "model": {"name": "llama-2-7b"},
            "strategy": {"name": "ddp"},
            # unpacked: the bundled sample's 400 records fill a global batch of 64 on 8 ranks (packed
            # into 5 rows of 4096 they could not feed 8 ranks: preflight refuses that too)
            "data": {"sft": {"max_length": 4096, "packing": False}},
            "run": {"micro_batch": 8},
        }
    )
    with pytest.raises(
        ShardwiseError, match=r"predicted not to fit.*GiB per GPU.*Nearest that fits: --set .*--force"
    ):
        preflight(cfg, world_size=8, device="cuda")
    assert preflight(cfg, world_size=8, device="cuda", force=True)[1].fits is False
    assert preflight(cfg, world_size=8, device="cpu")[1].fits is False  # CPU runs: check off by default


def _example_data(path: Path, tmp_path: Path) -> list[str]:
    """The overrides an example's header says to run it with: the GPU example trains the user's data
    (`--set data.sft.train_files=...`); the bundled sample packs into 5 rows of 4096 tokens, too few
    for its 8 ranks. Here: 64 long records, one packed row each."""
    if "data.sft.train_files" not in path.read_text():
        return []
    words = " ".join(f"word{i % 97}" for i in range(2500))
    records = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                             {"role": "assistant", "content": words}]} for i in range(64)]  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [f"data.sft.train_files=[{data}]"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_shipped_examples_validate(path, monkeypatch, tmp_path, disk_free):
    monkeypatch.chdir(tmp_path)  # preflight builds the data cache under the example's relative output_dir
    # a GPU example is planned for its GPUs; this machine has none (preflight would say so)
    monkeypatch.setattr("shardwise.train.preflight.cuda_device_count", lambda: 8)
    # nor the disk for an 8B checkpoint (~96 GB; faked: tests/conftest.py): the space check has its own tests
    disk_free(1 << 50)
    cfg = load_config(path, _example_data(path, tmp_path))
    _, check = preflight(
        cfg,
        world_size=cfg.run.nproc,
        device=cfg.run.device if cfg.run.device != "auto" else "cpu",
        force=True,
    )
    assert check.planned_bytes > 0  # the planner sized it
    assert check.fits or cfg.run.device == "cpu", f"{path.name} is predicted not to fit its own GPU"


def test_cli_bad_config_fails_before_any_rank(tmp_path):
    """The CLI prints one error and exits 2; no rank is spawned (it would print 'train')."""
    p = write(tmp_path, "strategy:\n  name: zero9\nrun:\n  nproc: 2\n")
    r = subprocess.run(
        [sys.executable, "-m", "shardwise.train.cli", str(p)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert r.returncode == 2
    assert "zero9" in r.stderr and "Traceback" not in r.stderr
