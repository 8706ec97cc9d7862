"""A hardware profile: what the user's own GPUs, links and host sustain, measured there
(`shardwise calibrate` writes it), replacing the catalog's figures in a plan.

Every field is optional; what a profile leaves out keeps the catalog's value. JSON, read with
errors that name the file, the line or the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardwise.config.file import parse_json, read_text
from shardwise.errors import ShardwiseError, user_error
from shardwise.specs.hardware import HardwareSpec
from shardwise.specs.timing_model import Provenance, TimingModel

PROFILE_VERSION = 1


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GPUProfile(_Part):
    bf16_flops: float | None = Field(None, gt=0, description="dense peak the GEMM efficiency is relative to")
    fp16_flops: float | None = Field(None, gt=0)
    fp32_flops: float | None = Field(None, gt=0)
    hbm_bytes_per_s: float | None = Field(None, gt=0)
    gemm_efficiency: float | None = Field(None, gt=0, le=1)
    attention_efficiency: float | None = Field(None, gt=0, le=1)
    hbm_efficiency: float | None = Field(None, gt=0, le=1)
    memory_bytes: float | None = Field(None, gt=0)
    adamw_params_per_s: float | None = Field(None, gt=0, description="AdamW step rate measured with adamw_impl "
                                             "(fp32 params/s); the planner's optimizer step uses it")
    adamw_impl: Literal["fused", "foreach", "forloop"] | None = None

    @model_validator(mode="after")
    def _adamw_pair(self) -> GPUProfile:
        if (self.adamw_params_per_s is None) != (self.adamw_impl is None):
            raise ValueError("adamw_params_per_s and adamw_impl are given together (the rate of which kernel)")
        return self


class LinkProfile(_Part):
    bus_bytes_per_s: float | None = Field(None, gt=0, description="nccl-tests bus bandwidth, large messages")
    latency_s: float | None = Field(None, ge=0, description="per hop, small messages")


class HardwareProfile(_Part):
    version: Literal[1] = PROFILE_VERSION
    gpu_name: str = Field(description="the device measured (torch.cuda.get_device_name)")
    device: Literal["cuda", "cpu"] | None = Field(None, description="the kind of device measured (profiles "
                                                  "without it: a gpu_name starting 'cpu' is a CPU)")
    measured_at: str | None = None
    gpu: GPUProfile = GPUProfile()
    intra: LinkProfile = LinkProfile()
    inter: LinkProfile = LinkProfile()
    pcie_bytes_per_s: float | None = Field(None, gt=0)
    host_adam_params_per_s: float | None = Field(None, gt=0)
    host_torch_adam_params_per_s: float | None = Field(None, gt=0)
    timing: dict[str, float] = Field(default_factory=dict, description="time-model constants measured here "
                                     "(specs/timing_model.py names), e.g. launch_s, fsdp2_hook_s")
    raw: dict[str, Any] = Field(default_factory=dict, description="the measurements behind the figures "
                                "(for reading; the planner does not use them)")

    @model_validator(mode="after")
    def _timing_names(self) -> HardwareProfile:
        unknown = sorted(set(self.timing) - set(TimingModel.constant_names()))
        if unknown:
            raise ValueError(f"timing: unknown constants {unknown} (expected some of {list(TimingModel.constant_names())})")
        return self

    @property
    def measured_on_cpu(self) -> bool:
        """Measured on a CPU (`shardwise calibrate` on a machine without a GPU)."""
        if self.device is not None:
            return self.device == "cpu"
        return self.gpu_name.strip().lower().startswith("cpu")

    def check_device(self, source: str | Path, device: str) -> None:
        """A CPU's rates are not a GPU's: a profile measured on a CPU planning GPUs would put the
        CPU's GEMM rate in the GPU's place as its peak (MFU relative to the CPU, a few tokens/s per
        "GPU"). Refused for anything but a run on the CPU, naming the file."""
        if self.measured_on_cpu and device != "cpu":
            peak = f" (GEMM {self.gpu.bf16_flops / 1e9:.3g} GFLOP/s)" if self.gpu.bf16_flops else ""
            raise ShardwiseError(
                f"{source}: hardware profile measured on a CPU ({self.gpu_name}){peak}, not on a GPU: its rates "
                "would replace the GPU's and plan a CPU's step. Run `shardwise calibrate` on the GPU machine "
                "to measure its GPUs, or plan without this profile (--profile / hardware.profile)")

    def provenance(self) -> Provenance:
        when = f" at {self.measured_at}" if self.measured_at else ""
        return Provenance(kind="measured", basis=f"shardwise calibrate on {self.gpu_name}{when}")

    def apply(self, hw: HardwareSpec) -> HardwareSpec:
        """`hw` with every measured figure of this profile in place of the catalog's, the time
        model's constants and the GPU's efficiencies marked measured here."""
        def given(part: BaseModel) -> dict:
            return {k: v for k, v in part.model_dump().items() if v is not None}

        top = {"pcie_bytes_per_s": self.pcie_bytes_per_s} if self.pcie_bytes_per_s is not None else {}
        host = {k: v for k in ("host_adam_params_per_s", "host_torch_adam_params_per_s")
                if (v := getattr(self, k)) is not None}
        gpu = given(self.gpu)
        measured = self.provenance()
        eff = {k: measured for k in gpu if k.endswith("_efficiency")}
        gpu["efficiency_provenance"] = dict(hw.gpu.efficiency_provenance) | eff
        constants = host | dict(self.timing)
        timing = hw.timing.with_values(constants, {k: measured for k in constants})
        return hw.model_copy(update={
            "timing": timing,
            "gpu": hw.gpu.model_copy(update=gpu),
            "intra": hw.intra.model_copy(update=given(self.intra)),
            "inter": hw.inter.model_copy(update=given(self.inter)),
            **top,
        })


def default_profile_path() -> Path:
    """Where `shardwise calibrate` writes and the planner looks: the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardwise" / "hardware-profile.json"


def load_profile(path: str | Path, *, device: str = "cuda") -> HardwareProfile:
    """The profile at `path`, for planning `device` ("cuda": the planner's GPUs; "cpu": a
    trainer run on the CPU, the one use a profile measured on a CPU has)."""
    path = Path(path)
    if not path.exists():
        raise ShardwiseError(f"{path}: hardware profile not found (run `shardwise calibrate` to measure one)")
    raw = parse_json(read_text(path), path)  # shardwise calibrate wrote it: strict JSON, bounded
    if not isinstance(raw, dict):
        raise ShardwiseError(f"{path}: expected a JSON object (a hardware profile), got {type(raw).__name__}")
    try:
        profile = HardwareProfile.model_validate(raw)
    except ValidationError as e:
        raise user_error(e, str(path), model=HardwareProfile, header=f"{path}: invalid hardware profile") from None
    profile.check_device(path, device)
    return profile
