"""What docs/architecture.md says of the trainer's step holds: the loop's line count and
`train_step`'s lines as quoted, and the path from `shardwise train` to the loss kernel as
benchmarks/loss_path.py renders its committed result, every frame still a function of its file
(a moved or renamed step makes the committed path stale: rerun `python benchmarks/loss_path.py`)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from bench_scripts import load

ROOT = Path(__file__).resolve().parents[2]


def test_the_doc_quotes_the_committed_path() -> None:
    script = load("loss_path")
    result = json.loads(script.RESULT.read_text())
    assert script.quoted(script.DOC.read_text()) == script.render(result)
    assert result["shardwise_files"] == len({f["file"] for f in result["path"]})
    assert result["shardwise_frames"] == len(result["path"]) < result["frames"]


def test_every_frame_of_the_path_is_a_function_of_its_file() -> None:
    result = json.loads((ROOT / "benchmarks" / "results" / "loss_path.json").read_text())
    src = ROOT / "src" / "shardwise"
    for frame in result["path"]:
        tree = ast.parse((src / frame["file"]).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert frame["function"] in names, frame
    assert result["path"][-1] == {"file": "train/model/loss.py", "function": "forward"}


def test_the_loops_size_and_its_steps_lines_are_as_quoted() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    loop = ROOT / "src" / "shardwise" / "train" / "loop.py"
    text = loop.read_text()
    step = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    quoted = re.search(r"loop\.py +the one loop \((\d+) lines\).*?`train_step` \(lines (\d+)-(\d+),", doc, re.S)
    assert quoted, "docs/architecture.md no longer quotes the loop's size and train_step's lines"
    assert tuple(map(int, quoted.groups())) == (len(text.splitlines()), step.lineno, step.end_lineno)
