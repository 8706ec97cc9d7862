"""The hardware spec `shardwise doctor` writes and `plan --hardware FILE|auto` and the
trainer's preflight (`hardware.machine`) read: this machine's GPU, links and host in the
catalog's names (catalog/hardware.yaml), with what was read beside them.

YAML or JSON (`format: shardwise-hardware/1`), validated by pydantic: catalog names are checked
against the catalog, errors name the file and the field. Torch-free, no I/O but `load_machine`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardwise.errors import ShardwiseError, user_error
from shardwise.specs.hardware import GB, HardwareSpec

MACHINE_FORMAT = "shardwise-hardware/1"


class MachineHardware(BaseModel):
    """One node of this machine's kind, as the planner names it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["shardwise-hardware/1"] = MACHINE_FORMAT
    gpu: str | None = Field(description="catalog GPU (hardware.yaml `gpus`); null: none found or not in the catalog")
    gpu_memory_gb: float | None = Field(None, gt=0, description="the device memory read (GB), in place of the "
                                        "catalog's")
    gpus_per_node: int = Field(gt=0, le=64, description="GPUs of this node (0 GPUs: no spec is plannable)")
    intra: str | None = Field(None, description="catalog link between this node's GPUs, as the DP traffic finds it")
    inter: str | None = Field(None, description="catalog link between nodes (the network NCCL will use); "
                              "null: none found")
    nics_per_node: int | None = Field(None, gt=0, le=64, description="active InfiniBand/RoCE ports NCCL can use")
    host_memory_gb: float | None = Field(None, gt=0, description="host RAM of this node (GB)")
    read: dict[str, Any] = Field(default_factory=dict, description="what was read (models, topology, ports), "
                                 "for the reader; the planner uses the fields above only")
    notes: tuple[str, ...] = Field((), description="how the readings were mapped to catalog names")

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str | None) -> str | None:
        if v is not None:
            from shardwise.catalog import get_gpu

            get_gpu(v)  # unknown: the catalog's error, with the closest names
        return v

    @field_validator("intra", "inter")
    @classmethod
    def _link(cls, v: str | None) -> str | None:
        if v is not None:
            from shardwise.catalog import check_link_name

            check_link_name(v)
        return v

    def hardware(self, gpus: int | None = None, gpus_per_node: int | None = None,
                 **overrides: Any) -> HardwareSpec:
        """The HardwareSpec of `gpus` GPUs (default: this node) on nodes like this one.
        `overrides`: catalog.build_hardware's keywords given by the caller (flags win)."""
        from shardwise.catalog import build_hardware

        other_gpu = overrides.get("gpu") not in (None, self.gpu)
        if self.gpu is None and not other_gpu:
            raise ShardwiseError(
                "the hardware spec names no catalog GPU (" + ("; ".join(self.notes) or "no GPU was read")
                + "): name one with --gpu (catalog GPUs: shardwise plan --help)")
        per_node = gpus_per_node or self.gpus_per_node
        kw: dict[str, Any] = {"gpu": self.gpu, "gpus": gpus or per_node, "gpus_per_node": per_node,
                              "intra": self.intra, "inter": self.inter, "memory_gb": self.gpu_memory_gb}
        if self.host_memory_gb is not None:
            kw["host_memory_bytes"] = self.host_memory_gb * GB
        if self.nics_per_node is not None:
            kw["nics_per_node"] = min(self.nics_per_node, per_node)
        if other_gpu:  # another GPU than the one read: its own memory and link inside the node
            kw |= {"memory_gb": None, "intra": None}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return build_hardware(**kw)


def load_machine(path: str | Path) -> MachineHardware:
    """A hardware spec file (YAML or JSON), or the error naming the file, line or field."""
    from shardwise.config.safe_yaml import key_lines, read_yaml

    path = Path(path)
    if not path.exists():
        raise ShardwiseError(f"{path}: hardware spec not found (write one with `shardwise doctor --write {path}`)")
    node, raw = read_yaml(path)  # JSON is YAML: one safe reader for both
    if not isinstance(raw, dict) or raw.get("format") != MACHINE_FORMAT:
        raise ShardwiseError(f"{path}: not a shardwise hardware spec (expected a mapping with "
                             f"format: {MACHINE_FORMAT}, as `shardwise doctor --write` writes)")
    try:
        return MachineHardware.model_validate(raw)
    except ValidationError as e:
        lines = key_lines(node)
        err = user_error(e, str(path), model=MachineHardware, lines=lines, header=f"{path}: invalid hardware spec")
        if str(err).startswith(str(path)):
            raise err from None
        # a catalog name refused by its validator comes back as the catalog's message alone
        # (errors.user_error): say which file, line and field wrote it
        loc = tuple(e.errors()[0].get("loc", ()))
        at = f"{path}:{lines[loc]}" if loc in lines else str(path)
        raise ShardwiseError(f"{at}: field {'.'.join(map(str, loc))!r}: {err}") from None
    except ShardwiseError as e:
        raise ShardwiseError(f"{path}: {e}") from None
