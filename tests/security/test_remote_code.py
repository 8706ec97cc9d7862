"""Nothing from a file runs code.

A tokenizer or model directory with an `auto_map` names a Python file of its own. transformers
imports it when `trust_remote_code` is True, and when it is not given at all it *asks on stdin*
("run the custom code? [y/N]"), so `echo y | shardwise train ...` used to run the directory's
code. Every call now passes `model.trust_remote_code` explicitly (off by default) and such a
directory is refused before any rank starts, with exit 2 and a message naming the file, the
`auto_map` and how to opt in. The Python file here would create a marker file when imported.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardwise.data import default_tokenizer_path

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"
RECORD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}
# A tiny llama config.json (tiny enough to build at random init in a second, were it ever built).
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 2048,
         "max_position_embeddings": 256}  # fmt: skip
CODE = '''\
import pathlib
pathlib.Path({marker!r}).write_text("the directory's own code ran")
from transformers import LlamaConfig, PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    pass


class CustomConfig(LlamaConfig):
    model_type = "custom-llama"
'''


def env(tmp_path: Path) -> dict[str, str]:
    # HF_MODULES_CACHE: where transformers copies a directory's code before importing it
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
            "HF_MODULES_CACHE": str(tmp_path / "hf-modules"), "OMP_NUM_THREADS": "1"}  # fmt: skip


def tokenizer_copy(dst: Path) -> Path:
    shutil.copytree(default_tokenizer_path(), dst)
    return dst


def with_code(d: Path, marker: Path) -> Path:
    (d / "custom_code.py").write_text(CODE.format(marker=str(marker)))
    return d


def edit_json(path: Path, **fields) -> None:
    doc = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(doc | fields, indent=2))


def tokenizer_with_tokenizer_auto_map(root: Path, marker: Path) -> Path:
    """tokenizer_config.json names the directory's own tokenizer class."""
    d = with_code(tokenizer_copy(root / "tok-tokenizer-auto-map"), marker)
    edit_json(d / "tokenizer_config.json", tokenizer_class="CustomTokenizer",
              auto_map={"AutoTokenizer": [None, "custom_code.CustomTokenizer"]})
    return d


def tokenizer_with_config_auto_map(root: Path, marker: Path) -> Path:
    """No tokenizer_class in tokenizer_config.json: transformers reads config.json, whose auto_map
    names the directory's own config and tokenizer classes."""
    d = with_code(tokenizer_copy(root / "tok-config-auto-map"), marker)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("tokenizer_class")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    edit_json(d / "config.json", model_type="custom-llama",
              auto_map={"AutoConfig": "custom_code.CustomConfig",
                        "AutoTokenizer": [None, "custom_code.CustomTokenizer"]})  # fmt: skip
    return d


def model_with_auto_map(root: Path, marker: Path) -> Path:
    """A model directory (trained at random init: no weights needed) whose config.json has an
    auto_map; its tokenizer is the bundled one, clean."""
    d = with_code(tokenizer_copy(root / "model-auto-map"), marker)
    edit_json(d / "config.json", **LLAMA, auto_map={"AutoConfig": "custom_code.CustomConfig",
                                                     "AutoModelForCausalLM": "custom_code.CustomModel"})
    return d


def model_with_tokenizer_auto_map(root: Path, marker: Path) -> Path:
    """A clean config.json, but the model directory's tokenizer (the one trained with) has an auto_map."""
    d = tokenizer_with_tokenizer_auto_map(root, marker)
    edit_json(d / "config.json", **LLAMA)
    return d.rename(root / "model-tokenizer-auto-map")


