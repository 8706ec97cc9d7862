"""Every pickle opcode family, and a fuzz of real indexes, against the checkpoint index reader.

Hand-built pickles, one per way a pickle can reach a callable or state outside the data it
holds: GLOBAL (protocols 0-3), STACK_GLOBAL with its names behind MEMOIZE/BINGET, INST, OBJ,
NEWOBJ and NEWOBJ_EX on a forbidden class, REDUCE, BUILD with a `__setstate__` and BUILD onto an
admitted class (class poisoning), EXT1/EXT2/EXT4 through copyreg's extension registry,
PERSID/BINPERSID, a pickle nested in a bytes value, and protocol 5's out-of-band buffers. Each
must be refused with a ShardwiseError naming the index, run nothing (a marker file) and leave
the admitted classes as they were.

Then Hypothesis mutates a real index (written by `save_checkpoint`): byte flips, truncations,
insertions of opcodes and splices of the payloads above, at fixed seed (`derandomize=True`),
300 cases in CI. Property: the index loads and describes tensors in the checkpoint's own files,
or a ShardwiseError names it; never another exception, never code run, never a changed class.
"""

from __future__ import annotations

import copyreg
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint.index import UnsafeCheckpointError, _MetadataUnpickler, read_index
from shardwise.train.checkpoint.sharded import TrainerState, read_tensors, save_checkpoint

META = "torch.distributed.checkpoint.metadata"


def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _admitted_state() -> dict[str, dict]:
    out = {}
    for m, n in _MetadataUnpickler._ALLOWED:
        o = _MetadataUnpickler.resolve(m, n)
        if hasattr(o, "__dict__"):
            out[f"{m}:{n}"] = dict(vars(o))
    return out


class _Setstate:
    """BUILD calls this class's __setstate__ with the pickled state: a payload of its own."""

    def __setstate__(self, state):
        os.system(state)


def payloads(marker: Path) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    P4 = b"\x80\x04"
    out = {
        "GLOBAL p0": f"cos\nsystem\n(V{cmd}\ntR.".encode(),
        "GLOBAL p2": b"\x80\x02" + f"cos\nsystem\n(V{cmd}\ntR.".encode(),
        "STACK_GLOBAL memo": P4 + _str("os") + b"\x94" + _str("system") + b"\x94" + b"h\x00h\x01\x93"
                             + _str(cmd) + b"\x85R.",
        "STACK_GLOBAL memo via admitted module": P4 + _str(META) + b"\x94" + _str("os") + b"\x94" + b"h\x00h\x01\x93"
                                                 + b"\x94" + _str("system") + b"\x85R.",
        "INST": f"(V{cmd}\nios\nsystem\n.".encode(),
        "OBJ": f"(cos\nsystem\nV{cmd}\no.".encode(),
        "NEWOBJ forbidden class": P4 + _str("subprocess") + _str("Popen") + b"\x93" + b"]" + _str("touch")
                                  + b"a" + _str(str(marker)) + b"a\x85\x81.",
        "NEWOBJ_EX forbidden class": P4 + _str("subprocess") + _str("Popen") + b"\x93" + b"]" + _str("touch")
                                     + b"a" + _str(str(marker)) + b"a\x85}\x92.",
        "BUILD __setstate__": P4 + _str(__name__) + _str("_Setstate") + b"\x93)\x81" + _str(cmd) + b"b.",
        "BUILD onto an admitted class": P4 + _str(META) + _str("Metadata") + b"\x93" + b"N}" + _str("storage_data")
                                        + b"}" + b"s\x86b.",
        "BUILD onto an admitted class, then fails": P4 + _str(META) + _str("Metadata") + b"\x93" + b"N}"
                                                    + _str("version") + _str("x") + b"s\x86b" + b"0.",
        "PERSID": f"P{cmd}\n.".encode(),
        "BINPERSID": P4 + _str(cmd) + b"Q.",
        "NEXT_BUFFER (protocol 5)": b"\x80\x05\x97.",
        "READONLY_BUFFER (protocol 5)": b"\x80\x05\x97\x98.",
        "nested pickle in bytes, then REDUCE of pickle.loads": P4 + _str("pickle") + _str("loads") + b"\x93"
                                                                + b"C" + bytes([len(pickle.dumps(1))]) + pickle.dumps(1)
                                                                + b"\x85R.",
    }
    code = 0x7FFFF0
    copyreg.add_extension("os", "system", code)  # EXT4: the registry resolves to a (module, name)
    try:
        out["EXT4 os.system"] = P4 + b"\x84" + code.to_bytes(4, "little") + _str(cmd) + b"\x85R."
    finally:
        copyreg.remove_extension("os", "system", code)
    for op, width, code in ((b"\x82", 1, 0xF0), (b"\x83", 2, 0xF0F0)):  # EXT1, EXT2
        copyreg.add_extension("posix", "system", code)
        try:
            out[f"EXT{width} posix.system"] = P4 + op + code.to_bytes(width, "little") + _str(cmd) + b"\x85R."
        finally:
            copyreg.remove_extension("posix", "system", code)
    return out


