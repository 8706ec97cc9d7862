"""Phase probe for benchmarks/host_memory.py: imported at start-up by every process of a
`shardwise train` that the benchmark launches with this directory first on PYTHONPATH (Python
imports `sitecustomize` itself). In a trainer rank (and in a launcher that forks its ranks) it wraps `build_model`, `build_engine` and the
engine's `forward_backward` / `step` / `zero_grad` / `close` and `train` itself of shardwise.train.loop (the last row:
when the loop returned) and appends one JSON line per phase
to $SHARDWISE_HOST_PHASES_DIR/rank<RANK>.jsonl: VmRSS, RssAnon, RssFile and VmHWM of
/proc/self/status, and glibc's mallinfo2 (heap bytes in use and free, bytes in mmapped blocks).
The peak (VmHWM) is reset once the weights are in: the "loaded" row holds the load's peak, the
later rows the training's. Nothing is changed in what the trainer computes."""

from __future__ import annotations

import os
import sys

_DIR = os.environ.get("SHARDWISE_HOST_PHASES_DIR")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _mallinfo() -> dict[str, int]:
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_used": m.uordblks, "heap_free": m.fordblks, "mmapped": m.hblkhd}


def record(phase: str) -> None:
    import json

    row = {"phase": phase, **_status(), **_mallinfo()}
    with open(os.path.join(_DIR, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def reset_peak() -> None:
    """VmHWM from here on is the training's own peak (Linux: "5" to /proc/self/clear_refs resets it
    to the current RSS); the load's stays in the "loaded" row."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _patch(loop) -> None:
    build_model, build_engine = loop.build_model, loop.build_engine

    def model(run, **kw):
        record("start")
        m = build_model(run, **kw)
        record("built")
        return m

    def engine(m, run, env):
        e = build_engine(m, run, env)
        record("loaded")
        reset_peak()
        cls = type(e)
        if not getattr(cls, "_host_probe", False):
            cls._host_probe = True
            fb, st, zg, close = cls.forward_backward, cls.step, cls.zero_grad, cls.close

            def forward_backward(self, batch, scale):
                out = fb(self, batch, scale)
                record("forward_backward")
                return out

            def step(self):
                out = st(self)
                record("step")
                return out

            def zero_grad(self):
                out = zg(self)
                record("zero_grad")
                return out

            def closed(self):
                record("before close")
                return close(self)

            cls.forward_backward, cls.step, cls.zero_grad, cls.close = forward_backward, step, zero_grad, closed
        return e

    loop.build_model, loop.build_engine = model, engine
    train = loop.train

    def trained(*args, **kwargs):  # the end of the loop: last flush, the engine's close
        try:
            return train(*args, **kwargs)
        finally:
            record("trained")

    loop.train = trained


# In a rank, or in a launcher that forks its ranks (it imports the loop before the fork, and the
# ranks inherit the patched module; `record` reads RANK when it is called).
if _DIR:
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "shardwise.train.loop":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def patched(module):
                exec_module(module)
                _patch(module)

            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Finder())
