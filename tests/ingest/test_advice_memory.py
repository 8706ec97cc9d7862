"""`plan --from`'s "what to change" states the memory that decides "fits": an edit shown under
"To fit" or "To run faster" never reads above the usable figure beside it. (It used to print the
device total, the allocator's reclaimable cache included, so a fitting edit could read "79.4 of
76.0 usable GiB".)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardwise.cli.app import app

DATA = Path(__file__).resolve().parents[1] / "data" / "from"
NEEDED = re.compile(r"([\d.]+) of ([\d.]+) usable GiB per GPU needed")

CASES = [
    # the run its "auto" values leave to the trainer, stated (read alone they are HF Trainer's defaults)
    ["--from", str(DATA / "hf_ds_zero2.json"), "--model", "llama-2-13b", "--gpus", "8", "--gpu", "a100-40g",
     "--precision", "bf16-mixed", "--micro-batch", "1"],
    ["--from", str(DATA / "hf_ds_zero3.json"), "--model", "llama-2-70b", "--gpus", "8", "--gpu", "a100-80g"],
    ["--from", str(DATA / "accelerate_fsdp2.yaml"), "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "a100-40g"],
    ["--from", str(DATA / "axolotl_qlora.yaml"), "--gpus", "1", "--gpu", "rtx-4090"],
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: Path(a[1]).name)
def test_every_suggested_edit_reads_within_the_usable_memory(args):
    r = CliRunner().invoke(app, ["plan", *args])
    assert r.exit_code in (0, 3), r.output
    advice = r.output.split("What to change in", 1)[1]
    # the edits, and the file as written where it fits (a shortfall is stated as needed vs usable)
    shown = [line for line in advice.splitlines() if line.strip().startswith(("- ", "As written:"))]
    assert shown, advice
    for line in shown:
        need, usable = map(float, NEEDED.search(line).groups())
        assert need <= usable, line


def test_a_file_that_does_not_fit_shows_edits_that_do():
    r = CliRunner().invoke(app, ["plan", *CASES[0]])
    advice = r.output.split("What to change in", 1)[1]
    assert "As written it does not fit (46.3 GiB per GPU needed, 38.0 usable)" in advice
    assert "To fit (fewest edits first):" in advice
