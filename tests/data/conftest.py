"""Shared fixtures for the data tests: the bundled tokenizer, small configs, record writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)  # the CI box has 2 cores; more threads only add contention


@pytest.fixture(scope="session")
def tok():
    from shardwise.data import load_tokenizer

    return load_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path: Path):
    """write_jsonl(records, name) -> path; a record that is a str is written verbatim (bad JSON)."""

    def write(records, name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    return write

