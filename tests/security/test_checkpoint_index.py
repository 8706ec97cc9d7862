"""A checkpoint index (DCP's `.metadata`, a pickle) cannot run code.

- the allow-list is exactly what a fresh index needs (read off a real save, not copied);
- pickles of protocols 0-5 that reach os.system, builtins.exec, subprocess, torch.load, and
  dotted names through every admitted module (`torch.distributed.checkpoint.metadata` +
  `os.system`, protocol 4's attribute walk) are refused by name, and the marker file never
  appears;
- end to end, the issue's reproduction: a trained run's step-4 index replaced by the crafted
  pickle and its size and sha256 refreshed in manifest.json; `shardwise export` and
  `shardwise train --resume` (2 ranks) both exit 2 with one message before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hostile_runs import copy_run, train_args

from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint.directory import step_dir_name
from shardwise.train.checkpoint.index import UnsafeCheckpointError, _MetadataUnpickler, read_index
from shardwise.train.checkpoint.sharded import TrainerState, read_manifest, save_checkpoint

REPO = Path(__file__).resolve().parents[2]


class _Stand:
    """What save_checkpoint needs of an engine: canonical tensors of a few dtypes and shapes."""

    def checkpoint_state(self):
        return {"model.w": torch.ones(3, 4), "model.b": torch.zeros(5, dtype=torch.bfloat16),
                "optim.exp_avg.w": torch.zeros(3, 4), "model.n": torch.arange(3)}, {"optimizer_step": 1}


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return save_checkpoint(_Stand(), TrainerState(step=1, samples_consumed=1, global_batch=1), tmp_path,
                           config={}, strategy="ddp", keep_last=2)


def test_a_fresh_index_needs_exactly_admitted_names(checkpoint):
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(checkpoint / ".metadata", "rb") as f:
        Recording(f).load()
    assert seen, "the index names no class at all?"
    assert seen <= _MetadataUnpickler._ALLOWED, seen - _MetadataUnpickler._ALLOWED
    assert all("." not in name for _, name in _MetadataUnpickler._ALLOWED)  # no dotted name is admitted
    meta = read_index(checkpoint)
    assert set(meta.state_dict_metadata) == {"model.w", "model.b", "optim.exp_avg.w", "model.n"}


# --- hostile pickles ---------------------------------------------------------------------------


def _short(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _stack_global(module: str, name: str, arg: str, proto: int = 4) -> bytes:
    """PROTO n, module, name, STACK_GLOBAL, arg, TUPLE1, REDUCE, STOP: the issue's payload."""
    return b"\x80" + bytes([proto]) + _short(module) + _short(name) + b"\x93" + _short(arg) + b"\x85R."


def _global(module: str, name: str, arg: str, proto: int) -> bytes:
    """GLOBAL 'module\\nname\\n' (protocols 0-3): text pickles for 0-1, a PROTO header for 2-3."""
    head = b"" if proto < 2 else b"\x80" + bytes([proto])
    return head + f"c{module}\n{name}\n".encode() + b"(" + f"V{arg}\n".encode() + b"tR."


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker: Path) -> list[tuple[str, bytes]]:
    import builtins
    import subprocess as sp

    cmd = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    out = []
    for proto in range(6):  # what Python's own pickler writes for each protocol
        out += [(f"os.system/p{proto}", pickle.dumps(_Reduce(os.system, cmd), protocol=proto)),
                (f"exec/p{proto}", pickle.dumps(_Reduce(builtins.exec, code), protocol=proto)),
                (f"subprocess/p{proto}", pickle.dumps(_Reduce(sp.check_call, ["touch", str(marker)]), protocol=proto)),
                (f"eval/p{proto}", pickle.dumps(_Reduce(builtins.eval, code), protocol=proto))]
        out.append((f"torch.load/p{proto}", pickle.dumps(_Reduce(torch.load, str(marker)), protocol=proto)))
        if proto < 4:
            out.append((f"GLOBAL os.system/p{proto}", _global("os", "system", cmd, proto)))
            out.append((f"GLOBAL posix.system/p{proto}", _global("posix", "system", cmd, proto)))
    # protocol 4+ resolves dotted names attribute by attribute: through every admitted module
    modules = sorted({m for m, _ in _MetadataUnpickler._ALLOWED})
    for proto in (4, 5):
        for m in modules:
            for name in ("os.system", "sys.modules.os.system", "torch.os.system", "Size.__init__.__globals__"):
                out.append((f"{m}:{name}/p{proto}", _stack_global(m, name, cmd, proto)))
    out.append(("torch:os.system", _stack_global("torch", "os.system", cmd)))
    out.append(("dtype then os", _stack_global("torch", "float32.__class__", cmd)))
    return out


