"""A torch.compile failure never ends a run: the decoder layers fall back to
eager at the failing call, one warning names the error and the plan re-priced without compiled
layers, and the run trains exactly as an eager run (fp32, one process). Errors the model's own
code raises are not mistaken for compile failures."""

from __future__ import annotations

import pytest
import torch

from shardwise.train.model.compile import is_compile_error

BACKEND = "shardwise_test_failing_backend"


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler on this machine (a stand-in for a user's broken toolchain)")


@pytest.fixture(scope="module", autouse=True)
def _register():
    from torch._dynamo import list_backends, register_backend

    if BACKEND not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=_failing_backend, name=BACKEND)


def _losses(tmp_path, compile_: bool) -> list[float]:
    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.loop import train

    cfg = TrainConfig.model_validate({
        "model": {"name": "tiny-llama", "attention": "eager"},
        "data": {"kind": "synthetic", "synthetic": {"samples": 32, "seq_len": 16, "seed": 7}},
        "strategy": {"name": "ddp"},
        "optimizer": {"lr": 1e-3},
        "run": {"steps": 3, "micro_batch": 2, "seed": 3, "device": "cpu", "compile": compile_,
                "compile_backend": BACKEND},
        "checkpointing": {"output_dir": str(tmp_path / ("c" if compile_ else "e")), "save_every_minutes": None},
        "logging": {"progress": False, "tensorboard": False},
    })
    run = run_spec(cfg, 1, "cpu")
    assert run.train.fused_kernels == compile_  # planned compiled
    torch._dynamo.reset()
    return train(run, DistEnv()).losses


def test_a_failing_compile_falls_back_to_eager_with_one_warning(tmp_path, capfd):
    eager = _losses(tmp_path, compile_=False)
    capfd.readouterr()
    fell_back = _losses(tmp_path, compile_=True)
    err = capfd.readouterr().err
    assert fell_back == eager  # bit for bit: every layer ran its eager forward
    assert err.count("torch.compile of the decoder layers failed") == 1, err
    assert "BackendCompilerFailed" in err and "no C++ compiler" in err
    assert "re-planned eager:" in err and "tokens/s per GPU" in err and "(compiled:" in err


def test_only_compile_machinery_errors_count_as_compile_failures():
    from torch._dynamo.exc import BackendCompilerFailed, Unsupported
    from torch._inductor.exc import InductorError

    assert is_compile_error(BackendCompilerFailed(_failing_backend, RuntimeError("x"), None))
    assert is_compile_error(Unsupported("x"))
    assert is_compile_error(InductorError(RuntimeError("x"), "tb"))
    for e in (RuntimeError("shape mismatch"), torch.OutOfMemoryError("oom"), ValueError("x")):
        assert not is_compile_error(e)
