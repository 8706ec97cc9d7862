"""`shardwise plan --from FILE` over a corpus of published config files (tests/data/corpus/), each
compared field by field with the reading its own tool gives, written by hand in
tests/data/corpus/MANIFEST.yaml from that tool's source (provenance and the sources read are there).

Each file is planned in-process (`plan --from FILE --json`) from tests/data/corpus/<repo-short>,
the copied repository's root, where the tool is launched: a path a file names (LLaMA-Factory's
`deepspeed:`, axolotl's `deepspeed:`, accelerate's `deepspeed_config_file`) resolves as it does
there. The Hugging Face Hub is not reached (HF_HUB_OFFLINE): a model id the catalog lacks is given
as `--model` beside the file (`args`), and its model is then not compared.

An entry's `expected_failure` lists the fields shardwise reads differently today, each with what
the tool runs and why: those fields must still differ (a fix makes this test fail until the entry
is updated), the others must match. `plannable: false` entries must be refused; `plannable` in
`expected_failure` means shardwise plans such a file today.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardwise.catalog import model_hub_ids
from shardwise.cli.app import app

CORPUS = Path(__file__).parents[1] / "data" / "corpus"
MANIFEST = yaml.safe_load((CORPUS / "MANIFEST.yaml").read_text())
ENTRIES = MANIFEST["files"]
FIELDS = {"strategy", "precision", "micro_batch", "grad_accum", "seq_len", "checkpointing", "lora_rank", "lora_dropout",
          "base_quant", "optimizer", "model", "gpus", "tp", "pp", "cp", "cp_impl", "knobs", "fp8", "fp8_all_gather", "objective", "reference"}
# exit 0: planned; 3: planned, and nothing fits the GPUs (the JSON document is printed all the same)
PLANNED = (0, 3)
TRAIN_FIELDS = ("precision", "micro_batch", "grad_accum", "seq_len", "checkpointing", "lora_rank", "lora_dropout",
                "base_quant", "optimizer",
                "objective", "reference", "fp8", "fp8_all_gather")


def test_manifest_is_complete():
    """Every file under the corpus is in the manifest once, with its provenance, and vice versa."""
    on_disk = {p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*") if p.is_file() and p.name != "MANIFEST.yaml"}
    listed = [e["file"] for e in ENTRIES]
    assert len(listed) == len(set(listed))
    assert on_disk == set(listed)
    assert len(listed) >= 50 and len({e["repo"] for e in ENTRIES}) >= 8
    for e in ENTRIES:
        assert e["file"].split("/", 1)[1] == e["path"], e["file"]
        assert len(e["commit"]) == 40 and int(e["commit"], 16) >= 0, e["file"]
        assert e["tool"], e["file"]
        if e.get("plannable", True):
            assert set(e["reading"]) <= FIELDS, e["file"]
            assert e["why"], e["file"]
            assert set(e.get("expected_failure", {})) <= set(e["reading"]), e["file"]
        else:
            assert e["reason"], e["file"]
            assert set(e.get("expected_failure", {})) <= {"plannable"}, e["file"]
        for field, why in e.get("expected_failure", {}).items():
            assert isinstance(why, str) and why, (e["file"], field)


def _planned(d: dict, field: str):
    """The value of `field` in a `plan --json` document."""
    if field == "strategy":
        names = [s["name"] for s in d["strategies"]]
        return names[0] if len(names) == 1 else names
    if field in TRAIN_FIELDS:
        return d["train"][field]
    if field == "gpus":
        return d["hardware"]["gpus"]
    if field in ("tp", "pp", "cp", "cp_impl"):
        return sorted({s[field] for s in d["strategies"]})[0]
    if field == "knobs":
        return d["strategies"][0]["knobs"]
    if field == "model":
        return d["model"]["name"]
    raise AssertionError(field)


def _same(field: str, got, want) -> bool:
    if field == "model":
        return want.lower() == got.lower() or want.lower() in (i.lower() for i in model_hub_ids(got))
    if field == "knobs":
        return all(got.get(k) == v for k, v in want.items())
    return got == want


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_corpus_file(entry, runner, monkeypatch):
    short, path = entry["file"].split("/", 1)
    monkeypatch.chdir(CORPUS / short)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = runner.invoke(app, ["plan", "--from", path, *entry.get("args", []), "--json"])
    planned = r.exit_code in PLANNED
    xfail = entry.get("expected_failure", {})
    if not entry.get("plannable", True):
        if "plannable" in xfail:
            assert planned, f"now refused ({r.output.strip()[-300:]}): drop expected_failure.plannable"
        else:
            assert not planned, f"planned, but the tool's run needs: {entry['reason']}"
        return
    assert planned, r.output
    d = json.loads(r.stdout)
    wrong, fixed = [], []
    for field, want in entry["reading"].items():
        if field == "model" and "--model" in entry.get("args", []):
            continue
        got = _planned(d, field)
        if field in xfail:
            if _same(field, got, want):
                fixed.append(f"{field}: now {got!r} as the tool runs it; drop it from expected_failure")
        elif not _same(field, got, want):
            wrong.append(f"{field}: planned {got!r}, the tool runs {want!r}")
    assert not wrong and not fixed, "\n".join(wrong + fixed)
