"""Fuzz of a model directory's weights files as preflight and rank 0 open them
(shardwise.train.model.weights_read.check_files / TensorFiles):

- safetensors: generated headers (names, dtypes, shapes, offsets, metadata, raw bytes) under a
  generated or true header length, with data of generated length;
- `.bin`: torch.save archives whose data.pkl is a hostile pickle of every opcode family that can
  reach code (GLOBAL, STACK_GLOBAL with memo tricks, INST, OBJ, NEWOBJ, NEWOBJ_EX, REDUCE, BUILD,
  EXT1/EXT2/EXT4 through copyreg, PERSID, BINPERSID, a pickle nested in bytes, protocol 5's
  out-of-band buffers), each calling a function that writes a marker; and archives with mutated
  bytes.

Each either opens or is one ShardwiseError naming the file; a hostile pickle is always refused;
the marker never appears; the process's peak memory grows by less than 256 MiB over a fuzz
run (a claimed length is never allocated). Hypothesis with a fixed seed (derandomize=True)."""

from __future__ import annotations

import copyreg
import json
import pickle
import resource
import struct
import tempfile
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from shardwise.errors import ShardwiseError
from shardwise.train.model.weights_read import TensorFiles, check_files

# a fixed seed (derandomize), no example database: every CI run tries the same cases
FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

MARKER = Path(tempfile.gettempdir()) / f"shardwise-fuzz-weights-marker-{id(object())}"
DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "X", "", "f32"]
GROWTH_LIMIT_KB = 256 << 10


def peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def refused_or_opens(d: Path, f: Path) -> str | None:
    """None if the directory opened (every tensor then reads), else the refusal, which names `f`."""
    try:
        check_files(d)
    except ShardwiseError as e:
        assert str(f) in str(e), str(e)
        return str(e)
    files = TensorFiles(d)
    for k in files.keys():
        assert tuple(files.get(k).shape) == files.shape(k)
    return None


# ---------------------------------------------------------------- safetensors


@st.composite
def safetensors_file(draw) -> bytes:
    tensors = draw(st.dictionaries(
        st.text(max_size=6),
        st.fixed_dictionaries({"dtype": st.sampled_from(DTYPES),
                               "shape": st.lists(st.integers(-2, 6) | st.sampled_from([2**40, 2**63]), max_size=3),
                               "data_offsets": st.lists(st.integers(-1, 80) | st.sampled_from([2**40, 2**64 - 1]),
                                                        min_size=2, max_size=2)}),
        max_size=3))  # fmt: skip
    if draw(st.booleans()):
        tensors["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4) | st.integers(),
                                                       max_size=2))
    header = draw(st.just(json.dumps(tensors).encode()) | st.binary(max_size=64))
    length = draw(st.just(len(header)) | st.integers(0, 2**64 - 1) | st.sampled_from([100_000_001, len(header) + 1]))
    return struct.pack("<Q", length) + header + draw(st.binary(max_size=96))


def test_the_safetensors_generator_makes_valid_files_too():
    """The fuzz reaches the library's checks: a header it can write is one safetensors reads."""
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "model.safetensors"
        f.write_bytes(struct.pack("<Q", len(json.dumps(header))) + json.dumps(header).encode() + bytes(16))
        assert refused_or_opens(Path(tmp), f) is None


@settings(FUZZ, max_examples=400)
@given(content=safetensors_file())
def test_generated_safetensors_opens_or_is_refused_naming_the_file(content):
    """400 cases in CI (fixed seed): generated headers, lengths and data."""
    before = peak_kb()
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "model.safetensors"
        f.write_bytes(content)
        refused_or_opens(Path(tmp), f)
    assert peak_kb() - before < GROWTH_LIMIT_KB


# ---------------------------------------------------------------- .bin: hostile pickles


