"""Turn plans into the `--json` object (schema: docs/plan-json.md) and the lines printed around the
tables (links, the load phase, a row's label); the tables and formats: shardwise/cli/render.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise import catalog
from shardwise.plan.evaluate import Evaluation
from shardwise.plan.memory import MemoryPlan
from shardwise.plan.network import nic_bytes_per_s_per_gpu
from shardwise.specs.hardware import GIB, HardwareSpec
from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec


def links(hw: HardwareSpec) -> dict:
    """The links the plan assumed: inside a node (`what` it is, and whether it is the GPU's own
    link or one named by --interconnect / a profile) and between nodes (unused on one node)."""
    own = gpu_own_link(hw)
    return {
        "intra": {"name": hw.intra.name, "what": hw.intra.what, "gpu_default": own == hw.intra.name,
                  "gpu_link": own, "bus_bytes_per_s": hw.intra.bus_bytes_per_s,
                  "latency_s": hw.intra.latency_s, "used": hw.gpus_per_node > 1},
        "inter": {"name": hw.inter.name, "what": hw.inter.what, "bus_bytes_per_s": hw.inter.bus_bytes_per_s,  # per NIC
                  "latency_s": hw.inter.latency_s, "used": hw.nodes > 1,
                  "node_bytes_per_s": hw.inter_node_bytes_per_s,  # all of a node's NICs
                  "gpu_bytes_per_s": nic_bytes_per_s_per_gpu(hw)},  # a GPU's share of them
    }  # fmt: skip


def gpu_own_link(hw: HardwareSpec) -> str | None:
    """The link the catalog gives the plan's GPU (None for a GPU the catalog does not know)."""
    return catalog.gpu_link(hw.gpu.name) if hw.gpu.name in catalog.gpu_names() else None


def links_line(hw: HardwareSpec) -> str:
    """`1 node(s) × 4 GPUs; links: intra-node pcie4 20 GB/s (PCIe 4.0 x16, no NVLink; the
    rtx-4090's own), inter-node ib-200 22 GB/s per NIC × 4 per node (unused)`."""
    def one(where: str, link, used: bool, extra: str = "") -> str:
        return f"{where} {link.name} {link.bus_bytes_per_s / 1e9:g} GB/s{extra}" + ("" if used else " (unused)")

    own = gpu_own_link(hw)
    whose = (f"the {hw.gpu.name}'s own" if own == hw.intra.name
             else f"not the {hw.gpu.name}'s own {own}" if own else "")
    about = "; ".join(x for x in (hw.intra.what, whose) if x)
    nics = round(hw.inter_node_bytes_per_s / hw.inter.bus_bytes_per_s)
    per_nic = f" per NIC × {nics} per node" if nics > 1 else ""
    return (f"{hw.nodes} node(s) × {hw.gpus_per_node} GPUs; links: "
            f"{one('intra-node', hw.intra, hw.gpus_per_node > 1, f' ({about})' if about else '')}, "
            f"{one('inter-node', hw.inter, hw.nodes > 1, per_nic)}")


def hardware_json(hw: HardwareSpec, profile: str | Path | None = None) -> dict[str, Any]:
    """The hardware as planned: the catalog's figures with a profile's measured ones in place
    (every GPUSpec rate and efficiency, PCIe, the time model's constants such as the host's Adam
    rates), where each efficiency and constant comes from, and which profile that was."""
    return {
        "gpu": hw.gpu.name, "gpu_memory_bytes": hw.gpu.memory_bytes, "gpus": hw.world_size,
        "gpus_per_node": hw.gpus_per_node, "nodes": hw.nodes, "intra": hw.intra.name,
        "inter": hw.inter.name, "links": links(hw), "host_memory_bytes": hw.host_memory_bytes,
        "gpu_rates": hw.gpu.model_dump(mode="json", exclude={"name", "memory_bytes", "efficiency_provenance"}),
        "gpu_rates_kind": {k: p.kind for k, p in hw.gpu.efficiency_provenance.items()},
        "pcie_bytes_per_s": hw.pcie_bytes_per_s, "nics_per_node": hw.nics_per_node,
        "timing": hw.timing.model_dump(mode="json", exclude={"provenance"}),
        "timing_kind": {k: p.kind for k, p in hw.timing.provenance.items()},
        "profile": None if profile is None else str(profile),
    }


def engine_knobs(strategy, model: ModelSpec) -> dict[str, Any]:
    """The engine settings a row was planned with: its engine's knob class, every field (the
    names of the trainer YAML's strategy.deepspeed / fsdp / ddp sections and plan's --ds-* /
    --fsdp-* / --ddp-* flags), DeepSpeed's defaulted ones as they resolve (overlap_comm by stage,
    ZeRO-3's fetch unit for this model)."""
    knobs = {"deepspeed": strategy.ds, "fsdp2": strategy.fsdp, "ddp": strategy.ddp}[strategy.engine]
    out = knobs.model_dump(mode="json")
    if strategy.engine == "deepspeed":
        out["overlap_comm"] = knobs.overlap(strategy.zero_stage or 0)
        if strategy.zero_stage == 3:
            out["fetch_unit"] = knobs.zero3_unit(model.params_per_layer / strategy.tp)
    if strategy.zero_impl == "megatron":  # Megatron-Core's distributed optimizer, not DeepSpeed's knobs
        out = {"zero_impl": "megatron", "overlap_comm": out["overlap_comm"],
               "grad_reduce_in_bf16": strategy.grad_reduce_in_bf16}
    if strategy.shard_group is not None:
        out["shard_group"] = strategy.shard_group
    return out


