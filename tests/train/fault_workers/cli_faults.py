"""`python -m shardwise.train.cli ...` in this process (one rank, in-process) with a fault
injected where a real run would meet it:

    python cli_faults.py [--nan-then-sigterm K] [--fill-before-export DISK] -- CLI ARGS...

`--nan-then-sigterm K`: step K's gradients are NaN (its loss scale is), and the process sends
itself SIGTERM during that step's forward: the stop is voted at the boundary right after the
skipped step. `--fill-before-export DISK`: the filesystem DISK (a small tmpfs) is filled to its
last byte just before the end-of-run export starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--nan-then-sigterm", type=int, default=None)
p.add_argument("--fill-before-export", type=Path, default=None)
p.add_argument("argv", nargs=argparse.REMAINDER)
args = p.parse_args()
argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv


def fill(disk: Path) -> None:
    try:
        with open(disk / "filler.bin", "wb") as f:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
    except OSError:
        pass
    try:
        with open(disk / "filler-tail.bin", "wb") as f:  # the last partial MiB
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass


if args.nan_then_sigterm is not None:
    import shardwise.train.loop as loop

    real_build, bad, seen = loop.build_engine, args.nan_then_sigterm, {"step": 0}

    def build(model, run, env):
        engine = real_build(model, run, env)
        real_fb, real_step = engine.forward_backward, engine.step

        def forward_backward(batch, scale):
            if seen["step"] + 1 == bad:
                os.kill(os.getpid(), signal.SIGTERM)
                scale = float("nan")
            return real_fb(batch, scale)

        def step():
            seen["step"] += 1
            return real_step()

        engine.forward_backward, engine.step = forward_backward, step
        return engine

    loop.build_engine = build

if args.fill_before_export is not None:
    import shardwise.train.export.hf_dir as export

    real_export, disk = export.export_final, args.fill_before_export

    def export_final(*a, **kw):
        fill(disk)
        return real_export(*a, **kw)

    export.export_final = export_final

from shardwise.train.cli import main  # noqa: E402

sys.argv = ["shardwise-train", *argv]
main()