def _u(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _arg(module: str, name: str) -> bytes:
    """The argument that makes `module.name` write MARKER."""
    if name in ("eval", "exec"):
        return _u(f"open({str(MARKER)!r}, 'w').close()")
    return _u(f"touch {MARKER}")


TARGETS = [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
           ("subprocess", "getoutput"), ("subprocess", "check_output"), ("torch.serialization", "load")]
# copyreg extension codes the EXT families use, registered (by the fixture) to command runners
EXT = {"EXT1": (0xF1, "os", "system"), "EXT2": (0xF1F2, "posix", "system"), "EXT4": (0x7A5E1, "subprocess", "getoutput")}
FAMILIES = ["GLOBAL", "STACK_GLOBAL", "STACK_GLOBAL_MEMO", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD",
            "BUILD_SETSTATE", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID", "NESTED", "BUFFER"]  # fmt: skip


def payload(family: str, module: str, name: str) -> bytes:
    """A pickle body (no PROTO, no STOP) leaving one object on the stack; reaching it calls
    module.name(arg)."""
    g = b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL
    sg = _u(module) + _u(name) + b"\x93"  # STACK_GLOBAL
    a = _arg(module, name)
    if family == "GLOBAL":
        return g + a + b"\x85R"  # TUPLE1 REDUCE
    if family == "STACK_GLOBAL":
        return sg + a + b"\x85R"
    if family == "STACK_GLOBAL_MEMO":  # memoised, dropped, fetched back: MEMOIZE POP BINGET
        return sg + b"\x94" + b"0" + b"h\x00" + a + b"\x85R"
    if family == "INST":
        return b"(" + a + b"i" + module.encode() + b"\n" + name.encode() + b"\n"
    if family == "OBJ":
        return b"(" + g + a + b"o"
    if family == "NEWOBJ":
        return g + a + b"\x85\x81"
    if family == "NEWOBJ_EX":
        return g + a + b"\x85}\x92"  # args, EMPTY_DICT kwargs
    if family == "BUILD":  # an object of the class built by NEWOBJ, its state set by BUILD
        return g + b")\x81" + b"}" + _u("x") + a + b"s" + b"b"
    if family == "BUILD_SETSTATE":  # an allowed class given __setstate__ = target by one BUILD, called by the next
        return b"ccollections\nOrderedDict\n)R" + b"}" + _u("__setstate__") + g + b"sb" + a + b"b"
    if family in ("EXT1", "EXT2", "EXT4"):  # a copyreg extension code registered to a command runner
        code = EXT[family][0]
        op, fmt = {"EXT1": (b"\x82", "<B"), "EXT2": (b"\x83", "<H"), "EXT4": (b"\x84", "<i")}[family]
        op += struct.pack(fmt, code)
        return op + _u(f"touch {MARKER}") + b"\x85R"
    if family == "PERSID":
        return b"P" + f"{module}.{name}".encode() + b"\n"
    if family == "BINPERSID":  # torch's storage tuple, its type a global: ("storage", T, "0", "cpu", 1)
        return b"(" + _u("storage") + g + _u("0") + _u("cpu") + b"K\x01t" + b"Q"
    if family == "NESTED":  # a pickle inside bytes, handed to pickle.loads
        inner = b"\x80\x04" + g + a + b"\x85R."
        return b"cpickle\nloads\n" + b"C" + bytes([len(inner)]) + inner + b"\x85R"
    if family == "BUFFER":  # protocol 5 out-of-band buffers, then a call on one
        return b"\x97\x98" + g + b"\x85R"
    raise AssertionError(family)


def write_bin(path: Path, body: bytes) -> None:
    """A torch.save archive whose data.pkl is exactly `body` (torch writes every other record)."""
    class Raw:
        def __init__(self, buf, protocol=2):
            self.buf = buf

        def dump(self, obj):
            self.buf.write(body)

    torch.save({}, path, pickle_module=types.SimpleNamespace(Pickler=Raw, __name__="raw"))


@pytest.fixture(scope="module", autouse=True)
def ext_registered():
    """EXT1/2/4 resolve through copyreg's registry: register their codes to command runners here,
    so that a reader honouring them would run the command."""
    added = []
    for code, module, name in EXT.values():
        if (module, name) not in copyreg._extension_registry and code not in copyreg._inverted_registry:
            copyreg.add_extension(module, name, code)
            added.append((module, name, code))
    yield
    for module, name, code in added:
        copyreg.remove_extension(module, name, code)
    MARKER.unlink(missing_ok=True)


class Recorder(pickle.Unpickler):
    """Resolves every global to a function recording its call: proves a payload would call it."""

    calls: list

    def find_class(self, module, name):
        return lambda *a, **k: self.calls.append((module, name, a)) or {}

    def persistent_load(self, pid):
        self.calls.append(("persid", pid, ()))
        return {}


@pytest.mark.parametrize("family", ["GLOBAL", "STACK_GLOBAL", "STACK_GLOBAL_MEMO", "INST", "OBJ", "EXT1", "EXT2",
                                    "EXT4", "PERSID", "BINPERSID", "NESTED"])  # fmt: skip
def test_each_payload_reaches_its_call_under_a_plain_unpickler(family):
    """The payloads are well-formed: an unpickler that resolves every global (to a recorder)
    reaches the call, so the refusal below is the reader's doing. (NEWOBJ, NEWOBJ_EX and the BUILDs
    need a real class; BUFFER needs buffers: their refusal comes at the global or the opcode.)"""
    import io

    r = Recorder(io.BytesIO(b"\x80\x04" + payload(family, "os", "system") + b"."))
    r.calls = []
    r.load()
    want = {"EXT1": ("os", "system"), "EXT2": ("posix", "system"), "EXT4": ("subprocess", "getoutput"),
            "NESTED": ("pickle", "loads"), "PERSID": ("persid", "os.system")}.get(family, ("os", "system"))  # fmt: skip
    if family == "BINPERSID":  # the storage tuple reached persistent_load with its type resolved
        assert r.calls[0][:2] == ("persid", r.calls[0][1]) and r.calls[0][1][0] == "storage", r.calls
        return
    assert want in [(m, n) for m, n, _ in r.calls], r.calls


def test_the_setstate_payload_calls_its_target_under_plain_pickle(capsys):
    """BUILD_SETSTATE, with print as the target: plain pickle calls it (the classic bypass)."""
    pickle.loads(b"\x80\x04" + payload("BUILD_SETSTATE", "builtins", "print") + b".")
    assert f"touch {MARKER}" in capsys.readouterr().out


@settings(FUZZ, max_examples=300)
@given(family=st.sampled_from(FAMILIES), target=st.sampled_from(TARGETS), proto=st.integers(2, 5),
       wrap=st.sampled_from(["top", "dict_value", "list", "memo_put"]))
def test_hostile_pickle_in_a_bin_is_refused_and_runs_nothing(family, target, proto, wrap):
    """300 cases in CI (fixed seed): opcode family × callable × protocol × where the payload sits."""
    body = payload(family, *target)
    if wrap == "dict_value":
        body = b"}" + _u("model.embed_tokens.weight") + body + b"s"
    elif wrap == "list":
        body = b"](" + body + b"e"
    elif wrap == "memo_put":
        body = body + b"q\x07" + b"0" + b"h\x07"  # BINPUT 7, POP, BINGET 7
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "pytorch_model.bin"
        write_bin(f, bytes([0x80, proto]) + body + b".")
        refusal = refused_or_opens(Path(tmp), f)
        # refused by torch's weights_only allow-list (the archive itself is sound)
        assert refusal is not None and "weights_only=True" in refusal, refusal or "a hostile pickle was read"
    assert not MARKER.exists(), f"{family} {target} ran code"


@settings(FUZZ, max_examples=200)
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=4)), min_size=1, max_size=4),
       hostile=st.booleans(), cut=st.none() | st.integers(0, 10**6))