def plan_json(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, evals: list[Evaluation],
              accounting: str = "engine", recommended=None, *, skipped: dict[str, str] | None = None,
              profile: str | Path | None = None) -> dict:
    plans = [e.memory for e in evals]
    doc: dict[str, Any] = {
        "model": {"name": model.name, "params": model.params, "active_params": model.active_params},
        "hardware": hardware_json(hw, profile),
        "train": train.model_dump(mode="json"),
        "accounting": accounting,
        "strategies": [
            {
                "name": p.strategy.name,
                "engine": p.engine_strategy.engine,
                "runs_as": p.runs_as.name if p.runs_as else None,
                "knobs": engine_knobs(p.strategy, model),
                # FSDP2 under accumulation: held unsharded grads or a reduce-scatter per micro-batch,
                # and why (plan/evaluate.py fsdp_grad_sync: "auto" resolved); null where there is no choice
                "grad_sync": p.grad_sync.as_dict() if p.grad_sync and not p.runs_as else None,
                # what the row runs: `train.checkpointing`, or what "auto" chose for it and why
                # (plan/recompute.py); the choice null where the run sets it
                "checkpointing": e.train.checkpointing,
                "checkpointing_choice": e.recompute.as_dict() if e.recompute else None,
                "tp": p.layout.tp,
                "pp": p.layout.pp,
                "cp": p.layout.cp,
                "cp_impl": p.strategy.cp_scheme if p.layout.cp > 1 else None,
                # expert parallelism (plan/experts.py; planned only): 1 = none
                "ep": p.layout.ep,
                "ep_load_imbalance": p.strategy.ep_load_imbalance,
                "etp": p.layout.expert_tp if p.layout.ep > 1 else None,  # TP ranks per routed expert
                "ep_overlap": p.strategy.ep_overlap,
                "dp": p.layout.dp,
                "dp_shard": p.layout.dp_shard,
                "dp_replicate": p.layout.dp_replicate,
                "fits": p.fits,
                "usable_bytes": p.usable_bytes,
                "memory": p.gpu.as_dict(),
                "host_memory": p.host.as_dict(),
                "comm": e.comm.as_dict(),
                "comm_ideal": e.ideal.as_dict(),
                "time": e.time.as_dict(),
            }
            for p, e in zip(plans, evals, strict=False)
        ],
        "skipped_strategies": dict(skipped or {}),
    }
    if recommended is not None:
        b = recommended.best
        doc["recommended"] = b.strategy.name
        doc["recommended_setting"] = recommended.setting()
        doc["runner_up"] = recommended.runner_up.strategy.name if recommended.runner_up else None
        doc["reason"] = recommended.reason
        doc["plan_only_alternatives"] = [a.as_dict() for a in recommended.alternatives]
    return doc


def label(p: MemoryPlan) -> str:
    """A table row's strategy: its name, and the engine it runs as when that differs (FSDP2 with
    a one-rank shard group runs as DDP: FSDPKnobs.single_rank)."""
    return p.strategy.name + (f" (as {p.runs_as.name})" if p.runs_as else "")


def loss_words(train: TrainSpec, flag: bool = True) -> str:
    """The loss the plan assumed, and the trainer's default where they differ: the logits'
    memory depends on it (`standard`: [tokens, vocab] fp32 whole; `chunked`: one chunk)."""
    from shardwise.config.schema import LossSection

    trainer = LossSection().implementation
    said = f"loss {train.cross_entropy}" + (f" ({train.ce_chunk} tokens a chunk)" if train.cross_entropy == "chunked"
                                           else "")
    if train.cross_entropy != trainer:
        said += f" (shardwise train's default is {trainer}" + (
            f": plan it with --cross-entropy {trainer})" if flag else ")")
    return said


def load_line(plans: list[MemoryPlan]) -> str | None:
    """The load phase on the host, per rank and per node, for each load path the plans take
    (shardwise.plan.load): one line under the memory table."""
    seen: dict[str, list[str]] = {}
    first: dict[str, MemoryPlan] = {}
    for p in plans:
        load = p.host.load
        if load.per_rank:
            key = f"{load.path}:{load.per_rank:.0f}"
            seen.setdefault(key, []).append(label(p))
            first.setdefault(key, p)
    if not seen:
        return None
    parts = []
    for key, names in seen.items():
        load = first[key].host.load
        parts.append(f"{load.per_rank / GIB:.1f} GiB per rank, {load.per_node / GIB:.1f} GiB per node of "
                     f"{load.ranks_per_node} ({load.path}: {', '.join(names)})")
    cap = plans[0].host_capacity_bytes
    return (f"Host memory while the weights load (a safetensors checkpoint read into each rank's part; "
            f"node has {cap / GIB:.0f} GiB): " + "; ".join(parts))