class _Stand:
    def checkpoint_state(self):
        return {"model.w": torch.ones(3, 4), "optim.exp_avg.w": torch.zeros(3, 4, dtype=torch.bfloat16),
                "model.n": torch.arange(3)}, {"optimizer_step": 1}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> tuple[Path, bytes]:
    """A real index, made byte-for-byte the same on every run (its save id and the temp path it
    records fixed), so the derandomized fuzz mutates the same bytes every time."""
    step = save_checkpoint(_Stand(), TrainerState(step=1, samples_consumed=1, global_batch=1),
                           tmp_path_factory.mktemp("idx") / "run", config={}, strategy="ddp", keep_last=2)
    meta = pickle.loads((step / ".metadata").read_bytes())  # our own file, just written
    meta.storage_meta.checkpoint_id = Path("/checkpoints/.tmp-step-00000001")
    meta.storage_meta.save_id = "00000000-0000-0000-0000-000000000000"
    data = pickle.dumps(meta, protocol=4)
    (step / ".metadata").write_bytes(data)
    return step, data


def test_the_payloads_are_live_under_plain_pickle(tmp_path):
    """What is refused below is real: plain pickle runs these (EXT needs its registry entry)."""
    marker = tmp_path / "PWNED"
    live = payloads(marker)
    for name in ("GLOBAL p0", "STACK_GLOBAL memo", "INST", "OBJ", "BUILD __setstate__"):
        pickle.loads(live[name])
        assert marker.exists(), name
        marker.unlink()


@pytest.mark.parametrize("name", sorted(payloads(Path("/nonexistent/marker"))))
def test_each_opcode_family_is_refused(tmp_path, name):
    marker = tmp_path / "PWNED"
    data = payloads(marker)[name]
    before = _admitted_state()
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / ".metadata").write_bytes(data)
    with pytest.raises(ShardwiseError) as e:
        read_index(target)
    assert str(target / ".metadata") in str(e.value)
    assert not marker.exists(), f"{name} ran code"
    assert _admitted_state() == before, f"{name} changed an admitted class"
    if name == "BUILD onto an admitted class":  # the other fails first; its change is undone all the same
        assert isinstance(e.value, UnsafeCheckpointError) and "sets attributes of Metadata" in str(e.value)


_OPS = st.sampled_from([b"\x93", b"R", b"b", b"\x81", b"\x92", b"Q", b"\x97", b"\x94", b"h\x00", b"0", b".",
                        b"(", b"t", b"}", b"]", b"N", b"\x88", b"s", b"u", b"e", b"a", b"\x8c\x02os"])


@st.composite
def _mutated(draw, base: bytes, splices: list[bytes]) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "splice", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(_OPS)
        elif kind == "delete" and data:
            del data[at:at + draw(st.integers(1, 16))]
        elif kind == "splice":
            piece = draw(st.sampled_from(splices))
            data[at:at] = piece[2:-1] if piece.startswith(b"\x80") else piece[:-1]
    return bytes(data)


_MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / f"shardwise-fuzz-index-marker-{os.getpid()}"
_SPLICES = list(payloads(_MARKER).values())


def test_fuzzed_indexes_load_cleanly_or_are_refused_by_name(tmp_path, fresh):
    """300 Hypothesis cases, derandomized (a fixed seed): mutations of a real index."""
    step, base = fresh
    target = tmp_path / "ckpt"
    target.mkdir()
    for f in step.iterdir():
        if f.name != ".metadata":
            (target / f.name).write_bytes(f.read_bytes())
    before = _admitted_state()
    outcomes = {"loaded": 0, "refused": 0}

    @settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_mutated(base, _SPLICES))
    def run(data: bytes) -> None:
        (target / ".metadata").write_bytes(data)
        try:
            read_index(target)
            read_tensors(target)  # a loadable index must load: its records are checked
            outcomes["loaded"] += 1
        except ShardwiseError as e:
            assert str(target / ".metadata") in str(e) or str(target) in str(e), str(e)
            outcomes["refused"] += 1
        assert not _MARKER.exists(), "a fuzzed index ran code"
        assert _admitted_state() == before

    try:
        run()
    finally:
        _MARKER.unlink(missing_ok=True)
    assert outcomes["refused"] > 100 and outcomes["loaded"] > 0, outcomes  # the fuzz reached both sides