def test_mutated_bin_archive_opens_or_is_refused_naming_the_file(edits, hostile, cut):
    """200 cases in CI (fixed seed): a torch.save archive (a state dict, or a GLOBAL payload) with
    bytes replaced or cut short."""
    before = peak_kb()
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "pytorch_model.bin"
        if hostile:
            write_bin(f, b"\x80\x02" + payload("GLOBAL", "os", "system") + b".")
        else:
            torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}, f)
        data = bytearray(f.read_bytes())
        for at, new in edits:
            i = at % len(data)
            data[i:i + len(new)] = new
        if cut is not None:
            data = data[: cut % len(data)]
        f.write_bytes(bytes(data))
        opened = refused_or_opens(Path(tmp), f) is None
        assert not (opened and hostile and b"system" in data), "a hostile archive was read"
    assert not MARKER.exists()
    assert peak_kb() - before < GROWTH_LIMIT_KB


def test_a_valid_state_dict_still_opens():
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "pytorch_model.bin"
        torch.save({"w": torch.arange(6.0).reshape(2, 3)}, f)
        assert refused_or_opens(Path(tmp), f) is None
        g = Path(tmp) / "x"
        g.mkdir()
        save_file({"w": torch.ones(2)}, str(g / "model.safetensors"))
        assert refused_or_opens(g, g / "model.safetensors") is None
