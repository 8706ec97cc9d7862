"""The `trained` fixture: short runs the hostile-input tests tamper with (copies of)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock
from hostile_runs import RUNS, cli, train_args


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """`trained(name)`: a 4-step run (2 ranks, a checkpoint at step 4) of RUNS[name], trained once
    per session (xdist workers share it by a lock); copy it before changing anything."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    root = root / "security-bytes"
    root.mkdir(exist_ok=True)

    def get(name: str) -> Path:
        config, extra = RUNS[name]
        out = root / name
        with FileLock(str(out) + ".lock"):
            if not (out / "DONE").exists():
                shutil.rmtree(out, ignore_errors=True)
                r = cli(*train_args(config, out / "run", *extra), cwd=root)
                assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
                (out / "DONE").touch()
        return out / "run"

    return get
