"""`--set` errors name the override, not the file's line, and say how to write a list; a
value from the file still cites its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config.load import load_config
from shardwise.errors import ShardwiseError

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def _error(path, overrides) -> str:
    with pytest.raises(ShardwiseError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_a_bad_override_names_the_override_not_the_yaml_line():
    msg = _error(DEMO, ["run.steps=abc"])
    assert "--set run.steps=abc: field 'run.steps' = 'abc'" in msg
    assert "integer" in msg
    assert f"{DEMO}:" not in msg  # the file's line of the original value is not the culprit


def test_a_list_field_set_to_a_scalar_says_how_to_write_a_list():
    msg = _error(DEMO, ["data.sft.train_files=/data/train.jsonl"])
    assert "--set data.sft.train_files=/data/train.jsonl" in msg
    assert "--set data.sft.train_files='[/data/train.jsonl]'" in msg


def _bad_steps(tmp_path) -> tuple[Path, int]:
    """The demo config with `run.steps: abc`, and that line's number (1-based)."""
    lines = DEMO.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("steps:"))
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines[at] = f"{indent}steps: abc"
    bad = tmp_path / "bad.yaml"
    bad.write_text("\n".join(lines) + "\n")
    return bad, at + 1


def test_a_bad_value_in_the_file_still_cites_its_line(tmp_path):
    bad, line = _bad_steps(tmp_path)
    msg = _error(bad, [])
    assert f"{bad}:{line}: field 'run.steps' = 'abc'" in msg
    assert "--set" not in msg


def test_an_override_that_fixes_the_file_wins(tmp_path):
    bad, _ = _bad_steps(tmp_path)
    assert load_config(bad, ["run.steps=7"]).run.steps == 7
