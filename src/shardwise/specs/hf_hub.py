"""A Hugging Face model id (`ORG/NAME`) that is not in the catalog: its config.json from the
local Hugging Face cache or the Hub, read by the reader of local files
(`ModelSpec.from_hf_config`, shardwise.specs.hf_config and hf_values' checks).

- the cache first: `huggingface_hub.try_to_load_from_cache(repo_id, "config.json")`, in the
  cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub; huggingface_hub reads them when it
  is imported). A cached file is used as it is, however old;
- then, unless the Hub is off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set truthy, as
  huggingface_hub reads them), `huggingface_hub.hf_hub_download(repo_id, "config.json")`: that
  one file into the cache, never weights or code.

A config.json with `auto_map` names Python code the model ships. shardwise runs no checkpoint
code: it would plan transformers' own class for the config's model_type, which need not be the
model that code builds, so such a config is refused unless the caller says the user asked for
it (`trust_remote_code`: a `plan --from` file's own `trust_remote_code: true`). Torch-free;
huggingface_hub is imported only here, inside functions.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.errors import ShardwiseError
from shardwise.specs.hf_config import read_config_json

if TYPE_CHECKING:
    from shardwise.specs.model import ModelSpec

# huggingface_hub's repo ids: ORG/NAME of letters, digits, '-', '_', '.', no '--' or '..', at
# most 96 characters (huggingface_hub.utils.validate_repo_id).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_ID = 96
# The values huggingface_hub reads as true in an environment switch (constants._is_true).
_TRUE = {"1", "ON", "YES", "TRUE"}
# What a user can do when no config.json could be had (plan's flag; the trainer's model.path).
LOCAL_COPY = "pass a local copy of its config.json (--model-config DIR/config.json; the trainer: model.path)"
# How a refused `auto_map` can be planned anyway, for callers with no switch of their own.
NO_REMOTE_CODE = ("to plan transformers' own class for it anyway, pass a local copy of its config.json "
                  "(--model-config DIR/config.json; the trainer: model.path with model.trust_remote_code: true)")


def is_hub_id(name: str) -> bool:
    """Whether `name` is written as a Hugging Face model id, ORG/NAME."""
    return (len(name) <= _MAX_ID and _HUB_ID.fullmatch(name) is not None
            and "--" not in name and ".." not in name)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE) set truthy, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def config_path(repo_id: str) -> tuple[Path, str]:
    """(the config.json of `repo_id`, where it came from: "cache" or "hub"), or the
    ShardwiseError naming the id and what to do instead."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        raise ShardwiseError(f"model {repo_id!r} is not in shardwise's catalog, and reading a Hugging Face id's "
                             f"config.json needs huggingface_hub (pip install huggingface_hub, or shardwise[train]); "
                             f"or {LOCAL_COPY}") from None
    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):  # (a marker object means "known missing": not a file)
        return Path(cached), "cache"
    import huggingface_hub.constants as hub_constants

    where = hub_constants.HF_HUB_CACHE
    if hub_offline():
        raise ShardwiseError(
            f"model {repo_id!r} is not in shardwise's catalog and its config.json is not in the Hugging Face "
            f"cache ({where}), and the Hub is off (HF_HUB_OFFLINE): {LOCAL_COPY}, or put it in the cache "
            f"first (`hf download {repo_id} config.json`, or run once without HF_HUB_OFFLINE)")
    from huggingface_hub import errors

    try:
        return Path(hf_hub_download(repo_id, "config.json")), "hub"
    except errors.GatedRepoError:
        raise ShardwiseError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its license there and log "
                             f"in (`hf auth login`, or HF_TOKEN) to read its config.json, or {LOCAL_COPY}") from None
    except errors.RepositoryNotFoundError:
        raise ShardwiseError(f"model {repo_id!r}: no such model on the Hugging Face Hub (or a private one: log in "
                             f"with `hf auth login`); check the id (ORG/NAME, as on huggingface.co), or "
                             f"{LOCAL_COPY}") from None
    except errors.LocalEntryNotFoundError:  # the Hub could not be reached (before the generic "not found")
        raise ShardwiseError(_unreachable(repo_id, "the Hub could not be reached")) from None
    except errors.EntryNotFoundError:
        raise ShardwiseError(f"model {repo_id!r} has no config.json on the Hugging Face Hub (not a transformers "
                             f"model?): {LOCAL_COPY}") from None
    except Exception as e:  # the network, a proxy, a server error: nothing read
        raise ShardwiseError(_unreachable(repo_id, f"{type(e).__name__}: {e}")) from None


def _unreachable(repo_id: str, why: str) -> str:
    why = why if len(why) <= 200 else why[:200] + "..."
    return (f"model {repo_id!r} is not in shardwise's catalog or the Hugging Face cache, and downloading its "
            f"config.json failed ({why}): {LOCAL_COPY}, or set HF_HUB_OFFLINE=1 to use only the cache")


def spec_from_hub(repo_id: str, *, trust_remote_code: bool = False,
                  opt_in: str | None = None) -> tuple[ModelSpec, Path]:
    """The ModelSpec of `repo_id`'s config.json (config_path), named by the id, and the file it
    read. A config.json with `auto_map` is refused unless `trust_remote_code`; `opt_in` says how
    the caller's user asks for it (default NO_REMOTE_CODE)."""
    from shardwise.specs.model import ModelSpec

    path, origin = config_path(repo_id)
    cfg, path = read_config_json(path)  # bounded, values checked (hf_values): the same reader as --model-config
    auto_map = cfg.get("auto_map")
    if auto_map and not trust_remote_code:
        shown = json.dumps(auto_map)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        raise ShardwiseError(
            f"model {repo_id!r}: {path} (from the Hugging Face {origin}): field 'auto_map' is {shown}: the model "
            f"ships its own Python code, which shardwise never runs, and a plan of transformers' own "
            f"{cfg.get('model_type')!r} class may not be the model that code builds; {opt_in or NO_REMOTE_CODE}")
    return ModelSpec.from_hf_config(path, name=repo_id), path
