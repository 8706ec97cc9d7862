"""`plan --from` files name their model as the tools do, by Hugging Face id
(`model_name_or_path`, `base_model`, the trainer's `model.name`): the id resolves as `--model`
does (shardwise.catalog.find_model), so a file naming a catalog model's id plans what the same
file plans with `--model KEY` beside it, and an id outside the catalog is read from the Hugging
Face cache (a fake one here; the suite runs offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.specs.test_model_names import AUTO_MAP, CODE, TINY, fake_hub_cache, hub_cache  # noqa: F401 (a fixture)
from typer.testing import CliRunner

from shardwise.cli.app import app

DATA = Path(__file__).parents[1] / "data" / "from"
ROOT = Path(__file__).resolve().parents[2]


def plan(*args: str) -> dict:
    """The plan's JSON (exit 3, "nothing fits", still prints it: these tests are about the model)."""
    r = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert r.exit_code in (0, 3), r.output
    return json.loads(r.stdout)


def refused(*args: str) -> str:
    r = CliRunner().invoke(app, ["plan", *args])
    assert r.exit_code == 2, r.output
    return " ".join(r.output.split())


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))
    return path


def lf(model: str, **more) -> dict:
    """A LLaMA-Factory LoRA SFT file (keys of its examples/train_lora/llama3_lora_sft.yaml)."""
    return {"model_name_or_path": model, "stage": "sft", "do_train": True, "finetuning_type": "lora",
            "lora_rank": 8, "lora_target": "all", "dataset": "identity", "template": "qwen3", "cutoff_len": 2048,
            "output_dir": "saves/lora", "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8,
            "bf16": True, **more}


def same_as_catalog(file: Path, key: str) -> dict:
    """The file's plan is the plan of the file with `--model KEY` beside it (a flag wins over the
    file); the source read says which entry the id meant."""
    got = plan("--from", str(file))
    source = got.pop("from")
    want = plan("--from", str(file), "-m", key)
    want.pop("from")
    assert got == want and got["model"]["name"] == key
    assert plan(*source["as_flags"]) == got  # the flags it says it equals
    return source


@pytest.mark.parametrize("hub_id, key", [("meta-llama/Meta-Llama-3-8B", "llama-3-8b"), ("Qwen/Qwen3-4B", "qwen3-4b")])
def test_training_arguments_json_naming_a_hub_id(hub_id, key, tmp_path):
    f = write(tmp_path / "args.json", {"output_dir": "out", "model_name_or_path": hub_id, "bf16": True,
                                       "per_device_train_batch_size": 2, "gradient_checkpointing": True})
    source = same_as_catalog(f, key)
    read = {i["key"]: i["as"] for i in source["read"]}
    assert read["model_name_or_path"] == f"--model {key} (the catalog entry listing {hub_id})"
    assert ["--model", key] == source["as_flags"][source["as_flags"].index("--model"):][:2]


@pytest.mark.parametrize("hub_id, key", [("meta-llama/Meta-Llama-3-8B", "llama-3-8b"), ("Qwen/Qwen3-4B", "qwen3-4b"),
                                         ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b-2507")])
def test_llama_factory_yaml_naming_a_hub_id(hub_id, key, tmp_path):
    same_as_catalog(write(tmp_path / "lf.yaml", lf(hub_id)), key)


def test_axolotl_yaml_naming_a_hub_id(tmp_path):
    cfg = yaml.safe_load((DATA / "axolotl_qlora.yaml").read_text()) | {"base_model": "Qwen/Qwen3-4B"}
    same_as_catalog(write(tmp_path / "qlora.yaml", cfg), "qwen3-4b")


def test_shardwise_yaml_naming_a_hub_id(tmp_path):
    example = yaml.safe_load((ROOT / "examples" / "fsdp-synthetic-cpu.yaml").read_text())
    example["model"] = {"name": "Qwen/Qwen3-0.6B"}
    got = plan(str(write(tmp_path / "run.yaml", example)))  # a CPU run: the host plan
    assert got["title"].startswith("qwen3-0.6b (0.60B params) on 2 CPU rank(s)")


def test_an_id_outside_the_catalog_plans_from_the_hugging_face_cache(hub_cache, tmp_path):  # noqa: F811
    path = fake_hub_cache(hub_cache, "acme/tiny-chat", TINY)
    got = plan("--from", str(write(tmp_path / "lf.yaml", lf("acme/tiny-chat"))))
    read = {i["key"]: i["as"] for i in got["from"]["read"]}
    assert read["model_name_or_path"] == f"--model acme/tiny-chat (its config.json: {path})"
    assert got["model"]["name"] == "acme/tiny-chat"
    assert got["model"]["params"] == plan("--model-config", str(path))["model"]["params"]


def test_an_id_neither_in_the_catalog_nor_cached_is_refused_naming_file_line_and_key(hub_cache, tmp_path):  # noqa: F811
    f = write(tmp_path / "args.json", {"output_dir": "o", "per_device_train_batch_size": 2,
                                       "model_name_or_path": "acme/elsewhere"})
    msg = refused("--from", str(f))
    assert "args.json:1: model_name_or_path = 'acme/elsewhere'" in msg and "HF_HUB_OFFLINE" in msg
    assert "--model-config DIR/config.json" in msg


def test_a_hub_config_with_its_own_code_needs_the_files_trust_remote_code(hub_cache, tmp_path):  # noqa: F811
    marker = tmp_path / "ran"
    path = fake_hub_cache(hub_cache, "acme/own-code", {**TINY, "auto_map": AUTO_MAP},
                          {"custom_code.py": CODE.format(marker=str(marker))})
    msg = refused("--from", str(write(tmp_path / "lf.yaml", lf("acme/own-code"))))
    assert "lf.yaml:1: model_name_or_path = 'acme/own-code'" in msg and "field 'auto_map'" in msg
    assert "set trust_remote_code: true in lf.yaml" in msg
    # asked for in the file: planned as transformers' own class, from the file read (plan has no
    # flag that trusts code, so the same plan as flags names the config.json)
    got = plan("--from", str(write(tmp_path / "lf.yaml", lf("acme/own-code", trust_remote_code=True))))
    assert ["--model-config", str(path)] == got["from"]["as_flags"][got["from"]["as_flags"].index("--model-config"):][:2]
    assert "transformers' own class" in {i["key"]: i["as"] for i in got["from"]["read"]}["trust_remote_code"]
    assert got["model"]["params"] == plan("--model-config", str(path))["model"]["params"]
    assert not marker.exists()
