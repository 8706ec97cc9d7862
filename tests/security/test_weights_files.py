"""A model directory's weights files are opened by preflight, before any rank starts, as rank 0
would open them: a crafted `.bin` (a pickle naming code, a non-zip, a compressed or oversized
pickle, something other than a state dict) and a malformed safetensors file (a header length
beyond the file, bad JSON, offsets beyond the file or overlapping, a dtype and shape that do not
fit the bytes), and an index naming files outside the directory, are each one ShardwiseError
naming the file; no code runs (a marker file never appears) and no claimed length is allocated.
A model's config.json with a NaN epsilon or a negative RoPE factor is refused there too."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardwise.config.load import load_config
from shardwise.errors import ShardwiseError
from shardwise.train.preflight import preflight

REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = REPO / "examples" / "fsdp-synthetic-cpu.yaml"
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 176, "vocab_size": 2048,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}  # fmt: skip


class Payload:
    """Pickles as a call of os.system that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def model_dir(root: Path, **over) -> Path:
    d = root / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA | over))
    return d


def refused_at_preflight(d: Path, tmp_path: Path, *fragments: str, random_init: bool = False) -> str:
    cfg = load_config(SYNTHETIC, [f"model.path={d}", f"model.random_init={str(random_init).lower()}",
                                  f"checkpointing.output_dir={tmp_path / 'out'}", "logging.trackers=[]"])  # fmt: skip
    with pytest.raises(ShardwiseError) as e:
        preflight(cfg, 1, "cpu")
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def safetensors_bytes(header: dict | bytes, data: bytes = b"") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


# ---------------------------------------------------------------- .bin


def test_bin_whose_pickle_calls_os_system_is_refused_at_preflight_and_runs_nothing(tmp_path):
    d = model_dir(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "evil": Payload(marker)}, d / "pytorch_model.bin")
    refused_at_preflight(d, tmp_path, f"model.path '{d}'", str(d / "pytorch_model.bin"), "weights_only=True")
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["not_zip", "compressed", "list", "big_pickle", "two_pickles"])
def test_bin_that_is_not_a_stored_torch_state_dict_is_refused(tmp_path, kind):
    d = model_dir(tmp_path)
    f = d / "pytorch_model.bin"
    if kind == "not_zip":
        f.write_bytes(pickle.dumps({"w": [1.0, 2.0]}))
        fragment = "not a PyTorch zip archive"
    elif kind == "list":
        torch.save([torch.zeros(2)], f)
        fragment = "not a state dict"
    else:
        torch.save({"w": torch.zeros(2)}, tmp_path / "good.bin")
        with zipfile.ZipFile(tmp_path / "good.bin") as src, zipfile.ZipFile(f, "w") as dst:
            for m in src.infolist():
                data = src.read(m)
                if kind == "big_pickle" and m.filename.endswith("data.pkl"):
                    dst.writestr(m, data)
                    dst.writestr(m.filename.rsplit("/", 1)[0] + "/pad", b"")
                    continue
                dst.writestr(m, data, compress_type=zipfile.ZIP_DEFLATED if kind == "compressed" else m.compress_type)
            if kind == "two_pickles":
                dst.writestr("other/data.pkl", pickle.dumps({}))
        if kind == "big_pickle":  # claim a 1 GiB pickle in the zip's directory
            raw = bytearray(f.read_bytes())
            with zipfile.ZipFile(f) as z:
                info = next(m for m in z.infolist() if m.filename.endswith("data.pkl"))
            central = raw.rfind(b"PK\x01\x02", 0, raw.find(b"PK\x05\x06"))
            while not raw[central + 46: central + 46 + len(info.filename)] == info.filename.encode():
                central = raw.rfind(b"PK\x01\x02", 0, central)
            raw[central + 24: central + 28] = struct.pack("<I", 1 << 30)  # uncompressed size
            f.write_bytes(bytes(raw))
        fragment = {"compressed": "compressed records", "big_pickle": "over 256 MiB",
                    "two_pickles": "2 data.pkl records"}[kind]  # fmt: skip
    refused_at_preflight(d, tmp_path, str(f), fragment)


def test_bin_whose_zip_needs_a_newer_zip_version_is_refused(tmp_path):
    """Found by tests/security/test_fuzz_weights_files.py: zipfile's NotImplementedError for a
    central directory entry claiming zip version 6.4 escaped as a traceback."""
    d = model_dir(tmp_path)
    f = d / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2)}, f)
    raw = bytearray(f.read_bytes())
    central = raw.find(b"PK\x01\x02")
    raw[central + 6: central + 8] = struct.pack("<H", 64)  # version needed to extract: 6.4
    f.write_bytes(bytes(raw))
    refused_at_preflight(d, tmp_path, str(f), "not a PyTorch zip archive", "zip file version 6.4")


