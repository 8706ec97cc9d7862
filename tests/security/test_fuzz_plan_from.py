"""Fuzz of every file `shardwise plan --from` reads and of the run YAML, in process.

Readers: the DeepSpeed JSON, accelerate YAML, LLaMA-Factory / axolotl YAML, TrainingArguments
JSON (two seeds written here: with FSDP, with inline DeepSpeed) and shardwise YAML of `plan --from` (shardwise.ingest, the whole `plan` command through
typer's CliRunner), and the run YAML through `shardwise.config.load.load_config`. Inputs:
structures generated from the readers' own key vocabulary (every quoted name in
src/shardwise/ingest/ and every key of the real examples), the real examples
(tests/data/from/, examples/) with values replaced by hostile ones (NaN, ±inf, huge and
negative numbers, wrong types, aliases), and their text mutated (syntax pieces inserted, lines
repeated, spans cut).

Property of each case: a plan (exit 0, or 3 when nothing fits) or exit 2 with one message
naming the file and no traceback, within CASE_SECONDS; the run YAML: a TrainConfig or a
ShardwiseError naming the file. Over a whole test the process's peak RSS grows by less than
PEAK_GROWTH_MB. Hypothesis with a fixed seed (SEED, no example database): 150 cases per test,
450 of `plan --from` and 300 of the run YAML per CI run, about 25 s in all on one core.
"""

from __future__ import annotations

import json
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.errors import ShardwiseError

