"""The suite does not depend on the free disk of the machine that runs it (`bash .ci/run`
once failed on a machine with 70 GiB free, where two preflights of a planned
llama-2-7b run met the output-space check, 75.3 GiB). tests/conftest.py fakes 20 GiB free for
every test; these tests prove the fake is what the space check sees, that it bites (that
7B run is refused under it, so a test that forgets to ask for more fails on every machine, not
only on small ones), and that the runs the suite launches as subprocesses (which see the real
disk) need less than 20 GiB."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardwise.config.load import load_config
from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.run import run_spec
from shardwise.train.outputs import check_output_dir
from shardwise.train.preflight import check_output_space

GIB = 1 << 30
SUITE_FREE = 20 * GIB
REPO = Path(__file__).resolve().parents[1]


def test_every_test_sees_20_gib_free(tmp_path):
    assert shutil.disk_usage(tmp_path).free == SUITE_FREE
    check_output_dir(tmp_path / "out", SUITE_FREE)  # exactly enough
    with pytest.raises(ShardwiseError, match=r"has 20.00 GiB free; this run needs 20.00 GiB"):
        check_output_dir(tmp_path / "out", SUITE_FREE + 1)
    with pytest.raises(FileNotFoundError):  # a missing path still fails like the real call
        shutil.disk_usage(tmp_path / "missing")


def test_a_test_can_set_its_own_free_space(tmp_path, disk_free):
    disk_free(3 * GIB)
    assert shutil.disk_usage(tmp_path).free == 3 * GIB
    with pytest.raises(ShardwiseError, match=r"has 3.00 GiB free"):
        check_output_dir(tmp_path, 4 * GIB)


def _at(cfg: TrainConfig, out: Path) -> TrainConfig:
    return cfg.model_copy(update={"checkpointing": cfg.checkpointing.model_copy(update={"output_dir": str(out)})})


def test_the_issues_7b_preflight_is_refused_at_20_gib_and_passes_when_a_test_asks(tmp_path, disk_free):
    """What failed on the 70 GiB machine now fails (and is fixed) on every machine."""
    cfg = _at(TrainConfig.model_validate({"model": {"name": "llama-2-7b"}, "strategy": {"name": "zero2"}}),
              tmp_path / "out")
    run = run_spec(cfg, 8, "cuda", environ={})
    with pytest.raises(ShardwiseError, match=r"checkpointing.output_dir: .* has 20.00 GiB free; this run needs"):
        check_output_space(run)
    disk_free(1 << 50)  # what tests/run/test_run_bridge.py and test_train_config.py now ask for
    check_output_space(run)


# The runs the suite starts as subprocesses (`shardwise train` / `bench` on the real disk): the
# shipped CPU examples (train CLI, fault, resume and zero3 fetch-unit tests) and the QLoRA GPU
# test's qwen2.5-0.5b (tests/train/test_qlora.py), each with its output dir under tmp_path.
CPU_EXAMPLES = ["demo.yaml", "fsdp-synthetic-cpu.yaml", "lora-demo.yaml"]


@pytest.mark.parametrize("name", CPU_EXAMPLES)
def test_subprocess_runs_of_the_suite_fit_in_20_gib(tmp_path, name):
    cfg = _at(load_config(REPO / "examples" / name, ["checkpointing.save_final=true"]), tmp_path / "out")
    check_output_space(run_spec(cfg, cfg.run.nproc, "cpu", environ={}))  # under the suite's 20 GiB


def test_the_qlora_gpu_run_fits_in_20_gib(tmp_path):
    cfg = TrainConfig.model_validate({
        "model": {"name": "qwen2.5-0.5b"}, "data": {"kind": "synthetic", "synthetic": {"samples": 4, "seq_len": 512}},
        "run": {"steps": 20, "micro_batch": 4, "nproc": 1, "device": "cuda"},
        "lora": {"rank": 16, "target_modules": "all-linear", "quantization": "nf4"},
        "checkpointing": {"output_dir": str(tmp_path / "q"), "save_every_minutes": None, "save_on_interrupt": False},
        "hardware": {"gpu": "h200"}})
    check_output_space(run_spec(cfg, 1, "cuda", environ={}))
