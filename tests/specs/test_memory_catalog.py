"""catalog/memory.yaml: every constant of the memory model has its provenance, the file names
exactly the model's constants, and the docs quote the values it holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardwise import catalog
from shardwise.errors import ShardwiseError
from shardwise.specs.memory_model import MemoryModel

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def test_every_bundled_memory_constant_has_a_provenance():
    mm = catalog.memory_model()
    assert set(mm.provenance) == set(MemoryModel.constant_names())
    for name, prov in mm.provenance.items():
        assert prov.kind in ("fitted", "measured", "derived", "assumed") and prov.basis, name
        if prov.kind == "fitted":
            assert prov.cases and prov.sources, name


def test_the_allocator_slack_names_the_cases_it_was_fitted_on():
    """The one fitted memory constant: fitted on the H200 runs of shardwise train, every one."""
    prov = catalog.memory_model().provenance["allocator_slack"]
    measured = json.loads((ROOT / "benchmarks/measurements/h200-trainer-cases.json").read_text())
    assert prov.kind == "fitted"
    assert set(prov.cases) == {c["name"] for c in measured["cases"]}
    assert prov.sources == ("shardwise-h200",)


@pytest.mark.parametrize("change, named", [
    (lambda t: t.pop("heap_floor_bytes"), "missing ['heap_floor_bytes']"),
    (lambda t: t.update(pinned_slack={"value": 1, "kind": "assumed", "basis": "x"}), "unknown ['pinned_slack']"),
])
def test_a_missing_or_unknown_constant_is_refused_by_name(monkeypatch, change, named):
    table = {k: dict(v) for k, v in catalog._memory().items()}
    change(table)
    monkeypatch.setattr(catalog, "_memory", lambda: table)
    with pytest.raises(ShardwiseError, match=re.escape(named)):
        catalog.memory_model.__wrapped__()


def test_an_entry_without_provenance_is_refused(monkeypatch):
    table = {k: dict(v) for k, v in catalog._memory().items()}
    del table["cuda_context_bytes"]["kind"]
    monkeypatch.setattr(catalog, "_memory", lambda: table)
    with pytest.raises(ShardwiseError, match=r"cuda_context_bytes: .*kind"):
        catalog.memory_model.__wrapped__()


def test_the_reference_quotes_the_runtime_overheads_the_catalog_holds():
    mm = catalog.memory_model()
    doc = (ROOT / "docs/reference.md").read_text()
    assert f"`cuda_context_bytes` = {mm.cuda_context_bytes / GIB:g} GiB per process" in doc
    assert f"`nccl_per_group_bytes` = {mm.nccl_per_group_bytes / GIB:g} GiB per group" in doc
    assert f"`allocator_slack` = {mm.allocator_slack:.0%} of the larger" in doc
    assert f"`default_margin` = {mm.default_margin:.0%} kept free" in doc


def test_memory_model_constants_are_not_module_globals():
    """The plan (and the trainer's mmap threshold) read them from catalog.memory_model(): none is
    left a module global, under its old name or its new one."""
    import shardwise.plan.host_cpu as host_cpu
    import shardwise.plan.load as load
    import shardwise.plan.memory as memory
    import shardwise.train.launch.host_alloc as host_alloc

    old = ("CUDA_CONTEXT", "NCCL_PER_GROUP", "ALLOCATOR_SLACK", "DEFAULT_MARGIN", "SUB_GROUP_SIZE", "PROCESS_BYTES",
           "CUDA_RUNTIME_BYTES", "LAUNCHER_BYTES", "DEFAULT_FILE_BYTES", "MMAP_THRESHOLD", "HEAP_FLOOR")
    for module in (memory, load, host_cpu, host_alloc):
        for name in old + tuple(n.upper() for n in MemoryModel.constant_names()):
            assert not hasattr(module, name), (module.__name__, name)
