"""Model names people use: a catalog key or a Hugging Face id resolves to a ModelSpec in one
place (shardwise.catalog.find_model): the catalog by its key or the ids each entry lists, else
the id's config.json from the local Hugging Face cache, else (online) downloaded from the Hub,
config.json only. The cache here is a fake one laid out as huggingface_hub lays it
(models--ORG--NAME/refs/main and snapshots/REV/config.json); nothing reaches the Hub (the suite
runs with HF_HUB_OFFLINE=1; the download tests stand a fake hf_hub_download in)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise import catalog
from shardwise.errors import ShardwiseError
from shardwise.specs import ModelSpec, hf_hub

REV = "0123456789abcdef0123456789abcdef01234567"
# A small llama of no published model (so in no catalog entry), and the same with code of its own.
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 512,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
AUTO_MAP = {"AutoConfig": "custom_code.CustomConfig", "AutoModelForCausalLM": "custom_code.CustomModel"}
CODE = "import pathlib\npathlib.Path({marker!r}).write_text('the model code ran')\n"


def fake_hub_cache(root: Path, repo_id: str, config: dict, files: dict[str, str] | None = None) -> Path:
    """Lay `repo_id`'s config.json (and any other files) into a Hugging Face cache at `root` as
    huggingface_hub does (models--ORG--NAME/refs/main -> REV, snapshots/REV/...); the config's path."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    (snap / "config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (snap / name).write_text(text)
    return snap / "config.json"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, the one huggingface_hub uses in this process (it reads
    HF_HUB_CACHE when imported, so its constant is set too)."""
    import huggingface_hub.constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    return root


def no_hub(*args, **kwargs):
    raise AssertionError("the Hub was asked")


def test_every_entry_names_its_ids_and_source():
    """Each published shape lists the Hugging Face ids it resolves (each written as one, under one
    entry) and where its values were read; only the tiny test shapes have none."""
    ids = catalog._hub_ids()  # builds the index: an unknown key or an id listed twice is refused
    for key in catalog.model_names():
        listed, entry = catalog.model_hub_ids(key), catalog._models()[key]
        if key.startswith("tiny-"):
            assert not listed and "source" not in entry, key
            continue
        assert listed and entry.get("source"), key
        assert all(hf_hub.is_hub_id(i) and ids[i.lower()] == key for i in listed), key


@pytest.mark.parametrize("name, key", [
    ("Qwen/Qwen3-4B", "qwen3-4b"),
    ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
    ("meta-llama/Llama-3.2-3B", "llama-3.2-3b"),
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b-2507"),
    ("mistralai/Mixtral-8x22B-v0.1", "mixtral-8x22b"),
    ("mistralai/Mistral-7B-v0.3", "mistral-7b-v0.3"),  # not the v0.1 shape a name-stripping guess gave
    ("alignment-handbook/zephyr-7b-sft-full", "zephyr-7b"),
    ("google/gemma-3-4b-it", "gemma-3-4b"),
    ("QWEN/qwen3-4b", "qwen3-4b"),  # ids are matched without regard to case
    (" qwen3-4b ", "qwen3-4b"),  # and keys as before
])
def test_catalog_ids_resolve_without_the_cache_or_hub(name, key, monkeypatch):
    monkeypatch.setattr(hf_hub, "config_path", no_hub)
    spec, path = catalog.find_model(name)
    assert (spec.name, path) == (key, None)
    assert catalog.get_model(name) == catalog.get_model(key)


def test_a_cached_id_outside_the_catalog_is_read_from_the_cache(hub_cache):
    path = fake_hub_cache(hub_cache, "acme/tiny-chat", TINY)
    spec, read = catalog.find_model("acme/tiny-chat")
    assert read == path
    assert spec.name == "acme/tiny-chat"  # named by the id, not the directory
    assert spec.params == ModelSpec.from_hf_config(path).params == ModelSpec.from_hf_dict(TINY).params


def test_a_cached_config_goes_through_the_readers_checks(hub_cache):
    fake_hub_cache(hub_cache, "acme/bad-eps", {**TINY, "rms_norm_eps": -1})
    with pytest.raises(ShardwiseError, match=r"models--acme--bad-eps.*config.json: field 'rms_norm_eps' = -1"):
        catalog.get_model("acme/bad-eps")


def test_offline_and_not_cached_names_the_id_and_the_ways_out(hub_cache):
    with pytest.raises(ShardwiseError) as e:
        catalog.get_model("acme/not-downloaded")
    msg = str(e.value)
    assert "'acme/not-downloaded'" in msg and str(hub_cache) in msg and "HF_HUB_OFFLINE" in msg
    assert "--model-config DIR/config.json" in msg and "hf download acme/not-downloaded config.json" in msg
    # a re-upload named like a catalog model: offered as a hint, never taken silently
    with pytest.raises(ShardwiseError, match=r"the catalog has 'llama-3.2-3b': --model llama-3.2-3b"):
        catalog.get_model("unsloth/Llama-3.2-3B-Instruct")


def test_auto_map_is_refused_unless_trusted_and_its_code_never_runs(hub_cache, tmp_path):
    marker = tmp_path / "ran"
    fake_hub_cache(hub_cache, "acme/own-code", {**TINY, "auto_map": AUTO_MAP},
                   {"custom_code.py": CODE.format(marker=str(marker))})
    with pytest.raises(ShardwiseError) as e:
        catalog.get_model("acme/own-code")
    msg = str(e.value)
    assert "'acme/own-code'" in msg and "field 'auto_map'" in msg and "custom_code.CustomModel" in msg
    assert "never runs" in msg and "--model-config DIR/config.json" in msg
    with pytest.raises(ShardwiseError, match=r"set trust_remote_code: true in run\.yaml"):
        catalog.find_model("acme/own-code", opt_in="set trust_remote_code: true in run.yaml")
    # asked for: planned as transformers' own llama, still without running the checkpoint's code
    spec, _ = catalog.find_model("acme/own-code", trust_remote_code=True)
    assert spec.family == "llama" and spec.params == ModelSpec.from_hf_dict(TINY).params
    assert not marker.exists()


def test_online_reads_config_json_only(hub_cache, tmp_path, monkeypatch):
    """Not cached and not offline: huggingface_hub.hf_hub_download(repo_id, "config.json"), once."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    got = tmp_path / "downloaded" / "config.json"
    got.parent.mkdir()
    got.write_text(json.dumps(TINY))
    calls = []

    def download(*args, **kwargs):
        calls.append((args, kwargs))
        return str(got)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    spec, path = catalog.find_model("acme/online-only")
    assert calls == [(("acme/online-only", "config.json"), {})]
    assert (spec.name, path) == ("acme/online-only", got)