REPO = Path(__file__).resolve().parents[2]
FROM = REPO / "tests" / "data" / "from"
EXAMPLES = REPO / "examples"
CASE_SECONDS = 20.0
PEAK_GROWTH_MB = 512
SEED = 39_2026  # a fixed seed: the same cases every run
FUZZ = settings(deadline=None, max_examples=150, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


def _at(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _keys_of(value: Any) -> set[str]:
    out, stack = set(), [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            out |= {str(k) for k in v}
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def _text(path: Path | Seed) -> str:
    """A seed's text, planned as it stands: the LLaMA-Factory example's Hub model is one the
    catalog names, and its DeepSpeed JSON is the copy beside it (_stage)."""
    return (path.read_text().replace("meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Llama-2-7b-hf")
            .replace("deepspeed: tests/data/from/", "deepspeed: "))


def _load(path: Path | Seed) -> Any:
    return json.loads(_text(path)) if path.suffix == ".json" else yaml.safe_load(_text(path))


@dataclass(frozen=True)
class Seed:
    """A seed file written here (TrainingArguments JSON has no example in tests/data/from/)."""

    name: str
    text: str

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    def read_text(self) -> str:
        return self.text


TRAINING_ARGS = {"model_name_or_path": "meta-llama/Llama-2-7b-hf", "per_device_train_batch_size": 4,
                 "gradient_accumulation_steps": 2, "bf16": True, "optim": "adamw_torch_fused", "weight_decay": 0.01,
                 "gradient_checkpointing": True, "output_dir": "out", "learning_rate": 2e-5}
TOML_FILES = sorted(FROM.glob("*.toml"))
# the TOML examples (torchtitan's) are mutated as text only (TOML_FILES): no TOML writer is installed
FROM_FILES = [*sorted(p for p in FROM.iterdir() if p.suffix != ".toml"),
              Seed("args_fsdp.json", json.dumps(TRAINING_ARGS | {"fsdp": "full_shard auto_wrap", "fsdp_config": {
                  "version": 2, "reshard_after_forward": True, "cpu_offload": False}})),
              Seed("args_ds.json", json.dumps(TRAINING_ARGS | {"deepspeed": {
                  "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                        "reduce_bucket_size": 5e8}, "train_micro_batch_size_per_gpu": "auto"}}))]
RUN_FILES = sorted(EXAMPLES.glob("*.yaml"))


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path under `value` (the top level itself: () only where nothing is under it)."""
    out = [prefix] if prefix or not value else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _leaves(files: list[Path]) -> list[tuple[Path, tuple]]:
    """(file, key path) of every number and string in the files: what the readers convert."""
    out = []
    for f in files:
        doc = _load(f)
        out += [(f, p) for p in _paths(doc) if p and isinstance(_at(doc, p), int | float | str)]
    return out
# every name the readers look up, and every key the real files have
VOCAB = sorted({*re.findall(r"[\"']([a-z][a-z0-9_]{2,40})[\"']", "".join(
    p.read_text() for p in (REPO / "src" / "shardwise" / "ingest").glob("*.py"))),
    *(k for p in [*FROM_FILES, *RUN_FILES] for k in _keys_of(_load(p)))})

HOSTILE = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 10**39, -(10**39), 2**63, -1, 0, 1, 1e308, -0.0, 0.5,
                     True, False, None, "", "auto", "nan", ".inf", "1e999", "-1", "none", "true", "zero3", "fsdp",
                     "FULL_SHARD", "DEEPSPEED", "meta-llama/Llama-2-7b-hf", "../../etc/passwd", "/dev/zero",
                     [], {}, [1, 2], {"a": 1}]),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
KEYS = st.one_of(st.sampled_from(VOCAB), st.text(max_size=8))
VALUES = st.recursive(HOSTILE, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(KEYS, inner, max_size=5)), max_leaves=16)
NUMBERS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, 10**39, 2**63, -1, 0, 0.5, 1e-300])
REPLACEMENT = st.one_of(NUMBERS, HOSTILE, VALUES)  # mostly a scalar: the readers convert those
# pieces of JSON/YAML syntax a text mutation inserts
PIECES = ["{", "}", "[", "]", ":", ",", "\n", "  ", "\t", "&a ", "*a", "<<: *a\n", "!!python/object:os.system ",
          "!!binary ", "? ", "- ", "---\n", "...\n", "NaN", "Infinity", "-Infinity", "1e999", "9" * 60, '"', "'",
          "#", "%YAML 1.1\n", "\x00", "\x1b", "\ufeff", "é", "null", "~", ".nan", "0x" + "f" * 50, "1:2:3:4:5"]


FROM_LEAVES = _leaves([*FROM_FILES, *RUN_FILES])
RUN_LEAVES = _leaves(RUN_FILES)
EDITS = st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["replace", "delete", "add"]), VALUES, KEYS),
                 max_size=2)


def _write(path: Path, value: Any, fmt: str) -> None:
    if fmt == "json":
        path.write_text(json.dumps(value, default=str))  # NaN/Infinity written as json.dumps does
    else:
        path.write_text(yaml.safe_dump(value, sort_keys=False, allow_unicode=True))


def _mutate(doc: Any, path: tuple, action: str, new: Any, key: str) -> Any:
    """`doc` with the value at `path` replaced or deleted, or `key` added beside it."""
    if not path:
        return new
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    if action == "delete":
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[key] = new
    else:
        parent[path[-1]] = new
    return doc


def _mutated(base: Path, target: tuple, value: Any, more: list) -> Any:
    """`base` parsed, with the scalar at `target` replaced by `value`, then `more` edits: (the
    n-th key path of what is left, modulo their count; replace, delete, or add a key beside it)."""
    doc = _mutate(_load(base), target, "replace", value, "")
    for n, action, new, key in more:
        paths = _paths(doc)
        path = paths[n % len(paths)]
        doc = _mutate(doc, path, action if path else "replace", new, key)
    return doc


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@pytest.fixture
def bounded_memory():
    before = _peak_mb()
    yield
    assert _peak_mb() - before < PEAK_GROWTH_MB, f"peak RSS grew {_peak_mb() - before:.0f} MB"


def assert_plan_or_named_error(path: Path, *extra: str) -> None:
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, ["plan", "--from", str(path), "--format", "json", *extra])
    took = time.perf_counter() - t0
    assert took < CASE_SECONDS, f"{took:.1f} s"
    exc = r.exception
    assert exc is None or isinstance(exc, SystemExit), "".join(
        __import__("traceback").format_exception(exc))[-3000:]
    assert r.exit_code in (0, 2, 3), r.output[-2000:]
    if r.exit_code == 2:
        assert path.name in r.output, r.output[-2000:]
        assert "Traceback" not in r.output


def _stage(tmp_path: Path) -> Path:
    """A directory with the DeepSpeed JSON the LLaMA-Factory example names (beside it)."""
    d = tmp_path / "case"
    d.mkdir(exist_ok=True)
    (d / "lf_ds_z3_config.json").write_text((FROM / "lf_ds_z3_config.json").read_text())
    return d


@seed(SEED)
@FUZZ
@given(base=st.sampled_from(FROM_FILES), extra=st.dictionaries(KEYS, VALUES, max_size=6),
       fmt=st.sampled_from(["json", "yaml"]))
def test_generated_files_plan_or_are_refused_naming_the_file(tmp_path_factory, base, extra, fmt, bounded_memory):
    """150 cases: a real file's top level merged with generated keys and values, as JSON or YAML."""
    d = _stage(tmp_path_factory.mktemp("gen"))
    path = d / f"gen.{fmt}"
    _write(path, {**_load(base), **extra}, fmt)
    assert_plan_or_named_error(path)


@seed(SEED)
@FUZZ
@given(target=st.sampled_from(FROM_LEAVES), value=REPLACEMENT, more=EDITS)
def test_mutated_examples_plan_or_are_refused_naming_the_file(tmp_path_factory, target, value, more, bounded_memory):
    """150 cases: a real example with one of its numbers or strings replaced by a hostile value,
    and up to 2 more values replaced, deleted or added."""
    base = target[0]
    doc = _mutated(base, target[1], value, more)
    d = _stage(tmp_path_factory.mktemp("mut"))
    path = d / f"mutated{base.suffix}"
    _write(path, doc, "json" if base.suffix == ".json" else "yaml")
    assert_plan_or_named_error(path)


def _text_mutation(text: str, data: st.DataObject) -> str:
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        op = data.draw(st.sampled_from(["insert", "cut", "repeat_line"]))
        if op == "insert":
            text = text[:at] + data.draw(st.sampled_from(PIECES)) + text[at:]
        elif op == "cut":
            text = text[:at] + text[at + data.draw(st.integers(1, 40)):]
        else:
            lines = text.splitlines(keepends=True) or [""]
            i = data.draw(st.integers(0, len(lines) - 1))
            text = "".join([*lines[: i + 1], lines[i], *lines[i + 1:]])
    return text


@seed(SEED)
@FUZZ
@given(base=st.sampled_from([*FROM_FILES, *RUN_FILES, *TOML_FILES]), data=st.data())
def test_mutated_text_plans_or_is_refused_naming_the_file(tmp_path_factory, base, data, bounded_memory):
    """150 cases: a real example's text with 1-4 syntax pieces inserted, spans cut or lines repeated."""
    d = _stage(tmp_path_factory.mktemp("txt"))
    path = d / f"text{base.suffix}"
    path.write_text(_text_mutation(_text(base), data))
    assert_plan_or_named_error(path)


def assert_config_or_named_error(path: Path) -> None:
    from shardwise.config.load import load_config
    from shardwise.config.schema import TrainConfig

    t0 = time.perf_counter()
    try:
        assert isinstance(load_config(path), TrainConfig)
    except ShardwiseError as e:
        assert path.name in str(e), str(e)
    assert time.perf_counter() - t0 < CASE_SECONDS


@seed(SEED)
@FUZZ
@given(target=st.sampled_from(RUN_LEAVES), value=REPLACEMENT, more=EDITS)
def test_mutated_run_yaml_loads_or_is_refused_naming_the_file(tmp_path_factory, target, value, more, bounded_memory):
    """150 cases: an example run YAML with one of its numbers or strings replaced by a hostile
    value, and up to 2 more values replaced, deleted or added."""
    doc = _mutated(target[0], target[1], value, more)
    path = tmp_path_factory.mktemp("run") / "run.yaml"
    _write(path, doc, "yaml")
    assert_config_or_named_error(path)


@seed(SEED)
@FUZZ
@given(base=st.sampled_from(RUN_FILES), data=st.data())
def test_mutated_run_yaml_text_loads_or_is_refused_naming_the_file(tmp_path_factory, base, data, bounded_memory):
    """150 cases: an example run YAML's text with syntax pieces inserted, spans cut or lines repeated."""
    path = tmp_path_factory.mktemp("runtxt") / "run.yaml"
    path.write_text(_text_mutation(_text(base), data))
    assert_config_or_named_error(path)
