"""A checkpoint's JSON files are untrusted input too: the manifest, `trainer_state.json`, every
`rank-N.json` and the manifest's copy of the run's config.

The manifest lists sizes and sha256 of the other files, but it is no signature: whoever writes
the directory refreshes them (`_refresh` does, as an attacker would). Before, such files reached
the ranks unchecked: `TrainerState(**json)` raised a TypeError on every rank for an unknown key,
a NaN or a string went into the data position, a deeply nested manifest raised RecursionError, a
5,000-digit integer ValueError, and `"micro_batch": "x"` in the saved config was multiplied by
the saved accumulation (a string of any length). Now each is refused by `read_manifest` (which
preflight and export call before anything starts) with a ShardwiseError naming the file and the
field. Hypothesis then generates values for every field shardwise reads (200 cases, fixed seed).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from hostile_runs import REPO, cli, copy_run, train_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint import directory as checkpoint_dir
from shardwise.train.checkpoint.directory import step_dir_name
from shardwise.train.checkpoint.resume_checks import check_saved_config
from shardwise.train.checkpoint.sharded import TrainerState, read_manifest, save_checkpoint


class _Stand:
    def checkpoint_state(self):
        return {"model.w": torch.ones(3, 4), "optim.exp_avg.w": torch.zeros(3, 4)}, {"optimizer_step": 1}


@pytest.fixture
def step(tmp_path) -> Path:
    return save_checkpoint(_Stand(), TrainerState(step=1, samples_consumed=4, global_batch=4), tmp_path / "run",
                           config={"run": {"micro_batch": 2, "grad_accum": 2}}, strategy="ddp", keep_last=2)


def _refresh(step: Path, name: str, text: str) -> None:
    """Write `name` and refresh its entry in the manifest, as whoever can write the directory can."""
    (step / name).write_text(text)
    mf = json.loads((step / "manifest.json").read_text())
    mf["files"][name] = {"bytes": len(text.encode()), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(mf))


def _edit_manifest(directory: Path, fields: dict) -> None:
    mf = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps(mf | fields))


def _refused(step: Path, *fragments: str) -> str:
    with pytest.raises(ShardwiseError) as e:
        read_manifest(step)
    for f in fragments:
        assert f in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": "shardwise-checkpoint/1", "step": NaN}', "NaN is not a JSON number"),
    ('{"format": "shardwise-checkpoint/1", "step": Infinity}', "Infinity is not a JSON number"),
    ('{"format": "shardwise-checkpoint/1", "step": ' + "9" * 5000 + "}", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    ('[1, 2]', "expected a JSON object"),
], ids=["deep", "nan", "inf", "5000-digit", "bytes", "list"])
def test_a_malformed_manifest_is_refused_naming_it(step, text, says):
    if isinstance(text, bytes):
        (step / "manifest.json").write_bytes(text)
    else:
        (step / "manifest.json").write_text(text)
    _refused(step, str(step / "manifest.json"), says)


@pytest.mark.parametrize("fields, says", [
    ({"step": "4"}, "field 'step'"),
    ({"step": True}, "field 'step'"),
    ({"step": -1}, "field 'step'"),
    ({"world_size": 0}, "field 'world_size'"),
    ({"config": []}, "field 'config'"),
    ({"lineage": 5}, "field 'lineage'"),
    ({"files": {"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}}, "not a file name"),
    ({"files": {"x": {"bytes": "1", "sha256": "0" * 64}}}, "field 'files.x'"),
    ({"files": {"x": {"bytes": 1, "sha256": "zz"}}}, "field 'files.x'"),
], ids=lambda v: str(v)[:30])
def test_manifest_fields_of_the_wrong_type_are_refused(step, fields, says):
    _edit_manifest(step, fields)
    _refused(step, str(step / "manifest.json"), says)


def test_a_manifest_that_is_a_device_or_too_big_is_refused_before_reading(step, monkeypatch):
    monkeypatch.setattr(checkpoint_dir, "_MAX_MANIFEST", 10)
    _refused(step, "expected a checkpoint manifest of at most 10 bytes")
    monkeypatch.undo()
    (step / "manifest.json").unlink()
    os.symlink("/dev/zero", step / "manifest.json")  # read_text would read for ever
    _refused(step, "manifest.json")  # refused (as no manifest) without reading


@pytest.mark.parametrize("state, says", [
    ({"step": 1, "samples_consumed": 4, "global_batch": 4, "evil": 1}, "expected the fields"),
    ({"step": -1, "samples_consumed": 4, "global_batch": 4}, "field 'step'"),
    ({"step": 1, "samples_consumed": "4", "global_batch": 4}, "field 'samples_consumed'"),
    ({"step": 1, "samples_consumed": 4, "global_batch": 0}, "field 'global_batch'"),
    ({"step": 1, "samples_consumed": 4, "global_batch": 4, "engine": {"x": {"y": 1}}}, "field 'engine'"),
    ({"step": 1, "samples_consumed": 4, "global_batch": 4, "engine": {"optimizer_step": "1"}}, "field 'engine'"),
    ({"step": 1, "samples_consumed": 4, "global_batch": 4, "engine": {"scaler": {"scale": [1]}}}, "field 'engine'"),
    ({"step": 1, "samples_consumed": 4, "global_batch": 4, "train_time_s": -5}, "field 'train_time_s'"),
], ids=["extra", "negative", "string", "zero-batch", "unknown-engine", "string-step", "nested-scaler",
        "negative-time"])
def test_a_crafted_trainer_state_is_refused(step, state, says):
    _refresh(step, "trainer_state.json", json.dumps(state))
    _refused(step, str(step / "trainer_state.json"), says)


def test_a_trainer_state_with_nan_is_refused(step):
    _refresh(step, "trainer_state.json", '{"step": 1, "samples_consumed": NaN, "global_batch": 4}')
    _refused(step, str(step / "trainer_state.json"), "NaN")


@pytest.mark.parametrize("edit, says", [
    (lambda r: r.update(python=[3, [0] * 10, None]), "'python'"),
    (lambda r: r.update(numpy=["MT19937", [2**40] * 624, 0, 0, 0.0]), "'numpy'"),
    (lambda r: r.update(torch="AAAA"), "'torch'"),
    (lambda r: r.update(torch="not base64!"), "'torch'"),
    (lambda r: r.pop("python"), "'python'"),
], ids=["python-length", "numpy-range", "torch-length", "torch-b64", "missing"])
def test_a_crafted_rank_rng_state_is_refused(step, edit, says):
    doc = json.loads((step / "rank-00000.json").read_text())
    edit(doc["rng"])
    _refresh(step, "rank-00000.json", json.dumps(doc))
    _refused(step, str(step / "rank-00000.json"), says)


@pytest.mark.parametrize("config, says", [
    ({"run": {"micro_batch": "x" * 1000, "grad_accum": 10**12}}, "config.run.micro_batch"),
    ({"model": ["tiny-llama"]}, "config.model"),
    ({"strategy": {"tp": "2"}}, "config.strategy.tp"),
], ids=["string-count", "list-section", "string-tp"])
def test_a_crafted_saved_config_is_refused_before_arithmetic(step, config, says):
    with pytest.raises(ShardwiseError, match=says.replace(".", r"\.")):
        check_saved_config(config, step)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=8), lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)
_FIELDS = {"trainer_state.json": ["step", "samples_consumed", "global_batch", "engine", "train_time_s", "x"],
           "manifest.json": ["step", "world_size", "config", "files", "lineage", "parent", "strategy", "format"],
           "rank-00000.json": ["rng", "rank"]}


def test_generated_field_values_are_accepted_or_refused_by_name(tmp_path, step):
    """200 Hypothesis cases, derandomized (a fixed seed): one field of one file set to a generated
    JSON value (the hashes refreshed). `read_manifest` returns or raises a ShardwiseError naming a
    file of the checkpoint; nothing else escapes."""
    originals = {n: (step / n).read_text() for n in _FIELDS}

    @settings(max_examples=200, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(_FIELDS)), st.data())
    def run(name: str, data) -> None:
        for n, text in originals.items():
            (step / n).write_text(text)
        doc = json.loads(originals[name])
        doc[data.draw(st.sampled_from(_FIELDS[name]))] = data.draw(_JSON)
        if name == "manifest.json":
            (step / name).write_text(json.dumps(doc))
        else:
            _refresh(step, name, json.dumps(doc))
        try:
            read_manifest(step)
        except ShardwiseError as e:
            assert str(step) in str(e), str(e)

    run()


@pytest.mark.distributed
def test_resume_refuses_a_crafted_trainer_state_before_any_rank_starts(tmp_path, trained):
    """Through the user's command: `--resume latest` of the fsdp demo whose trainer_state.json
    (hash refreshed) carries an unknown field: exit 2 naming the file, no rank started."""
    out = copy_run(trained("fsdp-demo"), tmp_path / "run")
    step = out / "checkpoints" / step_dir_name(4)
    state = json.loads((step / "trainer_state.json").read_text())
    _refresh(step, "trainer_state.json", json.dumps(state | {"samples_consumed": -8}))
    heartbeats = sorted((out / ".shardwise").rglob("rank-*.json"))
    stamps = [p.stat().st_mtime_ns for p in heartbeats]
    r = cli(*train_args(REPO / "examples" / "demo.yaml", out), "--resume", "latest", cwd=tmp_path)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-3000:]
    assert "field 'samples_consumed'" in text and str(step / "trainer_state.json") in " ".join(text.split())
    assert "Traceback" not in text
    assert [p.stat().st_mtime_ns for p in heartbeats] == stamps