def train_config(tmp_path: Path, *, tokenizer: Path | None = None, model: Path | None = None) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(RECORD) + "\n" for _ in range(8)))
    raw = {"model": {"name": "tiny-llama"} if model is None else {"path": str(model), "random_init": True},
           "precision": "fp32", "data": {"kind": "sft", "sft": {"train_files": [str(data)], "max_length": 32}},
           "run": {"micro_batch": 1, "grad_accum": 1, "device": "cpu", "steps": 1, "nproc": 1},
           "checkpointing": {"output_dir": str(tmp_path / "out")}}  # fmt: skip
    if tokenizer is not None:
        raw["data"]["tokenizer"] = str(tokenizer)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def shardwise(args: list[str], tmp_path: Path, stdin: str | None = "y\n" * 5) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, answering "y" to any prompt (the old bypass)."""
    return subprocess.run([sys.executable, "-m", "shardwise.cli.app", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, check=False, env=env(tmp_path),
                          stdin=subprocess.DEVNULL if stdin is None else None)  # fmt: skip


def assert_refused(r: subprocess.CompletedProcess, marker: Path, file: Path, opt_in: str) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert not marker.exists(), "the directory's code ran"
    assert "Traceback" not in out and "[y/N]" not in out, out[-3000:]  # refused by us, never asked
    message = " ".join(r.stderr.split())  # the console soft-wraps nothing, but be robust to it
    for fragment in (str(file), "auto_map", opt_in):
        assert fragment in message, f"{fragment!r} not in: {message}"


# ------------------------------------------------------------------ the fixtures are dangerous


@pytest.mark.parametrize("make", [tokenizer_with_tokenizer_auto_map, tokenizer_with_config_auto_map])
def test_the_fixture_runs_its_code_when_transformers_is_told_yes(tmp_path, make):
    """Without shardwise in between, transformers' own prompt, answered "y", runs the directory's
    code: what the tests below refuse is real."""
    marker = tmp_path / "MARKER"
    d = make(tmp_path, marker)
    code = f"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({str(d)!r}, local_files_only=True)"
    r = subprocess.run([sys.executable, "-c", code], input="y\n", capture_output=True, text=True, timeout=300,
                       check=False, env=env(tmp_path))  # fmt: skip
    assert marker.exists(), (r.stdout + r.stderr)[-3000:]


# ------------------------------------------------------------------ refused before any rank starts


@pytest.mark.parametrize("case", ["tokenizer auto_map", "tokenizer config.json auto_map", "model auto_map",
                                  "model's tokenizer auto_map"])  # fmt: skip
def test_train_refuses_code_from_a_directory_before_any_rank_starts(tmp_path, case):
    marker = tmp_path / "MARKER"
    if case == "tokenizer auto_map":
        d = tokenizer_with_tokenizer_auto_map(tmp_path, marker)
        cfg, file = train_config(tmp_path, tokenizer=d), d / "tokenizer_config.json"
    elif case == "tokenizer config.json auto_map":
        d = tokenizer_with_config_auto_map(tmp_path, marker)
        cfg, file = train_config(tmp_path, tokenizer=d), d / "config.json"
    elif case == "model auto_map":
        d = model_with_auto_map(tmp_path, marker)
        cfg, file = train_config(tmp_path, model=d), d / "config.json"
    else:
        d = model_with_tokenizer_auto_map(tmp_path, marker)
        cfg, file = train_config(tmp_path, model=d), d / "tokenizer_config.json"
    r = shardwise(["train", str(cfg)], tmp_path)
    assert_refused(r, marker, file, "model.trust_remote_code: true")
    # before any rank: no output directory, no heartbeats, no data cache
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make, name", [(tokenizer_with_tokenizer_auto_map, "tokenizer_config.json"),
                                        (tokenizer_with_config_auto_map, "config.json"),
                                        (model_with_auto_map, "config.json")])  # fmt: skip
def test_data_inspect_refuses_a_tokenizer_that_ships_code(tmp_path, make, name):
    marker = tmp_path / "MARKER"
    d = make(tmp_path, marker)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(RECORD) + "\n")
    r = shardwise(["data", "inspect", str(data), "--tokenizer", str(d)], tmp_path)
    assert_refused(r, marker, d / name, "--trust-remote-code")
    assert "model.trust_remote_code" in r.stderr


def test_trust_remote_code_opted_in_passes_through_without_reading_stdin(tmp_path):
    """The user's choice is passed on: the code runs, and nothing is read from stdin (closed
    here: transformers' prompt would fail on EOF)."""
    marker = tmp_path / "MARKER"
    d = tokenizer_with_tokenizer_auto_map(tmp_path, marker)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(RECORD) + "\n")
    r = shardwise(["data", "inspect", str(data), "--tokenizer", str(d), "--trust-remote-code", "--plain"],
                  tmp_path, stdin=None)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert marker.exists() and "[y/N]" not in r.stdout + r.stderr
    assert "⟦4.<|end|>⟧" in r.stdout  # the record, tokenised by the directory's own tokenizer class

    marker.unlink()
    code = (f"from shardwise.data import load_tokenizer; t = load_tokenizer({str(d)!r}, trust_remote_code=True); "
            "print(type(t).__name__)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=300, check=False, env=env(tmp_path))  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "CustomTokenizer", (r.stdout + r.stderr)[-3000:]


def test_load_tokenizer_refuses_in_process_and_names_the_opt_in(tmp_path):
    from shardwise.data import load_tokenizer
    from shardwise.errors import ShardwiseError

    marker = tmp_path / "MARKER"
    d = tokenizer_with_config_auto_map(tmp_path, marker)
    with pytest.raises(ShardwiseError) as info:
        load_tokenizer(d)
    msg = str(info.value)
    assert str(d / "config.json") in msg and "auto_map" in msg and "custom_code.CustomConfig" in msg
    assert "model.trust_remote_code: true" in msg and not marker.exists()


# ------------------------------------------------------------------ every call is explicit


def _calls(tree: ast.AST):
    """(call, enclosing function source names) for every from_pretrained/from_config call."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("from_pretrained", "from_config"):  # fmt: skip
                yield fn, node


def test_every_from_pretrained_and_from_config_call_passes_trust_remote_code():
    """A static check of src/: each transformers loader call names trust_remote_code, directly
    or through a **kwargs dict whose literal holds the key (train/model/build.py's `kw`)."""
    seen, missing = 0, []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn, call in _calls(tree):
            if isinstance(fn, ast.Module):
                continue  # every call is inside a function; walked again there
            seen += 1
            names = {k.arg for k in call.keywords}
            spread = [k.value for k in call.keywords if k.arg is None]
            ok = "trust_remote_code" in names or any(
                isinstance(v, ast.Name) and any(
                    isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id == v.id for t in a.targets)
                    and isinstance(a.value, ast.Dict)
                    and any(isinstance(k, ast.Constant) and k.value == "trust_remote_code" for k in a.value.keys)
                    for a in ast.walk(fn))
                for v in spread)  # fmt: skip
            if not ok:
                missing.append(f"{path.relative_to(SRC.parent)}:{call.lineno}")
    assert seen >= 6, seen  # hf_meta, train/model (4), bench/saved, data (AutoTokenizer)
    assert missing == [], missing
