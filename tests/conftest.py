"""Fixtures for the whole suite.

Free disk is faked: every test sees `SUITE_FREE_BYTES` (20 GiB) free through `shutil.disk_usage`,
whatever the machine that runs it has, so a test that passes here passes on a machine with 20 GiB
free and none depends on this one's disk (the output-space check of a planned llama-2-7b run needs
~75 GiB and used to pass or fail with the host). A test that plans a big run without testing the
space check asks for more (`disk_free(PLENTY)`); the tests of the space check set their own value.
Host memory is faked the same way (`SUITE_HOST_BYTES` MemAvailable, as the preflight's host-memory
check reads /proc/meminfo). Subprocesses (the CLI tests) see the real disk and memory: they train tiny models, whose needs
tests/test_disk_free.py checks against the same 20 GiB. No test reaches the Hugging Face Hub:
HF_HUB_OFFLINE=1 in every test's environment (and so its subprocesses').
"""

from __future__ import annotations

import os
import shutil
from collections import namedtuple

import pytest

GIB = 1 << 30
SUITE_FREE_BYTES = 20 * GIB  # the smallest machine the suite must pass on
SUITE_HOST_BYTES = 16 * GIB  # host memory available on the smallest machine (24 GiB, 2 cores)
PLENTY = 1 << 50  # 1 PiB: for tests that plan big runs but do not test the space check

DiskUsage = namedtuple("DiskUsage", "total used free")  # what shutil.disk_usage returns


@pytest.fixture
def disk_free(monkeypatch):
    """`disk_free(n)`: from now on `shutil.disk_usage(path)` (as shardwise.train.outputs and any
    other in-process caller sees it) reports `n` bytes free; a missing path still raises, as the
    real call does. Returns `n`."""

    def set_free(free: int) -> int:
        def fake(path):
            os.stat(path)  # FileNotFoundError like the real one
            return DiskUsage(total=2 * free, used=free, free=free)

        monkeypatch.setattr(shutil, "disk_usage", fake)
        import shardwise.train.outputs as outputs

        if hasattr(outputs, "disk_usage"):  # in case it is ever imported by name
            monkeypatch.setattr(outputs, "disk_usage", fake)
        return free

    return set_free


@pytest.fixture
def host_memory(monkeypatch):
    """`host_memory(n)`: from now on /proc/meminfo, as shardwise.run.host reads it in this
    process, reports `n` bytes MemAvailable (and MemTotal). Returns `n`."""

    def set_available(n: int) -> int:
        import shardwise.run.host as hm

        monkeypatch.setattr(hm, "read_meminfo", lambda path=hm.MEMINFO: {"MemTotal": n, "MemAvailable": n})
        return n

    return set_available


@pytest.fixture(autouse=True)
def _suite_host_memory(host_memory):
    """Every test runs as on a machine with SUITE_HOST_BYTES of host memory available."""
    host_memory(SUITE_HOST_BYTES)


@pytest.fixture(autouse=True)
def _suite_free_disk(disk_free):
    """Every test runs as on a machine with SUITE_FREE_BYTES free (see the module docstring)."""
    disk_free(SUITE_FREE_BYTES)


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    """No test reaches the Hugging Face Hub (none can here): a model id outside the catalog is
    looked up in the Hugging Face cache only (shardwise.specs.hf_hub). The tests of the download
    path unset this and stand a fake `hf_hub_download` in."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
