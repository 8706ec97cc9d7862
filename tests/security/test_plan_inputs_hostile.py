"""Hostile `plan` inputs and config files: each is one ShardwiseError naming the file or flag
(exit 2, no traceback), found before anything is planned, in bounded time and memory.

- `plan --from` JSON nested 100k deep, with NaN / Infinity / -Infinity, with a 5,000-digit
  integer, with a key twice; YAML alias bombs, 100k-deep YAML, huge integers; a file larger
  than its stat says stops at the read's bound;
- a key given twice at any depth of a YAML (plan --from and the run YAML, `optimizer.lr` and a
  second `run:` section), named with both lines; merge keys (`<<: *base`) may still override;
- plan's other input files (--profile, --model-config, --hardware) read within the same bounds;
- every numeric flag of `plan` (the generated --ds-*/--fsdp-*/--ddp-* knobs and plan's own
  counts) refuses NaN, ±inf and values past its bound, naming the flag; a --from file's
  out-of-range knob names the flag and the file;
- the shipped examples (examples/, tests/data/from/) have no duplicate keys;
- the issue's exact cases as a user runs them (`python -m shardwise.cli.app plan ...` subprocesses
  under a 1 GiB address-space limit), exit 2, no "Traceback": nested JSON, NaN, a 5,000-digit
  integer, a 1 GiB file (sparse: no disk used) refused by its size unread, /dev/zero and a FIFO
  refused as not regular files without blocking, --ds-reduce-bucket nan, --ds-prefetch inf,
  duplicate keys (in a --from file, and `shardwise train` of a run YAML with `lr` twice).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.config.file import MAX_CONFIG_BYTES, read_text
from shardwise.config.flags import FLAGS
from shardwise.config.safe_yaml import read_yaml
from shardwise.errors import ShardwiseError
from shardwise.ingest.common import load

REPO = Path(__file__).resolve().parents[2]
FROM = REPO / "tests" / "data" / "from"
DS = '"zero_optimization": {"stage": 2}'
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", *args])


def assert_refused(r, *fragments: str) -> None:
    """Exit 2 with every fragment in the one message; no exception escaped, no traceback."""
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, r.output[-2000:]
    assert "Traceback" not in r.output
    for f in fragments:
        assert f in r.output, f"{f!r} not in {r.output[-2000:]}"


HOSTILE_FILES = {
    "nested.json": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", ["nested.json", "nested too deeply"]),
    "nan.json": ('{"train_micro_batch_size_per_gpu": NaN, ' + DS + "}", ["nan.json", "NaN is not a JSON number"]),
    "inf.json": ('{"zero_optimization": {"stage": 2, "reduce_bucket_size": Infinity}}',
                 ["inf.json", "Infinity is not a JSON number"]),
    "neginf.json": ('{"gradient_accumulation_steps": -Infinity, ' + DS + "}", ["neginf.json", "-Infinity"]),
    "overflow.json": ('{"train_micro_batch_size_per_gpu": 1e999, ' + DS + "}", ["overflow.json", "beyond a float"]),
    "bigint.json": ('{"train_micro_batch_size_per_gpu": ' + "9" * 5000 + ", " + DS + "}",
                    ["bigint.json", "an integer of 5,000"]),
    "twice.json": ('{"train_micro_batch_size_per_gpu": 1,\n' + DS + ',\n"train_micro_batch_size_per_gpu": 64}',
                   ["twice.json:3", "'train_micro_batch_size_per_gpu' given twice (first at line 1)"]),
    "bomb.yaml": ("distributed_type: FSDP\n" + BOMB, ["bomb.yaml:", "expand to more than 100,000"]),
    "deep.yaml": ("distributed_type: FSDP\nx: " + "[" * 100_000 + "]" * 100_000 + "\n",
                  ["deep.yaml:2", "nested too deeply"]),
    "bigint.yaml": ("distributed_type: FSDP\nnum_processes: " + "9" * 5000 + "\n",
                    ["bigint.yaml:2", "an integer of 5,000 characters"]),
    "hexint.yaml": ("distributed_type: FSDP\nnum_processes: 0x" + "f" * 100_000 + "\n", ["hexint.yaml:2", "integer"]),
    "sexagesimal.yaml": ("distributed_type: FSDP\nnum_processes: 1" + ":1" * 200_000 + "\n",
                         ["sexagesimal.yaml:2", "integer"]),
    "nan.yaml": ("distributed_type: FSDP\nnum_processes: .nan\n", ["nan.yaml:2", "num_processes = nan"]),
    "twice.yaml": ("distributed_type: MULTI_GPU\nnum_processes: 8\nnum_processes: 4\n",
                   ["twice.yaml:3", "'num_processes' given twice (first at line 2)"]),
    "twice_nested.yaml": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: false\n"
                          "  fsdp_version: 1\n", ["twice_nested.yaml:5", "'fsdp_config.fsdp_version' given twice "
                                                  "(first at line 3)"]),
}


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_hostile_from_files_are_one_error_naming_the_file(tmp_path, name):
    text, says = HOSTILE_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    t0 = time.perf_counter()
    assert_refused(plan("--from", str(path)), *says)
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("flag", ["--profile", "--model-config", "--hardware"])
@pytest.mark.parametrize("name", ["nested.json", "bigint.json"])
def test_plans_other_input_files_are_read_within_the_same_bounds(tmp_path, flag, name):
    path = tmp_path / name
    path.write_text(HOSTILE_FILES[name][0])
    assert_refused(plan(flag, str(path)), name, HOSTILE_FILES[name][1][1])


def test_a_file_larger_than_its_stat_says_stops_at_the_bound(tmp_path, monkeypatch):
    """The read itself is bounded (a file that grows after the size check, /proc files that stat as 0)."""
    path = tmp_path / "grows.yaml"
    path.write_text("a: " + "x" * (2 * MAX_CONFIG_BYTES) + "\n")
    real = os.stat
    monkeypatch.setattr("shardwise.config.file.os.stat",
                        lambda p, *a, **k: os.stat_result((*real(p)[:6], 10, *real(p)[7:])))
    with pytest.raises(ShardwiseError, match=rf"grows\.yaml: more than {MAX_CONFIG_BYTES:,} bytes"):
        read_text(path)


def test_the_run_yamls_reader_refuses_a_fifo_without_waiting(tmp_path):
    import threading

    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    got: list = []
    t = threading.Thread(target=lambda: got.append(_refusal(fifo)), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # it waits for a writer: give it one so the thread ends, and fail
        with open(fifo, "w"):
            pass
        t.join(5)
        pytest.fail("reading a FIFO waited for a writer")
    assert got == ["run.yaml: not a regular file"], got


def _refusal(path: Path) -> str:
    try:
        read_yaml(path)
    except ShardwiseError as e:
        return str(e).replace(str(path.parent) + "/", "").split(" (")[0]
    return "read"


RUN_TWICE = {
    "optimizer: lr twice": ("name: x\noptimizer:\n  lr: 1.0e-3\n  weight_decay: 0.0\n  lr: 5.0\n",
                            "lr.yaml:5: key 'optimizer.lr' given twice (first at line 3)"),
    "a second run: section": ("name: x\nrun:\n  steps: 10\noptimizer:\n  lr: 1.0e-3\nrun:\n  micro_batch: 2\n",
                              "lr.yaml:6: key 'run' given twice (first at line 2)"),
    "the same key spelled two ways": ("name: x\nrun:\n  steps: 10\n  steps: 0xa\n",
                                      "lr.yaml:4: key 'run.steps' given twice (first at line 3)"),
}


@pytest.mark.parametrize("case", list(RUN_TWICE))
def test_run_yaml_duplicate_keys_name_the_key_and_both_lines(tmp_path, case):
    from shardwise.config.load import load_config

    text, says = RUN_TWICE[case]
    path = tmp_path / "lr.yaml"
    path.write_text(text)
    with pytest.raises(ShardwiseError) as e:
        load_config(path)
    assert says in str(e.value)


@pytest.mark.parametrize("value, says", [
    ("9" * 5000, "an integer of 5,000 characters"),
    ("{a: 1, a: 2}", "key 'a' given twice"),
    ("[" * 200 + "]" * 200, "nested too deeply"),
], ids=["5000-digit", "duplicate", "deep"])
def test_set_values_are_read_with_the_files_bounds(tmp_path, value, says):
    """`--set KEY=VALUE` parses VALUE as YAML: with the same bounded reader as the file (a
    5,000-digit integer was a ValueError traceback)."""
    from shardwise.config.load import load_config

    path = tmp_path / "run.yaml"
    path.write_text("model: {name: tiny-llama}\ndata: {kind: synthetic}\n")
    with pytest.raises(ShardwiseError, match=says) as e:
        load_config(path, [f"run.steps={value}"])
    assert str(e.value).startswith("--set 'run.steps=")


def test_merge_keys_may_still_override_what_they_merge(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {lr: 1.0e-3, weight_decay: 0.1}\noptimizer:\n  <<: *b\n  lr: 5.0e-4\n")
    assert read_yaml(path)[1]["optimizer"] == {"lr": 5.0e-4, "weight_decay": 0.1}


def test_shipped_examples_have_no_duplicate_keys():
    files = [*sorted((REPO / "examples").glob("*.yaml")), *sorted(FROM.iterdir())]
    assert len(files) >= 10
    for f in files:
        load(f) if f.suffix in (".json", ".toml") else read_yaml(f)  # raises on a key given twice


NUMERIC_KNOBS = [f.flag for f in FLAGS if f.flag.startswith("--ds-") and f.field not in (
    "overlap_comm", "contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce",
    "communication_data_type", "fetch_unit")] + ["--ddp-bucket-mb", "--ds-bucket"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_every_numeric_knob_flag_refuses_non_finite_and_huge_values(value):
    assert len(NUMERIC_KNOBS) == 8
    for flag in NUMERIC_KNOBS:
        r = plan(flag, value, "-s", "zero2", "-s", "zero3", "-s", "ddp")
        assert_refused(r, f"error: {flag} {value if value != '1e300' else '1e+300'}")


@pytest.mark.parametrize("flag, value, says", [
    ("--micro-batch", "100000000000000000000", "--micro-batch 100000000000000000000: expected a whole number 1..65,536"),
    ("--seq-len", "100000000000", "--seq-len 100000000000: expected a whole number 1..16,777,216"),
    ("--grad-accum", "100000000000", "--grad-accum 100000000000: expected a whole number 1..1,048,576"),
    ("--lora-rank", "100000000000", "--lora-rank 100000000000: expected 0 (full fine-tuning) or a rank 1..65,536"),
    ("--weight-decay", "nan", "--weight-decay nan"),
    ("--weight-decay", "inf", "--weight-decay inf"),
    ("--margin", "nan", "--margin nan"),
    ("--params", "inf", "--params inf"),
    ("--host-memory-gb", "nan", "--host-memory-gb nan"),
])
def test_plans_own_numeric_flags_refuse_out_of_range_values(flag, value, says):
    assert_refused(plan(flag, value), says)


def test_an_out_of_range_value_in_a_from_file_names_the_flag_and_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10**20}}))
    assert_refused(plan("--from", str(path)), "--ds-prefetch 1e+20", "less than or equal to", "ds.json")
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 10**9, "zero_optimization": {"stage": 2}}))
    assert_refused(plan("--from", str(path)), "--micro-batch 1000000000", "ds.json")


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GiB: reading the 1 GiB file whole fails


def test_the_issues_cases_as_a_user_runs_them(tmp_path):
    """`python -m shardwise.cli.app plan ...` for each of the issue's cases, run side by side, each
    under a 1 GiB address-space limit (a reader that took the 1 GiB file or /dev/zero whole
    fails there, not in the test process) and a time limit (opening a FIFO without a writer
    would wait forever)."""
    sparse = tmp_path / "huge.json"
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk used, 1 GiB by stat
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    files = {n: tmp_path / n for n in ("nested.json", "nan.json", "bigint.json", "twice.yaml")}
    for n, p in files.items():
        p.write_text(HOSTILE_FILES[n][0])
    cases = {
        "nested JSON": (["--from", str(files["nested.json"])], "nested too deeply"),
        "NaN": (["--from", str(files["nan.json"])], "NaN is not a JSON number"),
        "5000-digit integer": (["--from", str(files["bigint.json"])], "5,000 digits"),
        "1 GiB file": (["--from", str(sparse)], "1,073,741,824 bytes"),
        "/dev/zero": (["--from", "/dev/zero"], "not a regular file"),
        "a FIFO": (["--from", str(fifo)], "pipe.yaml: not a regular file"),
        "--model-config /dev/zero": (["--model-config", "/dev/zero"], "/dev/zero: not a regular file"),
        "--profile /dev/zero": (["--profile", "/dev/zero"], "/dev/zero: not a regular file"),
        "--ds-reduce-bucket nan": (["--ds-reduce-bucket", "nan"], "--ds-reduce-bucket nan"),
        "--ds-prefetch inf": (["--ds-prefetch", "inf", "-s", "zero3"], "--ds-prefetch inf"),
        "duplicate keys": (["--from", str(files["twice.yaml"])], "'num_processes' given twice"),
    }
    run_yaml = tmp_path / "lr.yaml"
    run_yaml.write_text(RUN_TWICE["optimizer: lr twice"][0])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    commands = {name: ["shardwise.cli.app", "plan", *args] for name, (args, _) in cases.items()}
    commands["the run YAML's lr twice"] = ["shardwise.train.cli", str(run_yaml)]  # `shardwise train lr.yaml`
    cases["the run YAML's lr twice"] = ([], "lr.yaml:5: key 'optimizer.lr' given twice (first at line 3)")
    procs = {name: subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, preexec_fn=_limited)
             for name, command in commands.items()}
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise AssertionError(f"{name}: no answer within 120 s") from None
        assert proc.returncode == 2, (name, err[-2000:])
        assert "Traceback" not in err and cases[name][1] in err, (name, err[-2000:])
