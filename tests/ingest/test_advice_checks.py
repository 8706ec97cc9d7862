"""`plan --from`'s advice holds when followed: an edit it prints, applied to the file by hand and
planned again with `shardwise plan --from` (a subprocess, as the user would), gives the run and
figures printed beside it; "The same plan as flags" command, run as printed, plans what the file
plans; a file limited to DDP names the switch to a sharded engine and a run that fits.

The edits are applied here by rewriting the file's text (not through shardwise's own editor), and
the corpus sweep checks, for every published file in tests/data/corpus and every example in
tests/data/from, that a printed command exists and that no printed edit is one the re-plan left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardwise.cli.app import app

TESTS = Path(__file__).resolve().parents[1]
CORPUS = TESTS / "data" / "corpus"
FROM = TESTS / "data" / "from"
MANIFEST = yaml.safe_load((CORPUS / "MANIFEST.yaml").read_text())["files"]
GIB = 2**30


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "PYTHONPATH": str(TESTS.parent / "src")}
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def plan_json(*args: str, cwd: Path | None = None) -> dict:
    r = cli("plan", *args, "--json", cwd=cwd)
    assert r.returncode in (0, 3), r.stderr
    return json.loads(r.stdout)


def row(doc: dict, strategy: str) -> dict:
    [r] = [r for r in doc["strategies"] if r["name"] == strategy]
    return r


def test_a_ddp_accelerate_file_switched_as_advised_fits_with_the_printed_figures(tmp_path):
    """The handbook's DDP accelerate config does not fit Llama-3.1-8B full fine-tuning on 8 A100-80G
    (every GPU holds 16 B/param of model states: ~120 GiB); the advice names the switches to
    FSDP2 and to DeepSpeed ZeRO-3 (the two within a percent of each other's speed, fastest first),
    and each file, written by hand, plans the printed figures."""
    src = CORPUS / "handbook" / "recipes" / "accelerate_configs" / "ddp.yaml"
    doc = plan_json("--from", str(src), "--model", "llama-3.1-8b")
    advice = doc["from"]["what_to_change"]
    assert not advice["current"]["fits"]
    to_fit = advice["to_fit"]
    speeds = [item["tokens_per_s_per_gpu"] for item in to_fit]
    assert speeds == sorted(speeds, reverse=True)
    by_hand = {
        "zero3": ({"distributed_type": "DEEPSPEED", "deepspeed_config.zero_stage": 3},
                  "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3"),
        "fsdp": ({"distributed_type": "FSDP", "fsdp_config.fsdp_version": 2},
                 "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2"),
    }
    assert {item["strategy"] for item in to_fit[:2]} == set(by_hand)
    for item in to_fit[:2]:
        edits, yaml_text = by_hand[item["strategy"]]
        assert item["edits"] == edits
        edited = tmp_path / f"ddp-{item['strategy']}.yaml"
        edited.write_text(src.read_text().replace("distributed_type: MULTI_GPU", yaml_text))
        got = plan_json("--from", str(edited), "--model", "llama-3.1-8b")
        assert got["from"]["values"]["strategy"] == [item["strategy"]]
        r = row(got, item["strategy"])
        assert r["fits"] and r["memory"]["required"] == item["memory_required"]
        assert r["time"]["tokens_per_s_per_gpu"] == item["tokens_per_s_per_gpu"]


def test_a_deepspeed_edit_in_a_named_json_holds_when_applied_by_hand(tmp_path):
    """LLaMA-Factory's full SFT example names a ZeRO-3 JSON; its advice to drop activation
    checkpointing (a key of the YAML) and its ZeRO edits (keys of the JSON it names) plan, applied
    by hand, what was printed."""
    args = ["--from", str(FROM / "llama_factory_full_sft.yaml")]
    doc = plan_json(*args, cwd=TESTS.parent)
    items = doc["from"]["what_to_change"]["faster"]
    assert items
    for item in items:
        data = yaml.safe_load((FROM / "llama_factory_full_sft.yaml").read_text())
        ds = json.loads((FROM / "lf_ds_z3_config.json").read_text())
        for key, value in item["edits"].items():
            if key.startswith("in lf_ds_z3_config.json: "):
                node = ds
                *parents, last = key.removeprefix("in lf_ds_z3_config.json: ").split(".")
                for part in parents:
                    node = node.setdefault(part, {})
                node[last] = value
            else:
                data[key] = value
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        data["deepspeed"] = str(tmp_path / "ds.json")
        (tmp_path / "sft.yaml").write_text(yaml.safe_dump(data))
        doc = plan_json("--from", str(tmp_path / "sft.yaml"))
        got = row(doc, item["strategy"])
        assert (doc["train"]["micro_batch"], doc["train"]["grad_accum"], doc["train"]["checkpointing"]) == (
            item["micro_batch"], item["grad_accum"], item["checkpointing"])
        assert got["memory"]["required"] == item["memory_required"]
        assert got["time"]["tokens_per_s_per_gpu"] == item["tokens_per_s_per_gpu"]


CASES = [  # (cwd, file, flags beside it): one per format, and flags given beside the file
    (CORPUS / "handbook", "recipes/accelerate_configs/ddp.yaml", ["--model", "llama-3.1-8b"]),
    (CORPUS / "transformers", "tests/deepspeed/ds_config_zero3.json", ["--model", "llama-3.1-8b", "--gpus", "16"]),
    (TESTS.parent, "tests/data/from/llama_factory_full_sft.yaml", []),
    (TESTS.parent, "tests/data/from/axolotl_qlora.yaml", ["--gpus", "1", "--gpu", "rtx-4090"]),
    (TESTS.parent, "tests/data/from/accelerate_tp_hsdp.yaml", ["--model", "llama-3.1-8b", "-s", "fsdp"]),
    (TESTS.parent, "tests/data/from/trl_zephyr_dpo_full.yaml", ["--seq-len", "1024"]),
]


@pytest.mark.parametrize("cwd,path,beside", CASES, ids=[c[1].rsplit("/", 1)[-1] for c in CASES])
def test_the_printed_command_plans_what_the_file_plans(cwd, path, beside):
    """Run as printed (a subprocess, the flags given beside the file included), the command gives
    the --from plan's every row and recommendation."""
    r = cli("plan", "--from", path, *beside, cwd=cwd)
    assert r.returncode in (0, 3), r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("The same plan as flags: shardwise plan ")]
    words = line.removeprefix("The same plan as flags: shardwise plan ").split(" ")
    for flag, value in zip(beside[::2], beside[1::2], strict=True):  # the flags beside it are in it
        flag = {"-s": "--strategy"}.get(flag, flag)
        assert [flag, value] in [words[i:i + 2] for i in range(len(words) - 1)], (flag, value)
    from_file = plan_json("--from", path, *beside, cwd=cwd)
    as_flags = plan_json(*words, cwd=cwd)
    from_file.pop("from")
    assert as_flags == from_file


