"""`shardwise --version` and `shardwise version --full`."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

from typer.testing import CliRunner

import shardwise
from shardwise.cli.app import app


def test_version_flag_prints_the_installed_version():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"shardwise {shardwise.__version__}"
    assert shardwise.__version__ == version("shardwise")  # the package's own and its metadata agree


def test_python_m_shardwise_cli_is_the_command():
    """`python -m shardwise.cli` (what benchmarks/gpu/session.sh runs) is the console script."""
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "--version"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip() == f"shardwise {shardwise.__version__}", r.stderr[-2000:]


def test_version_full_names_the_libraries_a_run_depends_on():
    res = CliRunner().invoke(app, ["version", "--full", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["shardwise"] == shardwise.__version__
    for lib in ("torch", "deepspeed", "transformers", "peft"):
        assert doc[lib] == version(lib)
    assert "torch cuda" in doc and "torch nccl" in doc  # None on this CPU build


def test_a_missing_library_is_said_not_installed(monkeypatch):
    from importlib.metadata import PackageNotFoundError

    import shardwise.versions as v

    real = v.version

    def fake(pkg):
        if pkg == "bitsandbytes":
            raise PackageNotFoundError(pkg)
        return real(pkg)

    monkeypatch.setattr(v, "version", fake)
    res = CliRunner().invoke(app, ["version", "--full"])
    assert res.exit_code == 0, res.output
    assert "bitsandbytes not installed" in res.output.splitlines()


def test_the_manifest_versions_are_the_same_reading():
    from shardwise.train.checkpoint.sharded import versions

    assert versions() == {p: version(p) for p in ("shardwise", "torch", "deepspeed", "transformers")}
