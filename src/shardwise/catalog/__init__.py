"""Bundled model and hardware presets (YAML data beside this file), looked up by name."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml

from shardwise.errors import ShardwiseError, did_you_mean
from shardwise.specs.hardware import GB, GPUSpec, HardwareSpec, LinkSpec
from shardwise.specs.model import ModelSpec

_HERE = Path(__file__).parent


@cache
def _models() -> dict[str, dict]:
    return yaml.safe_load((_HERE / "models.yaml").read_text())


@cache
def _hardware() -> dict[str, dict]:
    return yaml.safe_load((_HERE / "hardware.yaml").read_text())


def model_names() -> list[str]:
    return list(_models())


def gpu_names() -> list[str]:
    return list(_hardware()["gpus"])


def interconnect_names() -> list[str]:
    return list(_hardware()["interconnects"])


def _entry(table: dict[str, dict], name: str, kind: str) -> tuple[str, dict]:
    """(normalised key, entry) of a catalog table, or the error listing the valid names."""
    key = name.strip().lower()
    if key not in table:
        raise ShardwiseError(f"unknown {kind} {name!r}. {did_you_mean(key, list(table))}")
    return key, table[key]


@cache
def get_model(name: str) -> ModelSpec:
    key, m = _entry(_models(), name, "model")
    return ModelSpec(name=key, **m)


@cache
def get_gpu(name: str) -> GPUSpec:
    key, g = _entry(_hardware()["gpus"], name, "GPU")
    return GPUSpec(
        name=key,
        memory_bytes=g["memory_gb"] * GB,
        bf16_flops=g["bf16_tflops"] * 1e12,
        fp16_flops=g["fp16_tflops"] * 1e12,
        fp32_flops=g["fp32_tflops"] * 1e12,
        hbm_bytes_per_s=g["hbm_gbps"] * GB,
    )


@cache
def get_link(name: str) -> LinkSpec:
    key, link = _entry(_hardware()["interconnects"], name, "interconnect")
    return LinkSpec(name=key, bus_bytes_per_s=link["bus_gbps"] * GB, latency_s=link["latency_us"] * 1e-6)


def build_hardware(
    gpu: str = "a100-80g",
    gpus: int = 8,
    gpus_per_node: int | None = None,
    interconnect: str | None = None,
    intra: str | None = None,
    inter: str | None = None,
    memory_gb: float | None = None,
    **overrides,
) -> HardwareSpec:
    """A HardwareSpec from preset names and overrides.

    `interconnect` names the slowest link the data-parallel traffic crosses. An intra-node
    link (nvlink, pcie) replaces the link inside the node; a network (ib-*, roce-*, eth-*)
    replaces the link between nodes and, unless --gpus-per-node says otherwise, means one
    GPU per node (e.g. 8 single-GPU machines on 10 GbE).
    """
    if gpus < 1:
        raise ShardwiseError(f"--gpus must be at least 1, got {gpus}")
    network = interconnect is not None and _hardware()["interconnects"].get(interconnect.strip().lower(), {}).get("scope") == "inter"
    per_node = gpus_per_node or (1 if network else min(gpus, 8))
    if gpus % per_node:
        raise ShardwiseError(f"--gpus {gpus} is not a multiple of --gpus-per-node {per_node}")
    nodes = gpus // per_node
    g = get_gpu(gpu)
    if memory_gb is not None:
        g = g.model_copy(update={"memory_bytes": memory_gb * GB})
    intra_link = get_link(intra or "nvlink")
    inter_link = get_link(inter or "ib-200")
    if interconnect:
        if network:
            inter_link = get_link(interconnect)
        else:
            intra_link = get_link(interconnect)
    return HardwareSpec(gpu=g, gpus_per_node=per_node, nodes=nodes, intra=intra_link, inter=inter_link, **overrides)