@pytest.mark.parametrize("failure, says", [
    ("unreachable", ["the Hub could not be reached", "--model-config", "HF_HUB_OFFLINE=1"]),
    ("network", ["ConnectionError: no route", "--model-config", "HF_HUB_OFFLINE=1"]),
    ("gated", ["gated on the Hugging Face Hub", "hf auth login", "--model-config"]),
    ("missing", ["no such model on the Hugging Face Hub", "--model-config"]),
])
def test_a_failed_download_names_the_id_and_what_to_do(failure, says, hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    def http_error(cls: type, text: str) -> Exception:  # its __init__ wants the HTTP response: not needed here
        err = cls.__new__(cls)
        err.args = (text,)
        return err

    monkeypatch.delenv("HF_HUB_OFFLINE")
    raised = {"unreachable": lambda: errors.LocalEntryNotFoundError("cannot find the requested files"),
              "network": lambda: ConnectionError("no route"),
              "gated": lambda: http_error(errors.GatedRepoError, "401 gated"),
              "missing": lambda: http_error(errors.RepositoryNotFoundError, "404 not found")}[failure]()

    def download(*args, **kwargs):
        raise raised

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(ShardwiseError) as e:
        catalog.get_model("acme/somewhere")
    msg = str(e.value)
    assert "'acme/somewhere'" in msg and all(s in msg for s in says), msg


def test_without_huggingface_hub_an_id_outside_the_catalog_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` now fails
    assert catalog.get_model("Qwen/Qwen3-4B").name == "qwen3-4b"  # the catalog needs nothing
    with pytest.raises(ShardwiseError, match=r"'acme/x'.*needs huggingface_hub.*--model-config"):
        catalog.get_model("acme/x")


@pytest.mark.parametrize("name", ["llama-9", "/models/llama", "./acme/x", "acme/x/y", "acme--x/y", "gpt2"])
def test_other_names_are_refused_listing_the_catalog(name, monkeypatch):
    monkeypatch.setattr(hf_hub, "config_path", no_hub)
    with pytest.raises(ShardwiseError) as e:
        catalog.get_model(name)
    msg = str(e.value)
    assert f"unknown model {name!r}" in msg and "ORG/NAME" in msg and "llama-3.1-8b" in msg


def test_an_architecture_read_on_the_meta_device_resolves_from_the_cache(hub_cache):
    """gpt-oss and DeepSeek-V2 are no analytic family (not bundled: the catalog is torch-free);
    their ids resolve through the cache as any transformers decoder does (family hf)."""
    pytest.importorskip("transformers")
    cfg = {"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 300,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    fake_hub_cache(hub_cache, "acme/tiny-oss", cfg)
    spec = catalog.get_model("acme/tiny-oss")
    assert (spec.family, spec.name, spec.num_experts, spec.experts_per_token) == ("hf", "acme/tiny-oss", 4, 2)
    assert spec.inventory.layer_class == "GptOssDecoderLayer" and spec.active_params < spec.params
