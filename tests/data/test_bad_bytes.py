"""A non-UTF-8 byte in a data file names its line.

It used to be reported as "not UTF-8 text (invalid start byte at byte 5242893)": a byte
offset into the whole file, with no line to open. Now: file:line, the byte's column in that
line and its offset in the file, for JSONL, JSON arrays and files with a BOM; the CLI exits 2
with that one message.
"""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sft_records import chat

from shardwise.config.data import DataConfig
from shardwise.data import build_dataset
from shardwise.errors import ShardwiseError

GOOD = json.dumps(chat("What is 2 + 2?", "4.")).encode()


def bad_line(prefix: bytes = b'{"text": "caf') -> bytes:
    return prefix + b'\xe9 au lait"}'  # Latin-1 é: not UTF-8


def message(tok, path: Path) -> str:
    with pytest.raises(ShardwiseError) as info:
        build_dataset(DataConfig(train_files=[str(path)], max_length=64), tok)
    return str(info.value)


def test_jsonl_names_line_column_and_offset(tok, tmp_path):
    data = tmp_path / "data.jsonl"
    lines = [GOOD, GOOD, bad_line(), GOOD]
    data.write_bytes(b"\n".join(lines) + b"\n")
    offset = sum(len(x) + 1 for x in lines[:2]) + len(b'{"text": "caf')
    assert message(tok, data) == (f"{data}:3: not UTF-8 text (byte 0xe9 at column 14, offset {offset} of the file); "
                                  "expected UTF-8 encoded JSON or JSONL.")  # fmt: skip


def test_jsonl_with_a_bom_and_crlf_counts_the_bom_in_the_offset(tok, tmp_path):
    data = tmp_path / "data.jsonl"
    body = GOOD + b"\r\n" + bad_line(b'{"text": "x') + b"\r\n"
    data.write_bytes(codecs.BOM_UTF8 + body)
    offset = 3 + len(GOOD) + 2 + len(b'{"text": "x')
    assert message(tok, data).startswith(f"{data}:2: not UTF-8 text (byte 0xe9 at column 12, offset {offset} ")


def test_json_array_names_the_line_of_the_byte(tok, tmp_path):
    data = tmp_path / "data.json"
    lines = [b"[", GOOD + b",", GOOD + b",", b"  " + bad_line(), b"]"]
    data.write_bytes(b"\n".join(lines) + b"\n")
    offset = sum(len(x) + 1 for x in lines[:3]) + len(b'  {"text": "caf')
    assert message(tok, data).startswith(f"{data}:4: not UTF-8 text (byte 0xe9 at column 16, offset {offset} ")


def test_a_bad_byte_deep_in_a_big_line_is_found_in_its_line(tok, tmp_path):
    """The record is read a line at a time: line and column are those of the line, however far
    into the file it is."""
    data = tmp_path / "data.jsonl"
    long_line = b'{"text": "' + b"a" * 300_000 + b'\xff"}'
    data.write_bytes(b"\n".join([GOOD] * 5 + [long_line]) + b"\n")
    assert f"{data}:6: not UTF-8 text (byte 0xff at column 300011, offset " in message(tok, data)


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shardwise.cli.app", *args], capture_output=True, text=True,
                          timeout=300, check=False, env=env)  # fmt: skip


def test_the_cli_answers_with_the_line_and_exit_2(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"\n".join([GOOD, GOOD, bad_line()]) + b"\n")
    r = run(["data", "inspect", str(data)])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{data}:3: not UTF-8 text (byte 0xe9 at column 14" in " ".join(r.stderr.split())
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": "tiny-llama"}, "precision": "fp32",
                                   "data": {"sft": {"train_files": [str(data)], "max_length": 32}},
                                   "run": {"device": "cpu", "nproc": 2, "steps": 1},
                                   "checkpointing": {"output_dir": str(tmp_path / "out")}}))  # fmt: skip
    r = run(["train", str(cfg)])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{data}:3: not UTF-8 text (byte 0xe9 at column 14" in " ".join(r.stderr.split())
    assert not (tmp_path / "out" / ".shardwise" / "heartbeat").exists()  # no rank started
