"""HardwareSpec: GPU, how many, and the links between them (bundled presets + overrides)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shardwise.config.base import Spec
from shardwise.errors import ShardwiseError
from shardwise.specs.timing_model import Provenance, TimingModel

GB = 1e9
GIB = 2**30


class GPUSpec(Spec):
    name: str
    memory_bytes: float = Field(gt=0)
    bf16_flops: float = Field(ge=0)  # dense peak, no sparsity
    fp16_flops: float = Field(ge=0)
    fp32_flops: float = Field(gt=0)
    fp8_flops: float = Field(0.0, ge=0, description="dense FP8 (E4M3) tensor-core peak with fp32 accumulation; 0: "
                             "no FP8 tensor cores")
    hbm_bytes_per_s: float = Field(gt=0)
    # What real kernels sustain, as fractions of the datasheet figures above (timing.py), with
    # where each figure comes from (`efficiency_provenance`): the catalog's by GPU family
    # (catalog/timing.yaml, docs/accuracy.md); `shardwise calibrate` measures them on the user's GPU.
    family: str = Field("default", description="catalog/timing.yaml family whose efficiencies this GPU uses")
    gemm_efficiency: float = Field(gt=0, le=1, description="large bf16 GEMMs / dense peak")
    attention_efficiency: float = Field(gt=0, le=1, description="flash/SDPA fwd+bwd / dense peak")
    hbm_efficiency: float = Field(gt=0, le=1, description="streaming kernels (optimizer, copies) / HBM bandwidth")
    # The flash-attn 2 package's kernels (`attention: flash`), where they differ from what SDPA runs
    # on this GPU (on Hopper torch's SDPA runs cuDNN's kernels; FlashAttention-2 was written for
    # Ampere). None: the same as attention_efficiency.
    flash_attention_efficiency: float | None = Field(None, gt=0, le=1, description="flash-attn 2 fwd+bwd / dense peak")
    # llm-foundry's Triton flash attention (`attention: triton`); None: attention_efficiency.
    triton_attention_efficiency: float | None = Field(None, gt=0, le=1,
                                                      description="llm-foundry's Triton flash attention fwd+bwd / dense peak")
    efficiency_provenance: dict[str, Provenance] = Field(default_factory=dict)
    # A measured AdamW step rate (`shardwise calibrate`): fp32 parameters updated per second by
    # the `adamw_impl` kernel. When set, the planner prices the optimizer step from it (timing.py
    # `optimizer_time`) instead of the optimizer's bytes at `hbm_efficiency`.
    adamw_params_per_s: float | None = Field(None, gt=0, description="measured AdamW step rate, params/s")
    adamw_impl: Literal["fused", "foreach", "forloop"] | None = Field(
        None, description="the AdamW kernel adamw_params_per_s was measured with")

    def attention_efficiency_of(self, kernel: str) -> float:
        """Sustained fraction of peak of the attention kernel a run uses (TrainSpec.attention)."""
        if kernel == "flash" and self.flash_attention_efficiency is not None:
            return self.flash_attention_efficiency
        if kernel == "triton" and self.triton_attention_efficiency is not None:
            return self.triton_attention_efficiency
        return self.attention_efficiency

    def peak_flops(self, dtype: str) -> float:
        """Dense peak for the compute dtype; V100 has no bf16, so bf16 falls back to fp32 rate.
        fp8 has no fallback: a GPU without FP8 tensor cores is refused."""
        if dtype == "fp8":
            if not self.fp8_flops:
                raise ShardwiseError(f"{self.name} has no FP8 tensor-core rate in the catalog (Ampere, Volta and "
                                     "older have no FP8 tensor cores; catalog/hardware.yaml fp8_tflops records those "
                                     "that do): plan --fp8 on a GPU that has one, or drop --fp8")
            return self.fp8_flops
        f = {"bf16": self.bf16_flops, "fp16": self.fp16_flops, "fp32": self.fp32_flops}[dtype]
        return f or self.fp32_flops


class LinkSpec(Spec):
    name: str
    # achievable bus bandwidth, one direction: per GPU inside a node, per NIC between nodes
    bus_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    nic_per_gpu: bool = True  # between nodes: one NIC per GPU (HGX/DGX rails), else one per node
    what: str = ""  # what the link is, in words (catalog/hardware.yaml), for the plan's header


class HardwareSpec(Spec):
    gpu: GPUSpec
    gpus_per_node: int = Field(8, gt=0)
    nodes: int = Field(1, gt=0)
    intra: LinkSpec  # between GPUs of one node
    timing: TimingModel  # the time model's constants (catalog/timing.yaml, or a profile's measurements)
    inter: LinkSpec  # between nodes (unused when nodes == 1)
    pcie_bytes_per_s: float = Field(25 * GB, gt=0)  # GPU<->host, PCIe 4.0 x16 achievable
    host_memory_bytes: float = Field(2048 * GB, gt=0)  # per node (DGX A100-80G / H100: 2 TB)
    nics_per_node: int | None = Field(None, gt=0, description="None: one per GPU where the inter link says so, else 1")

    @model_validator(mode="after")
    def _check(self) -> HardwareSpec:
        if self.gpus_per_node > 72:  # a GB200 NVL72 rack: 72 GPUs in one NVLink domain
            raise ShardwiseError(f"gpus_per_node {self.gpus_per_node} is implausible (expected 1..72)")
        if self.nics_per_node is not None and self.nics_per_node > self.gpus_per_node:
            raise ShardwiseError(
                f"--nics-per-node {self.nics_per_node} exceeds the {self.gpus_per_node} GPUs per node: expected "
                f"1..{self.gpus_per_node} (the planner gives each GPU at most one NIC; HGX/DGX nodes have one per GPU)")
        return self

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def inter_node_bytes_per_s(self) -> float:
        """A node's aggregate NIC bandwidth: what a ring (one per NIC) spanning nodes sustains."""
        nics = self.nics_per_node or (self.gpus_per_node if self.inter.nic_per_gpu else 1)
        return self.inter.bus_bytes_per_s * nics