def test_a_good_bin_and_a_good_safetensors_pass_the_check(tmp_path):
    from shardwise.train.model.weights_read import check_files

    a = tmp_path / "a"
    a.mkdir()
    torch.save({"w": torch.ones(3, 2)}, a / "pytorch_model.bin")
    b = tmp_path / "b"
    b.mkdir()
    save_file({"w": torch.ones(3, 2)}, str(b / "model.safetensors"))
    assert (check_files(a), check_files(b)) == ("bin", "safetensors")


def test_cli_refuses_a_crafted_bin_before_any_rank_starts(tmp_path):
    d = model_dir(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"evil": Payload(marker)}, d / "pytorch_model.bin")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "shardwise.train.cli", str(SYNTHETIC), "--nproc", "1"]
    for s in (f"model.path={d}", f"checkpointing.output_dir={out}", "logging.trackers=[]", "logging.progress=false"):
        argv += ["--set", s]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, check=False)
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout[-1500:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and str(d / "pytorch_model.bin") in msg, r.stderr[-3000:]
    assert not (out / ".shardwise" / "heartbeat").exists() and not (out / "metrics.jsonl").exists(), "a rank started"
    assert not marker.exists()


# ---------------------------------------------------------------- safetensors


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(("content", "fragment"), [
    (struct.pack("<Q", 1 << 62) + b"{}", "header length 4611686018427387904 bytes, beyond the file"),
    (struct.pack("<Q", 64) + b"{}", "header length 64 bytes, beyond the file"),
    (b"\x01\x02", "shorter than a safetensors header"),
    (safetensors_bytes(b'{"w": {"dtype": "F32",', bytes(16)), "cannot be read as safetensors"),
    (safetensors_bytes({"w": {**F32_2x2, "data_offsets": [0, 1 << 40]}}, bytes(16)), "cannot be read as safetensors"),
    (safetensors_bytes({"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [8, 24]}}, bytes(24)),
     "cannot be read as safetensors"),
    (safetensors_bytes({"w": {**F32_2x2, "shape": [4, 4]}}, bytes(16)), "cannot be read as safetensors"),
    (safetensors_bytes({"w": {**F32_2x2, "dtype": "X99"}}, bytes(16)), "cannot be read as safetensors"),
], ids=["huge_header_length", "header_past_end", "truncated", "bad_json", "offsets_past_end", "overlap",
        "shape_mismatch", "bad_dtype"])  # fmt: skip
def test_malformed_safetensors_is_refused_at_preflight_naming_the_file(tmp_path, content, fragment):
    d = model_dir(tmp_path)
    (d / "model.safetensors").write_bytes(content)
    refused_at_preflight(d, tmp_path, str(d / "model.safetensors"), fragment)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/dir.safetensors", ".."])
def test_index_naming_a_file_outside_the_directory_is_refused(tmp_path, name):
    d = model_dir(tmp_path)
    save_file({"w": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    refused_at_preflight(d, tmp_path, str(d / "model.safetensors.index.json"), "expected file names in")


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize(("over", "fragment"), [
    ({"rms_norm_eps": float("nan")}, "field 'rms_norm_eps' = nan: expected a finite number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -1.0}}, "field 'rope_scaling.factor' = -1.0: expected a "
                                                                "number above 0"),
    ({"rope_theta": float("inf")}, "field 'rope_theta' = inf"),
    ({"rms_norm_eps": 0}, "field 'rms_norm_eps' = 0: expected a number above 0"),
    ({"num_key_value_heads": 3}, "field 'num_key_value_heads' = 3: expected a divisor of num_attention_heads (4)"),
    ({"hidden_size": 66, "head_dim": None}, "field 'num_attention_heads' = 4: expected a divisor of hidden_size"),
    ({"vocab_size": True}, "field 'vocab_size' = True: expected an integer"),
    ({"attention_dropout": 2.0}, "field 'attention_dropout' = 2.0: expected a probability"),
], ids=["eps_nan", "rope_factor_negative", "rope_theta_inf", "eps_zero", "kv_heads", "heads_width", "vocab_bool",
        "dropout"])  # fmt: skip
def test_config_json_value_no_model_is_built_from_is_refused_at_preflight(tmp_path, over, fragment):
    d = model_dir(tmp_path, **over)
    refused_at_preflight(d, tmp_path, f"model.path '{d}'", str(d / "config.json"), fragment, random_init=True)
