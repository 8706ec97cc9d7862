"""The time model's constants as one frozen value, each with where it comes from.

`plan/timing.py` prices a step from the model, the run and the hardware; what it cannot derive
from them (how much slower HF's eager elementwise code is than its byte count, what a kernel
launch or an engine's Python hook costs on the host, how much communication compute can hide)
lives here, not in module globals. A `HardwareSpec` carries one (`hw.timing`); the bundled
default is `catalog/timing.yaml`, which `benchmarks/fit_timing.py --write` rewrites for the
constants it may fit; a hardware profile measured by `shardwise calibrate` overrides what it
measured, and says so in the provenance.

A constant's provenance is one of:
- fitted: least squares on log(tokens/s), naming the cases and sources that inform it (the fit
  only frees a constant that at least 3 cases from at least 2 sources inform, and fails when
  one ends at a bound);
- measured: by what, where (a profile, `shardwise calibrate`, a CPU benchmark);
- derived: from what (a count, a formula);
- assumed: a citation, or the reason no better figure exists.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shardwise.config.base import Spec

Kind = Literal["fitted", "measured", "derived", "assumed"]


class Provenance(Spec):
    kind: Kind
    basis: str = Field(min_length=1, description="fitted: the cases and sources; measured: how and where; "
                       "derived: from what; assumed: a citation or why")
    cases: tuple[str, ...] = ()  # fitted: the cases that informed it
    sources: tuple[str, ...] = ()  # fitted: the sources those cases come from

    def label(self) -> str:
        if self.kind == "fitted":
            return f"fitted on {len(self.cases)} cases from {len(self.sources)} sources"
        return self.kind


class Constants(Spec):
    """A model's constants, each with the Provenance of its value (every field but `provenance`)."""

    provenance: dict[str, Provenance]

    @classmethod
    def constant_names(cls) -> tuple[str, ...]:
        return tuple(n for n in cls.model_fields if n != "provenance")

    @model_validator(mode="after")
    def _every_constant_has_provenance(self) -> Constants:
        names = set(self.constant_names())
        missing = sorted(names - set(self.provenance))
        unknown = sorted(set(self.provenance) - names)
        if missing or unknown:
            raise ValueError(f"provenance must name every constant: missing {missing}, unknown {unknown}")
        return self


class TimingModel(Constants):
    """What `plan/timing.py` needs beyond the specs. Times in seconds; factors are multipliers
    of the idealised per-op byte or kernel counts of plan/kernels.py."""

    # memory-bound work: eager HF elementwise code (norms, RoPE, activations, the loss) against the
    # per-op byte count, and the same work fused (torch.compile, Megatron's fused kernels)
    elementwise_factor: float = Field(gt=0)
    fused_elementwise_factor: float = Field(gt=0)
    # host: GPU idle per kernel launch in eager PyTorch, kernels per decoder layer (fwd + bwd),
    # the share of them left when elementwise chains are fused, per step outside the layers
    # (loss, optimizer, clipping), per chunk of the chunked loss, per tensor of a for-loop AdamW
    launch_s: float = Field(ge=0)
    kernels_per_layer: float = Field(gt=0)
    fused_kernel_share: float = Field(gt=0, le=1)
    step_kernels: float = Field(ge=0)
    ce_kernels_per_chunk: float = Field(ge=0)
    forloop_kernels_per_tensor: float = Field(ge=0)
    # engines' Python on the host: FSDP2's hooks per unit per hook, ZeRO-3's per hooked module per
    # pass (+ a share of that per fetched tensor), ZeRO-1/2's per parameter, DeepSpeed's step
    fsdp2_hook_s: float = Field(ge=0)
    zero3_hook_s: float = Field(ge=0)
    zero3_tensor_share: float = Field(ge=0)
    zero12_hook_s: float = Field(ge=0)
    deepspeed_step_s: float = Field(ge=0)
    # the host's optimizer step under offload, per node: DeepSpeed's CPU Adam (ZeRO offload) and
    # torch's AdamW on CPU tensors (FSDP2's CPUOffloadPolicy), fp32 parameters per second
    host_adam_params_per_s: float = Field(gt=0)
    host_torch_adam_params_per_s: float = Field(gt=0)
    # overlap: how much of compute can hide collectives; the share of FSDP2's side-stream copies
    # that lands on the step; the share of a bucketed reduction left after the last bucket
    overlap_efficiency: float = Field(ge=0, le=1)
    fsdp2_copy_exposed: float = Field(ge=0, le=1)
    exposed_reduce_share: float = Field(ge=0, le=1)
    # LoRA: the share of the engines' copies a frozen base leaves (gathered as stored, no cast;
    # only the adapters' gradients reduced)
    lora_copy_share: float = Field(ge=0, le=1)
    def with_values(self, values: dict[str, float], provenance: dict[str, Provenance] | None = None) -> TimingModel:
        """A copy with `values` in place (and their new provenance, where given)."""
        prov = dict(self.provenance) | dict(provenance or {})
        return TimingModel(**(self.model_dump(exclude={"provenance"}) | values), provenance=prov)

