"""Hostile data files (JSONL, JSON, Parquet): a ShardwiseError naming file:line (or row group),
memory bounded, never another exception.

Before: a JSONL line was read whole whatever its size (a 2 GB line: 2 GB and more), NaN and
Infinity were read as floats, a 5,000-digit integer ended in a ValueError traceback, and
Parquet went through `datasets` (an Arrow copy in its cache, the whole file at once, no bound
on the footer's schema or row groups).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardwise.data.formats as formats
from shardwise.config.data import DataConfig
from shardwise.data import build_dataset, load_tokenizer
from shardwise.errors import ShardwiseError

GOOD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def build(tok, path: Path, **kw):
    return build_dataset(DataConfig(train_files=[str(path)], max_length=64, **kw), tok)


def sparse_line(path: Path, size: int) -> Path:
    """A good record, then one line of `size` bytes: a sparse file, no disk used."""
    with path.open("wb") as f:
        f.write((json.dumps(GOOD) + "\n").encode() + b'{"text": "')
        f.truncate(size)
    return path


def test_a_2gb_line_is_refused_after_reading_the_bound(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "MAX_RECORD_BYTES", 1 << 20)  # read 1 MiB of the line, not 256
    with pytest.raises(ShardwiseError, match=r"big\.jsonl:2: a line of more than 1048576 bytes"):
        build(tok, sparse_line(tmp_path / "big.jsonl", 2 << 30))


BAD_LINES = {  # line 2 -> message fragment
    "NaN": ('{"text": "a", "score": NaN}', r"d\.jsonl:2: malformed JSON: NaN is not JSON"),
    "Infinity": ('{"text": "a", "x": [-Infinity]}', r"d\.jsonl:2: malformed JSON: -Infinity is not JSON"),
    "5000-digit integer": ('{"text": "a", "n": ' + "9" * 5000 + "}", r"d\.jsonl:2: malformed JSON: a number too long"),
    "100k deep": ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", r"d\.jsonl:2: JSON nested too deeply"),
    "40 deep": ('{"text": "a", "x": ' + "[" * 40 + "]" * 40 + "}", r"d\.jsonl:2: field 'x': nested more than 32"),
    "lone surrogate": ('{"text": "a\\ud800b"}', r"d\.jsonl:2: field 'text': a lone surrogate U\+D800"),  # fuzz
    "wrong type": ('{"messages": [{"role": "user", "content": ["a"]}]}', r"d\.jsonl:2: field 'messages\[0\]\.content'"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BAD_LINES))
def test_a_bad_line_is_named(tok, tmp_path, name):
    line, message = BAD_LINES[name]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(ShardwiseError, match=message):
        build(tok, path)


def test_a_json_array_with_nan_or_over_the_bound_is_refused(tok, tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([GOOD, {"text": "a", "x": float("nan")}]))
    with pytest.raises(ShardwiseError, match=r"a\.json: malformed JSON: NaN is not JSON"):
        build(tok, path)
    monkeypatch.setattr(formats, "MAX_RECORD_BYTES", 1 << 20)
    with path.open("w") as f:
        f.write("[" + json.dumps(GOOD) + ", ")
        f.truncate(2 << 30)  # sparse
    with pytest.raises(ShardwiseError, match=r"a\.json: a JSON array file of 2147483648 bytes, over the bound"):
        build(tok, path)


def parquet(path: Path, table: pa.Table, **kw) -> Path:
    pq.write_table(table, path, **kw)
    return path


def test_truncated_and_garbage_parquet_are_named(tok, tmp_path):
    good = parquet(tmp_path / "good.parquet", pa.Table.from_pylist([GOOD] * 50))
    data = good.read_bytes()
    for name, content in {"truncated": data[: len(data) // 2], "garbage": b"PAR1" + b"\0" * 64 + b"PAR1",
                          "footer cut": data[:-9] + data[-8:]}.items():  # fmt: skip
        path = tmp_path / f"{name}.parquet"
        path.write_bytes(content)
        with pytest.raises(ShardwiseError, match=rf"{name}\.parquet: .*cannot read Parquet"):
            build(tok, path)


def test_hostile_parquet_schemas_and_row_groups_are_refused(tok, tmp_path, monkeypatch):
    deep = pa.string()
    for _ in range(40):
        deep = pa.list_(deep)
    path = parquet(tmp_path / "deep.parquet", pa.table({"text": pa.array([None], type=deep)}))
    with pytest.raises(ShardwiseError, match=r"deep\.parquet: column 'text': type nested more than 32"):
        build(tok, path)

    monkeypatch.setattr(formats, "MAX_PARQUET_COLUMNS", 100)
    path = parquet(tmp_path / "wide.parquet", pa.table({f"c{i}": ["x"] for i in range(101)}))
    with pytest.raises(ShardwiseError, match=r"wide\.parquet: a Parquet schema of 101 columns, over the bound"):
        build(tok, path)

    monkeypatch.setattr(formats, "MAX_ROW_GROUP_BYTES", 10_000)
    rows = [{"text": f"record {i} " * 20} for i in range(400)]
    path = parquet(tmp_path / "groups.parquet", pa.Table.from_pylist(rows), row_group_size=100)
    with pytest.raises(ShardwiseError, match=r"groups\.parquet: row group 0 \(rows 1-100\) holds \d+ bytes"):
        build(tok, path)


def test_parquet_is_read_a_row_group_at_a_time_with_row_locations(tok, tmp_path):
    rows = [GOOD] * 5 + [{"messages": [{"role": "robot", "content": "x"}]}]
    path = parquet(tmp_path / "p.parquet", pa.Table.from_pylist(rows), row_group_size=2)
    with pytest.raises(ShardwiseError, match=r"p\.parquet:row 6: field 'messages\[0\]\.role'"):
        build(tok, path)


def test_inspect_refuses_a_2gb_line_with_exit_2(tmp_path):
    """`shardwise data inspect` as the user runs it, at the real bound (256 MiB read of a 2 GiB
    sparse line): exit 2, file:line named, no traceback."""
    path = sparse_line(tmp_path / "big.jsonl", 2 << 30)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "shardwise.cli.app", "data", "inspect", str(path), "--plain"],
                       capture_output=True, text=True, timeout=300, check=False, env=env)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert f"{path}:2: a line of more than {formats.MAX_RECORD_BYTES} bytes" in " ".join(r.stderr.split())


# ------------------------------------------------------------------ fuzz

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
        ["messages", "role", "content", "text", "instruction", "output", "input", "conversations", "from", "value"]),
        c, max_size=4),
    max_leaves=12)  # fmt: skip
TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "robot"]),
                              "content": st.text(max_size=12) | st.integers()})  # fmt: skip
RECORD = st.one_of(JSON, st.fixed_dictionaries({"messages": st.lists(TURN, max_size=3)}),
                   st.fixed_dictionaries({"instruction": st.text(max_size=8), "output": st.text(max_size=8)}))
LINE = st.one_of(RECORD.map(json.dumps), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                 st.sampled_from(["NaN", '{"text": Infinity}', '{"text": "\\udfff"}', "[" * 2000, "9" * 5000, "", "{"]))


def _check(tok, path: Path) -> None:
    try:
        build(tok, path, on_error="raise")
    except ShardwiseError as exc:
        assert str(path) in str(exc) or "data.train" in str(exc), str(exc)


@settings(derandomize=True, max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(lines=st.lists(LINE, min_size=1, max_size=4), raw=st.binary(max_size=30))
def test_fuzz_jsonl_and_json(tok, tmp_path, lines, raw):
    """80 generated JSONL files and their JSON-array twins (fixed seed: derandomize): records
    of every shape, raw bytes, NaN, deep nesting, long integers. Each builds, or fails with a
    ShardwiseError naming the file (or the empty train split): never another exception."""
    path = tmp_path / "f.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n" + raw)
    _check(tok, path)
    arr = tmp_path / "f.json"
    arr.write_bytes(b"[" + ",".join(lines).encode("utf-8", "surrogatepass") + b"]")
    _check(tok, arr)


@settings(derandomize=True, max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(records=st.lists(RECORD.filter(lambda r: isinstance(r, dict) and r), min_size=1, max_size=4),
       cut=st.integers(0, 400))
def test_fuzz_parquet(tok, tmp_path, records, cut):
    """30 generated Parquet files (fixed seed: derandomize): tables of generated records
    (mixed types as Arrow infers them), whole and cut at a byte. Each builds, or fails with a
    ShardwiseError naming the file."""
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return  # Arrow cannot hold these records: no file to read
    buf = io.BytesIO()
    pq.write_table(table, buf)
    path = tmp_path / "f.parquet"
    path.write_bytes(buf.getvalue())
    _check(tok, path)
    path.write_bytes(buf.getvalue()[: max(len(buf.getvalue()) - cut, 0)])
    _check(tok, path)
