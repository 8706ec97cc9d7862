"""Bundled tokenizer and data, the inspect command, and a light import."""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from shardwise.config.data import DataConfig
from shardwise.data import build_dataset, default_tokenizer_path, sample_data_path
from shardwise.data.cli import app

ROOT = Path(__file__).resolve().parents[2]


def test_bundled_tokenizer_is_small_and_chat_ready(tok):
    assert (default_tokenizer_path() / "tokenizer.json").is_file()
    assert len(tok) <= 2048
    for t in ("<|system|>", "<|user|>", "<|assistant|>", tok.bos_token, tok.eos_token, tok.pad_token):
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1  # one special token each
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    text = "How many metres are in 3 kilometres?"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level round trip
    assert tok.chat_template


def test_sample_data_has_chat_multi_turn_and_alpaca():
    recs = [json.loads(line) for line in sample_data_path().read_text().splitlines()]
    chats = [r for r in recs if "messages" in r]
    multi = [r for r in chats if sum(m["role"] == "assistant" for m in r["messages"]) > 1]
    alpaca = [r for r in recs if "instruction" in r]
    assert len(recs) >= 300 and len(chats) + len(alpaca) == len(recs)
    assert multi and alpaca and any("system" in r for r in alpaca)


def test_assets_are_regenerated_byte_identical(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_assets.py"), str(tmp_path)], check=True,
                   capture_output=True)
    bundled = default_tokenizer_path().parent
    for sub in ("data", "tokenizer"):
        cmp = filecmp.dircmp(tmp_path / sub, bundled / sub)
        assert not cmp.left_only and not cmp.right_only
        _, mismatch, errors = filecmp.cmpfiles(tmp_path / sub, bundled / sub, cmp.common_files, shallow=False)
        assert not mismatch and not errors


def test_inspect_prints_statistics_and_marks_the_mask(tok):
    result = CliRunner().invoke(app, ["inspect", str(sample_data_path()), "--max-length", "256", "--plain",
                                      "--sample", "1"])
    assert result.exit_code == 0, result.output
    ds = build_dataset(DataConfig(train_files=[str(sample_data_path())], max_length=256), tok)
    e = ds.stats.encode
    for label, value in (("samples", e.samples), ("tokens", e.tokens), ("rows", ds.stats.rows)):
        assert re.search(rf"{label}\s*│\s*{value}\b", result.output), label
    assert f"{ds.stats.packing_efficiency:.1%}" in result.output
    assert "truncated" in result.output and "dropped" in result.output
    ids, tgt = ds.document(1)
    start = end = int(tgt.argmax())
    while end < len(tgt) and tgt[end]:
        end += 1
    first_reply = tok.decode(ids[start:end].tolist())
    assert f"⟦{first_reply}" in result.output


def test_inspect_reports_bad_input_with_location(write_jsonl):
    path = write_jsonl([{"messages": []}])
    result = CliRunner().invoke(app, ["inspect", str(path), "--plain"])
    assert result.exit_code == 2
    assert "data.jsonl:1: field 'messages': empty conversation" in result.output


def test_inspect_skip_mode_counts(write_jsonl):
    path = write_jsonl([{"messages": []}, {"instruction": "a", "output": "b"}])
    result = CliRunner().invoke(app, ["inspect", str(path), "--plain", "--on-error", "skip"])
    assert result.exit_code == 0, result.output
    assert re.search(r"skipped \(invalid record\)\s*│\s*1\b", result.output)


def test_import_is_light():
    code = ("import sys, shardwise, shardwise.data, shardwise.data.cli; shardwise.data.sample_data_path(); "
            "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def _first_reply(tok, ds, index):
    ids, tgt = ds.document(index)
    start = end = int(tgt.argmax())
    while end < len(tgt) and tgt[end]:
        end += 1
    return tok.decode(ids[start:end].tolist())


def test_inspect_marks_learned_tokens_in_plain_text_when_piped(tok, monkeypatch):
    """Colour is all a pipe or a batch log loses: without --plain, output that is not a terminal
    wraps the learned tokens in ⟦ ⟧ and says so; --color keeps colour only (on request)."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    args = ["inspect", str(sample_data_path()), "--max-length", "256", "--sample", "1"]
    result = CliRunner().invoke(app, args)  # CliRunner's stdout is not a terminal
    assert result.exit_code == 0, result.output
    ds = build_dataset(DataConfig(train_files=[str(sample_data_path())], max_length=256), tok)
    reply = _first_reply(tok, ds, 1)
    assert f"⟦{reply}" in result.output
    assert "learned tokens are wrapped in ⟦ ⟧" in " ".join(result.output.split())
    colour = CliRunner().invoke(app, [*args, "--color"])
    assert colour.exit_code == 0, colour.output
    assert "⟦" not in colour.output and reply in colour.output


def test_inspect_help_shows_the_flags_as_flags():
    result = CliRunner().invoke(app, ["inspect", "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    out = result.output
    for flag in ("--plain / --color", "--packing / --no-packing", "--train-on-prompt / --no-train-on-prompt",
                 "--trust-remote-code / --no-trust-remote-code"):
        assert flag in out, flag
    assert "<bool>" not in out