def test_hostile_indexes_are_refused_by_name(tmp_path, checkpoint):
    marker = tmp_path / "PWNED"
    payloads = _payloads(marker)
    assert len(payloads) > 60
    for label, data in payloads:
        (checkpoint / ".metadata").write_bytes(data)
        with pytest.raises(UnsafeCheckpointError, match="which a DCP index never does") as e:
            read_index(checkpoint)
        assert str(checkpoint / ".metadata") in str(e.value), label
        assert not marker.exists(), f"{label} ran code"


def test_a_persistent_id_and_garbage_are_refused_without_running_anything(tmp_path, checkpoint):
    (checkpoint / ".metadata").write_bytes(b"\x80\x04" + _short("x") + b"Q.")  # BINPERSID
    with pytest.raises(UnsafeCheckpointError, match="persistent id"):
        read_index(checkpoint)
    for junk in (b"", b"\x80\x04", b"not a pickle at all", struct.pack("<Q", 2**63)):
        (checkpoint / ".metadata").write_bytes(junk)
        with pytest.raises(ShardwiseError, match="not a valid checkpoint index"):
            read_index(checkpoint)


def test_a_refreshed_manifest_does_not_make_a_crafted_index_loadable(tmp_path, checkpoint):
    marker = tmp_path / "PWNED"
    _craft(checkpoint, _stack_global("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"))
    with pytest.raises(UnsafeCheckpointError):
        read_manifest(checkpoint)  # sizes and hashes match: the index itself is what is refused
    assert not marker.exists()


def _craft(step_dir: Path, payload: bytes) -> None:
    """Replace the index and refresh its size and sha256 in the manifest, as an attacker would."""
    (step_dir / ".metadata").write_bytes(payload)
    mf = json.loads((step_dir / "manifest.json").read_text())
    mf["files"][".metadata"] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(mf))


# --- the reproduction, end to end --------------------------------------------------------


def _cli(*args: str, cwd: Path, module: str = "shardwise.train.cli", timeout: float = 300):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, input="y\ny\n")


@pytest.mark.distributed
def test_crafted_index_is_refused_by_export_and_resume_before_any_rank_starts(tmp_path, trained):
    out = copy_run(trained("fsdp-demo"), tmp_path / "run")
    args = train_args(REPO / "examples" / "demo.yaml", out)
    step = out / "checkpoints" / step_dir_name(4)
    assert (step / "manifest.json").is_file()
    marker = tmp_path / "PWNED"
    _craft(step, _stack_global("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"))
    heartbeats = sorted((out / ".shardwise").rglob("rank-*.json"))
    stamps = [p.stat().st_mtime_ns for p in heartbeats]

    e = _cli(str(step), str(tmp_path / "exported"), cwd=tmp_path, module="shardwise.train.export.cli")
    assert e.returncode == 2, e.stdout + e.stderr
    assert "refers to os:system" in e.stderr or "os.system" in e.stderr, e.stderr
    assert "Traceback" not in e.stdout + e.stderr and not (tmp_path / "exported").exists()

    for resume in ("latest", str(step)):
        t = _cli(*args, "--resume", resume, cwd=tmp_path)
        text = t.stdout + t.stderr
        assert t.returncode == 2, text[-3000:]
        assert text.count("which a DCP index never does") == 1, text[-3000:]  # one message, not one per rank
        assert "Traceback" not in text and "rank 0" not in text, text[-3000:]
    assert not marker.exists()
    assert [p.stat().st_mtime_ns for p in heartbeats] == stamps  # no rank wrote a heartbeat: none started
