"""`shardwise plan --model ORG/NAME` as a user runs it (a subprocess, its environment the only
input): a catalog model's Hugging Face id plans without another flag and without the cache or
the Hub; an id outside the catalog plans from its config.json in the Hugging Face cache that
HF_HUB_CACHE names; offline and not cached, or a config.json that ships code, is refused with
exit 2, naming the id and the ways out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.specs.test_model_names import AUTO_MAP, TINY, fake_hub_cache

ROOT = Path(__file__).resolve().parents[2]


def shardwise(args: list[str], cache: Path, *, home: bool = False) -> subprocess.CompletedProcess:
    """The CLI with the Hugging Face cache at `cache`: HF_HUB_CACHE names it, or (`home`)
    HF_HOME names its parent (the cache is HF_HOME/hub)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_HOME", "HUGGINGFACE_HUB_CACHE")}
    env |= {"HF_HOME": str(cache.parent)} if home else {"HF_HUB_CACHE": str(cache)}
    env |= {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=120, check=False, cwd=ROOT, env=env)


@pytest.mark.parametrize("hub_id, key, params", [("Qwen/Qwen3-4B", "qwen3-4b", 4_022_468_096),
                                                 ("meta-llama/Meta-Llama-3-8B", "llama-3-8b", 8_030_261_248)])
def test_a_catalog_models_hub_id_plans_without_another_flag(hub_id, key, params, tmp_path):
    r = shardwise(["plan", "--model", hub_id, "--json"], tmp_path)  # an empty cache: not needed
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert (got["model"]["name"], got["model"]["params"]) == (key, params)
    assert got["recommended"]


@pytest.mark.parametrize("home", [False, True], ids=["HF_HUB_CACHE", "HF_HOME"])
def test_an_id_outside_the_catalog_plans_from_the_hugging_face_cache(home, tmp_path):
    cache = tmp_path / "hub"
    path = fake_hub_cache(cache, "acme/tiny-chat", TINY)
    r = shardwise(["plan", "--model", "acme/tiny-chat", "--gpus", "2", "--json"], cache, home=home)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)["model"]
    r = shardwise(["plan", "--model-config", str(path), "--gpus", "2", "--json"], cache)
    assert got["name"] == "acme/tiny-chat" and got["params"] == json.loads(r.stdout)["model"]["params"]


def test_offline_and_not_cached_is_refused_naming_the_id_and_the_ways_out(tmp_path):
    r = shardwise(["plan", "--model", "acme/not-here"], tmp_path)
    err = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and "Traceback" not in err, err
    assert "'acme/not-here'" in err and "--model-config DIR/config.json" in err and "HF_HUB_OFFLINE" in err
    assert "hf download acme/not-here config.json" in err


def test_a_cached_config_that_ships_code_is_refused(tmp_path):
    fake_hub_cache(tmp_path, "acme/own-code", {**TINY, "auto_map": AUTO_MAP})
    r = shardwise(["plan", "--model", "acme/own-code"], tmp_path)
    err = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and "Traceback" not in err, err
    assert "'acme/own-code'" in err and "field 'auto_map'" in err and "never runs" in err and "--model-config" in err
