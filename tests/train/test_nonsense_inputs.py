"""Nonsense that used to start ranks is refused before any rank starts: exit 2,
one message naming the field (or file) and the value, no traceback, and no rank ever ran (no
heartbeat directory, no metrics.jsonl in the output dir).

- `run.micro_batch` / `run.grad_accum` of 1e9 grew past 6 GiB on CPU (no memory check there);
- `run.timeout_s` of inf or 1e30 overflowed in every rank (datetime.timedelta / gloo);
- `data.sft.max_length` of 1e9 packed the data into one row that 2 ranks cannot share;
- a global batch larger than the data (synthetic samples or packed rows);
- a model `config.json` that is not JSON (a raw JSONDecodeError);
- a model whose shape changed under the same `model.path`, resumed (6 tracebacks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.config.load import load_config
from shardwise.config.schema import MAX_GRAD_ACCUM, MAX_MICRO_BATCH, MAX_TIMEOUT_S
from shardwise.errors import ShardwiseError

REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = REPO / "examples" / "fsdp-synthetic-cpu.yaml"  # tiny-qwen, 64 samples, 2 x 2 per rank, 2 ranks
DEMO = REPO / "examples" / "demo.yaml"  # tiny-llama on the bundled SFT sample, 4 x 2 per rank, 2 ranks
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 176, "vocab_size": 2048,
              "max_position_embeddings": 2048}  # fmt: skip


def train(config: Path, out: Path, *sets: str, nproc: int = 2, resume: str | None = None):
    argv = [sys.executable, "-m", "shardwise.train.cli", str(config), "--nproc", str(nproc)]
    for s in (f"checkpointing.output_dir={out}", "logging.progress=false", "logging.trackers=[]", *sets):
        argv += ["--set", s]
    argv += ["--resume", resume] if resume else []
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, check=False)


def assert_refused_before_ranks(r: subprocess.CompletedProcess, out: Path, *fragments: str) -> None:
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("error:") == 1, r.stderr[-3000:]  # one message
    msg = " ".join(r.stderr.split())  # rich wraps long lines
    for f in fragments:
        assert f in msg, f"{f!r} not in: {msg[-2000:]}"
    assert not (out / ".shardwise" / "heartbeat").exists(), "a rank started (it wrote a heartbeat)"
    assert not (out / "metrics.jsonl").exists(), "a rank started (it wrote metrics)"


# ---------------------------------------------------------------- bounds of the config's fields


@pytest.mark.parametrize(("config", "setting", "fragments"), [
    (SYNTHETIC, "run.micro_batch=1000000000", ["'run.micro_batch'", "1000000000", f"less than or equal to {MAX_MICRO_BATCH}"]),
    (SYNTHETIC, "run.grad_accum=1000000000", ["'run.grad_accum'", "1000000000", f"less than or equal to {MAX_GRAD_ACCUM}"]),
    (SYNTHETIC, "run.timeout_s=.inf", ["'run.timeout_s'", "inf", "finite number"]),
    (SYNTHETIC, "run.timeout_s=1e30", ["'run.timeout_s'", "1e30", "at most 604800"]),
    (SYNTHETIC, "run.timeout_s=.nan", ["'run.timeout_s'", "nan", "finite number"]),
    (DEMO, "data.sft.max_length=1000000000", ["'data.sft.max_length'", "1000000000", "less than or equal to 1048576"]),
], ids=["micro_batch", "grad_accum", "timeout_inf", "timeout_1e30", "timeout_nan", "max_length"])  # fmt: skip
def test_out_of_bounds_field_is_refused_naming_it(tmp_path, config, setting, fragments):
    out = tmp_path / "out"
    r = train(config, out, setting)
    # the value came from --set: the error names the override, not a line of the file
    assert_refused_before_ranks(r, out, f"--set {setting}:", *fragments)
    assert not out.exists()  # refused while reading the config: nothing was created


def test_the_bounds_themselves_are_accepted_and_the_longest_timeout_works_in_gloo():
    cfg = load_config(SYNTHETIC, [f"run.micro_batch={MAX_MICRO_BATCH}", f"run.grad_accum={MAX_GRAD_ACCUM}",
                                  f"run.timeout_s={MAX_TIMEOUT_S}", "data.sft.max_length=1048576"])  # fmt: skip
    assert (cfg.run.micro_batch, cfg.run.grad_accum, cfg.run.timeout_s, cfg.data.sft.max_length) == (
        MAX_MICRO_BATCH, MAX_GRAD_ACCUM, MAX_TIMEOUT_S, 1 << 20)
    # what every rank does with it (shardwise.train.launch.rank.init_distributed): timeout + the margin
    code = ("import datetime, tempfile, torch, torch.distributed as dist\n"
            "from shardwise.train.launch.rank import COLLECTIVE_MARGIN_S\n"
            f"t = datetime.timedelta(seconds={MAX_TIMEOUT_S} + COLLECTIVE_MARGIN_S)\n"
            "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1, timeout=t)\n"
            "x = torch.ones(3); dist.all_reduce(x); dist.destroy_process_group(); print('ok', int(x.sum()))\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "3"], r.stderr[-2000:]


# ---------------------------------------------------------------- data smaller than the run


def test_max_length_that_packs_the_data_into_one_row_is_refused_for_two_ranks(tmp_path):
    out = tmp_path / "out"
    r = train(DEMO, out, "data.sft.max_length=65536")
    assert_refused_before_ranks(r, out, "data.sft", "max_length 65536", "gives 1 packed row",
                                "cannot feed 2 ranks")


def test_global_batch_larger_than_the_packed_rows_is_refused_with_the_numbers(tmp_path):
    out = tmp_path / "out"
    r = train(DEMO, out, "data.sft.max_length=2048")  # the bundled sample: 9 rows, 8 usable on 2 ranks
    assert_refused_before_ranks(r, out, "gives 9 packed rows (8 usable on 2 ranks)",
                                "fewer than one global batch of 16 sequences",
                                "run.micro_batch 4 × run.grad_accum 2 × 2 ranks")


def test_global_batch_larger_than_the_synthetic_samples_is_refused(tmp_path):
    out = tmp_path / "out"
    r = train(SYNTHETIC, out, "run.micro_batch=64")  # 64 × 2 × 2 = 256 sequences a step, 64 samples
    assert_refused_before_ranks(r, out, "data.synthetic.samples = 64", "one global batch of 256 sequences",
                                "run.micro_batch 64 × run.grad_accum 2 × 2 ranks")


# ---------------------------------------------------------------- the model directory


def model_dir(path: Path, **over) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA | over, indent=1))
    return path


def test_config_json_that_is_not_json_names_the_file_and_position(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 64,,\n}')
    out = tmp_path / "out"
    r = train(SYNTHETIC, out, f"model.path={d}", "model.random_init=true")
    assert_refused_before_ranks(r, out, "model.path", f"{d / 'config.json'}", "config.json:2:21: not valid JSON")


def test_resume_of_a_model_whose_shape_changed_is_refused_naming_the_tensor(tmp_path):
    """The same model.path, its config.json edited between the save and the resume."""
    d = model_dir(tmp_path / "model")
    out = tmp_path / "out"
    model = [f"model.path={d}", "model.random_init=true"]
    first = train(SYNTHETIC, out, *model, "run.steps=1", "checkpointing.save_every_steps=1", nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    # what that run left, so that the resume's own would show
    import shutil

    shutil.rmtree(out / ".shardwise" / "heartbeat", ignore_errors=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    model_dir(d, intermediate_size=192)
    r = train(SYNTHETIC, out, *model, "run.steps=2", resume="latest")
    assert_refused_before_ranks(r, out, f"model.path '{d}' cannot resume {checkpoint}",
                                "tensor 'model.layers.0.mlp.gate_proj.weight' is [192, 64] in the model this "
                                "config builds but [176, 64] in the checkpoint")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step checkpoint of a 2-layer model directory: (model dir, checkpoint)."""
    root = tmp_path_factory.mktemp("saved")
    d = model_dir(root / "model")
    out = root / "out"
    r = train(SYNTHETIC, out, f"model.path={d}", "model.random_init=true", "run.steps=1",
              "checkpointing.save_every_steps=1", nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    return d, checkpoint


@pytest.mark.parametrize(("change", "fragment"), [
    ({}, None),  # the same shape resumes
    ({"num_hidden_layers": 3}, "the model has tensor 'model.layers.2."),
    ({"num_hidden_layers": 1}, "the checkpoint holds tensor 'model.layers.1."),
    ({"vocab_size": 4096}, "tensor 'model.embed_tokens.weight' is [4096, 64] in the model this config builds but "
                           "[2048, 64] in the checkpoint"),
], ids=["same", "deeper", "shallower", "vocab"])  # fmt: skip
def test_check_same_shapes_compares_every_tensor(saved, tmp_path, change, fragment):
    from shardwise.run import run_spec
    from shardwise.train.checkpoint.resume_checks import check_same_shapes

    _, checkpoint = saved
    d = model_dir(tmp_path / "model", **change)
    cfg = load_config(SYNTHETIC, [f"model.path={d}", "model.random_init=true"])
    run = run_spec(cfg, 2, "cpu", environ={})
    if fragment is None:
        from shardwise.train.checkpoint.sharded import tensor_shapes
        from shardwise.train.model.build import trainable_shapes

        held = {k.removeprefix("model."): s for k, (s, _) in tensor_shapes(checkpoint).items() if k.startswith("model.")}
        assert trainable_shapes(run) == held and len(held) == 2 * 9 + 3  # 9 a layer; embedding, norm, lm_head
        check_same_shapes(cfg, run, checkpoint)
        return
    with pytest.raises(ShardwiseError) as e:
        check_same_shapes(cfg, run, checkpoint)
    assert fragment in str(e.value) and str(checkpoint) in str(e.value)