def _corpus_cases():
    for e in MANIFEST:
        if e.get("plannable", True) and "plannable" not in e.get("expected_failure", {}):
            yield pytest.param(CORPUS / e["file"].split("/", 1)[0], e["path"], e.get("args", []), id=e["file"])
    for p in sorted(FROM.iterdir()):
        args = (["--gpus", "64", "--gpu", "h100-sxm"] if p.name == "ds_zero1_pipeline_tp.json"  # its dp 4 layout
                else ["--gpu", "h100-sxm"] if "fp8" in p.name else [])  # fp8 needs FP8 tensor cores
        yield pytest.param(TESTS.parent, str(p.relative_to(TESTS.parent)), args, id=f"from/{p.name}")


@pytest.mark.parametrize("cwd,path,args", list(_corpus_cases()))
def test_every_published_file_has_a_checked_command_and_only_checked_edits(cwd, path, args, monkeypatch):
    monkeypatch.chdir(cwd)
    r = CliRunner().invoke(app, ["plan", "--from", path, *args, "--json"])
    if r.exit_code == 2:  # refused, naming the file (tests/ingest/test_corpus.py checks which and why)
        assert r.output.startswith("error: ") and Path(path).name in r.output, r.output
        return
    assert r.exit_code in (0, 3), r.output
    src = json.loads(r.stdout)["from"]
    assert src["command"] is not None, src["command_refused"]
    advice = src["what_to_change"]
    if advice is None:
        return
    assert advice["checked"]
    dropped = [d["edits"] for d in advice["dropped"]]
    for item in [*advice["to_fit"], *advice["faster"]]:
        assert item["edits"] not in dropped
        assert item["fits"] and item["memory_required"] <= item["usable_bytes"]
    for d in advice["dropped"]:
        assert d["why"] and "shardwise-advice-" not in d["why"]  # named as the user's file


def test_an_edit_whose_file_plans_another_setting_is_not_printed():
    """accelerate's TP + HSDP example: turning fsdp_reshard_after_forward off does not make its
    parallelism_config's replicate × shard mesh SHARD_GRAD_OP; the sweep's fsdp-grad-op candidate
    plans as fsdp-hybrid through the edited file, so it is left out, with why."""
    r = CliRunner().invoke(app, ["plan", "--from", str(FROM / "accelerate_tp_hsdp.yaml"), "--model", "llama-3.1-8b"])
    assert r.exit_code in (0, 3), r.output
    assert "fsdp_config.fsdp_reshard_after_forward: false  →" not in r.output
    assert "Left out: " in r.output
    doc = json.loads(CliRunner().invoke(app, ["plan", "--from", str(FROM / "accelerate_tp_hsdp.yaml"), "--model",
                                              "llama-3.1-8b", "--json"]).stdout)
    [d] = [d for d in doc["from"]["what_to_change"]["dropped"] if d["strategy"] == "fsdp-grad-op"]
    assert "plans fsdp-hybrid" in d["why"]


def test_a_ddp_only_file_names_the_switch_and_a_sharded_run_that_fits(tmp_path):
    """A LLaMA-Factory full SFT of Llama-3-8B without deepspeed runs DDP (16 B/param on each of 8
    A100-80G: over 100 GiB); the advice names LLaMA-Factory's `deepspeed:` key and a ZeRO/FSDP run
    that fits, and that file with LLaMA-Factory's ZeRO-3 JSON added fits (as the user would check)."""
    data = yaml.safe_load((FROM / "llama_factory_full_sft.yaml").read_text())
    del data["deepspeed"]
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump(data))
    r = cli("plan", "--from", str(tmp_path / "ddp.yaml"))
    assert r.returncode in (0, 3), r.stderr
    assert "No edit of this file's strategy, micro-batch or checkpointing makes it fit here." in r.stdout
    assert "sharded, it fits: add deepspeed: a DeepSpeed JSON" in r.stdout
    doc = plan_json("--from", str(tmp_path / "ddp.yaml"))
    switch = doc["from"]["what_to_change"]["switch"]
    assert switch["fits"] and switch["strategy"] in ("zero3", "zero2", "zero1", "fsdp", "fsdp-grad-op")
    data["deepspeed"] = str(FROM / "lf_ds_z3_config.json")
    (tmp_path / "z3.yaml").write_text(yaml.safe_dump(data))
    z3 = plan_json("--from", str(tmp_path / "z3.yaml"))
    assert row(z3, "zero3")["fits"] and row(z3, "zero3")["memory"]["required"] < 76 * GIB
