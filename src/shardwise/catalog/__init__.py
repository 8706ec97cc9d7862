"""Bundled model and hardware presets (YAML data beside this file), looked up by name."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import yaml

from shardwise.config.fields import check_count, check_number
from shardwise.errors import ShardwiseError, did_you_mean
from shardwise.specs import hf_hub
from shardwise.specs.hardware import GB, GPUSpec, HardwareSpec, LinkSpec
from shardwise.specs.memory_model import MemoryModel
from shardwise.specs.model import ModelSpec
from shardwise.specs.timing_model import Provenance, TimingModel

_HERE = Path(__file__).parent
# libyaml's loader where PyYAML was built with it (10x the pure-Python one: every process of a
# run reads the catalog); the same safe constructors either way.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(name: str) -> dict[str, dict]:
    return yaml.load((_HERE / name).read_text(), Loader=_LOADER)


@cache
def _models() -> dict[str, dict]:
    return _load("models.yaml")


@cache
def _hardware() -> dict[str, dict]:
    return _load("hardware.yaml")


@cache
def _timing() -> dict[str, dict]:
    return _load("timing.yaml")


def _provenance(entry: dict) -> Provenance:
    prov = {k: entry[k] for k in ("kind", "basis", "cases", "sources") if k in entry}
    return Provenance(**{k: tuple(v) if isinstance(v, list) else v for k, v in prov.items()})


def _constant(entry: dict) -> tuple[float, Provenance]:
    return float(entry["value"]), _provenance(entry)


@cache
def timing_model() -> TimingModel:
    """The bundled time model (catalog/timing.yaml): its constants and their provenance."""
    engine = _timing()["engine"]
    values, prov = {}, {}
    for name in TimingModel.constant_names():
        values[name], prov[name] = _constant(engine[name])
    return TimingModel(**values, provenance=prov)


@cache
def _memory() -> dict[str, dict]:
    return _load("memory.yaml")


@cache
def memory_model() -> MemoryModel:
    """The bundled memory model (catalog/memory.yaml): its constants and their provenance. A
    constant missing from the file, or one the model does not have, is refused by name."""
    table = _memory()
    names = MemoryModel.constant_names()
    missing, unknown = [n for n in names if n not in table], sorted(set(table) - set(names))
    if missing or unknown:
        raise ShardwiseError(f"catalog/memory.yaml: missing {missing}, unknown {unknown}: expected one entry per "
                             f"MemoryModel constant ({', '.join(names)})")
    values, prov = {}, {}
    for name in names:
        entry = table[name]
        if not isinstance(entry, dict) or "value" not in entry:
            raise ShardwiseError(f"catalog/memory.yaml {name}: expected a mapping with value, kind and basis")
        try:
            values[name], prov[name] = entry["value"], _provenance(entry)
        except ShardwiseError as e:
            raise ShardwiseError(f"catalog/memory.yaml {name}: {e}") from None
    return MemoryModel(**values, provenance=prov)


EFFICIENCIES = ("gemm_efficiency", "attention_efficiency", "hbm_efficiency")
OPTIONAL_EFFICIENCIES = ("flash_attention_efficiency", "triton_attention_efficiency")


def family_efficiencies(family: str, _seen: tuple[str, ...] = ()) -> tuple[dict[str, float], dict[str, Provenance]]:
    """A GPU family's kernel efficiencies and their provenance (catalog/timing.yaml `families`).

    A family, or one constant of it, may `borrow` another family's value (with a `basis`: why
    that family): the value is the other's, the provenance `assumed`, naming the family it comes
    from and how that one was established, since no run on these GPUs informed it."""
    if family in _seen:
        raise ShardwiseError(f"catalog/timing.yaml families: {' -> '.join((*_seen, family))} borrow in a cycle")
    fam = _timing()["families"][family]
    values, prov = {}, {}
    for name in EFFICIENCIES + OPTIONAL_EFFICIENCIES:
        entry = fam.get(name, {"borrow": fam["borrow"], "basis": fam["basis"]} if "borrow" in fam else None)
        if entry is None:
            if name in EFFICIENCIES:
                raise ShardwiseError(f"catalog/timing.yaml family {family}: no {name}")
            continue
        if "borrow" in entry:
            base = entry["borrow"]
            base_values, base_prov = family_efficiencies(base, (*_seen, family))
            if name not in base_values:
                continue
            values[name] = base_values[name]
            prov[name] = Provenance(kind="assumed", basis=f"borrowed from {base} ({base_prov[name].label()} "
                                    f"there): {' '.join(str(entry['basis']).split())}")
        else:
            values[name], prov[name] = _constant(entry)
    return values, prov


def family_borrows(family: str) -> dict[str, str]:
    """Which family each of a family's efficiencies is borrowed from (catalog/timing.yaml `borrow`:
    the family named, which may itself borrow); constants the family states itself are absent."""
    fam = _timing()["families"][family]
    out = {}
    for name in EFFICIENCIES + OPTIONAL_EFFICIENCIES:
        entry = fam.get(name, {"borrow": fam["borrow"]} if "borrow" in fam else None)
        if entry is not None and "borrow" in entry:
            out[name] = entry["borrow"]
    return out


def family_names() -> list[str]:
    return list(_timing()["families"])


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


_MODEL_KEYS = frozenset({"shape", "hf", "source"})


@cache
def _hub_ids() -> dict[str, str]:
    """Lower-cased Hugging Face id -> catalog key (models.yaml `hf:`); an entry with a key it
    does not know, or an id listed under two entries, is refused by name."""
    out: dict[str, str] = {}
    for key, entry in _models().items():
        unknown = sorted(set(entry) - _MODEL_KEYS)
        if unknown or "shape" not in entry:
            raise ShardwiseError(f"catalog/models.yaml {key}: keys {unknown or 'without shape'}: expected shape "
                                 "(the ModelSpec fields), hf (its Hugging Face ids) and source")
        for hub_id in entry.get("hf", ()):
            other = out.setdefault(hub_id.lower(), key)
            if other != key:
                raise ShardwiseError(f"catalog/models.yaml: {hub_id!r} is listed under {other} and {key}")
    return out


def model_key(name: str) -> str | None:
    """The catalog key a model name means: a key (`qwen3-4b`) or a Hugging Face id an entry
    lists (`Qwen/Qwen3-4B`), either without regard to case; None for any other name."""
    name = name.strip().lower()
    return name if name in _models() else _hub_ids().get(name)


def model_hub_ids(key: str) -> list[str]:
    """The Hugging Face ids catalog entry `key` lists (models.yaml `hf:`)."""
    return list(_models()[key].get("hf", ()))


@cache
def _catalog_model(key: str) -> ModelSpec:
    _hub_ids()  # every entry's keys checked, once
    return ModelSpec(name=key, **_models()[key]["shape"])


def get_model(name: str) -> ModelSpec:
    """The ModelSpec a model name means (find_model, without remote code)."""
    return find_model(name)[0]


def find_model(name: str, *, trust_remote_code: bool = False,
               opt_in: str | None = None) -> tuple[ModelSpec, Path | None]:
    """The one resolution of a model name (`plan --model`, `explain`, a `plan --from` file's
    model id, the trainer's `model.name`): its ModelSpec, and the config.json it was read from
    (None for a catalog entry).

    1. the bundled catalog: an entry's key or one of the Hugging Face ids it lists;
    2. any other Hugging Face id (ORG/NAME): its config.json from the local Hugging Face cache,
       else downloaded from the Hub unless HF_HUB_OFFLINE is set (shardwise.specs.hf_hub: the
       config.json only; one that ships its own code, `auto_map`, is refused unless
       `trust_remote_code`; `opt_in` says how this caller's user asks for that).

    Any other name is refused listing the catalog's keys, closest first."""
    key = model_key(name)
    if key is not None:
        return _catalog_model(key), None
    name = name.strip()
    if hf_hub.is_hub_id(name):
        try:
            return hf_hub.spec_from_hub(name, trust_remote_code=trust_remote_code, opt_in=opt_in)
        except ShardwiseError as e:
            hint = _similar_key(name)
            raise ShardwiseError(f"{e}{f' (the catalog has {hint!r}: --model {hint})' if hint else ''}") from None
    raise ShardwiseError(f"unknown model {name!r}: expected a catalog model or a Hugging Face id (ORG/NAME). "
                         f"{did_you_mean(name.lower(), model_names())}")


def _similar_key(hub_id: str) -> str | None:
    """A catalog key named like a Hugging Face id's model (`unsloth/Llama-3.2-3B-Instruct` ->
    llama-3.2-3b), offered as a hint only: a fine-tune or re-upload may have another shape."""
    n = hub_id.rstrip("/").split("/")[-1].lower()
    n = re.sub(r"^meta-", "", n)
    for _ in range(2):
        n = re.sub(r"-(hf|instruct|chat|base|it|pt)$", "", n)
    return n if n in _models() else None


@cache
def get_gpu(name: str) -> GPUSpec:
    key, g = _entry(_hardware()["gpus"], name, "GPU")
    return GPUSpec(
        name=key,
        memory_bytes=g["memory_mib"] * 2**20 if "memory_mib" in g else g["memory_gb"] * GB,
        bf16_flops=g["bf16_tflops"] * 1e12,
        fp16_flops=g["fp16_tflops"] * 1e12,
        fp32_flops=g["fp32_tflops"] * 1e12,
        fp8_flops=g.get("fp8_tflops", 0) * 1e12,
        hbm_bytes_per_s=g["hbm_gbps"] * GB,
        family=g.get("family", "default"),
        **_efficiencies(g.get("family", "default")),
    )


def _efficiencies(family: str) -> dict:
    values, prov = family_efficiencies(family)
    return values | {"efficiency_provenance": prov}


@cache
def get_link(name: str, gpu: str | None = None) -> LinkSpec:
    """A link preset. `nvlink` and `pcie` mean a generation, the GPU's own (its `nvlink:` /
    `pcie:` in hardware.yaml), so they need `gpu`; a GPU without NVLink is refused, naming the
    link it has, rather than priced at some other generation."""
    key, link = _entry(_hardware()["interconnects"], name, "interconnect")
    if "generic" in link:
        key = _generation(key, link["generic"], gpu)
        link = _hardware()["interconnects"][key]
    return LinkSpec(name=key, bus_bytes_per_s=link["bus_gbps"] * GB, latency_s=link["latency_us"] * 1e-6,
                    nic_per_gpu=link.get("nic_per_gpu", True), what=link.get("what", ""))


def _generation(key: str, family: str, gpu: str | None) -> str:
    """The GPU's own generation of a link family (`nvlink` -> nvlink3 on an A100)."""
    if gpu is None:
        gens = sorted(k for k, v in _hardware()["interconnects"].items() if k.startswith(family) and "generic" not in v)
        raise ShardwiseError(f"interconnect {key!r} means the GPU's own generation: name the GPU, or a "
                             f"generation ({', '.join(gens)})")
    gkey, g = _entry(_hardware()["gpus"], gpu, "GPU")
    if family not in g:
        own = g["link"]
        own_pcie = "pcie (its own generation) or " if "pcie" in g else ""  # GB200: NVLink-C2C, no PCIe
        raise ShardwiseError(
            f"--interconnect {key}: {gkey} has no {'NVLink' if family == 'nvlink' else 'PCIe link'} (its GPUs "
            f"talk over {own}: {_hardware()['interconnects'][own].get('what', own)}); leave --interconnect out for "
            f"that, or name a link inside a node: {own_pcie}one of "
            f"{', '.join(k for k in intra_link_names() if 'generic' not in _hardware()['interconnects'][k])}")
    return g[family]


def gpu_nvlink(gpu: str) -> str | None:
    """The GPU's NVLink generation (hardware.yaml `nvlink:`), None for a GPU without NVLink."""
    return _entry(_hardware()["gpus"], gpu, "GPU")[1].get("nvlink")


def check_link_name(name: str) -> str:
    """The catalog key of an interconnect name, or the error listing the valid ones."""
    return _entry(_hardware()["interconnects"], name, "interconnect")[0]


def intra_link_names() -> list[str]:
    return [k for k, v in _hardware()["interconnects"].items() if v.get("scope", "intra") == "intra"]


def gpu_link(gpu: str) -> str:
    """The link a GPU's node talks over by default (hardware.yaml `link:`)."""
    return _entry(_hardware()["gpus"], gpu, "GPU")[1]["link"]


def gpu_network(gpu: str) -> str:
    """The link between nodes of this GPU by default (hardware.yaml `network:`: its reference
    node's NIC, else ib-200)."""
    return _entry(_hardware()["gpus"], gpu, "GPU")[1].get("network", "ib-200")


MAX_GPUS = 131_072  # --gpus above this is refused (the largest clusters today are ~100k GPUs)
MAX_GPUS_PER_NODE = 72  # HardwareSpec's limit (a GB200 NVL72 rack is one 72-GPU NVLink domain)


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
    """A HardwareSpec from preset names and overrides (every number checked first, naming
    the command-line flag it comes from).

    `interconnect` names the slowest link the data-parallel traffic crosses: an intra-node
    link replaces the link inside the node (`nvlink`/`pcie`: the GPU's own generation; a GPU
    without NVLink refuses `nvlink`), a network (ib-*, roce-*, eth-*) the
    link between nodes. Which one it is depends on how many GPUs share a node, so a network
    needs `gpus_per_node`, and so does an intra-node link on more than 8 GPUs (more than one
    node); only an intra-node link on up to 8 GPUs is unambiguous (one node, the default
    `gpus_per_node` = gpus). `intra`/`inter` (default: the GPU's own link, hardware.yaml
    `link:` / `network:`) name the links directly.
    """
    gpus = check_count("--gpus", gpus, high=MAX_GPUS,
                       hint=f" (GPUs in total; {MAX_GPUS:,} is the largest plan shardwise makes)")
    if gpus_per_node is not None:
        gpus_per_node = check_count("--gpus-per-node", gpus_per_node, high=MAX_GPUS_PER_NODE)
    if memory_gb is not None:
        check_number("--gpu-memory-gb", memory_gb, high=100_000, unit=" of GB")
    if "host_memory_bytes" in overrides:
        check_number("--host-memory-gb", overrides["host_memory_bytes"] / GB, high=1e6, unit=" of GB")
    scope = None
    if interconnect is not None:
        key, link = _entry(_hardware()["interconnects"], interconnect, "interconnect")
        interconnect, scope = key, link.get("scope", "intra")
        if gpus_per_node is None and (scope == "inter" or gpus > 8):
            what = "between nodes" if scope == "inter" else "inside a node"
            raise ShardwiseError(
                f"--interconnect {key} needs --gpus-per-node: it is a link {what}, and how many of the "
                f"{gpus} GPUs share a node decides which traffic crosses it (e.g. --gpus-per-node "
                f"{min(gpus, 8)} for nodes of {min(gpus, 8)} GPUs, --gpus-per-node 1 for single-GPU machines)")
    per_node = gpus_per_node or min(gpus, 8)
    if gpus % per_node:
        raise ShardwiseError(f"--gpus {gpus} is not a multiple of --gpus-per-node {per_node}: expected whole "
                             f"nodes (e.g. --gpus {per_node * (gpus // per_node + 1)})")
    nodes = gpus // per_node
    g = get_gpu(gpu)
    if memory_gb is not None:
        g = g.model_copy(update={"memory_bytes": memory_gb * GB})
    # the link the GPU has (A100 SXM: NVLink 3, H100/H200 SXM: 4, RTX 4090: PCIe 4.0, MI300X: xGMI)
    intra_link = get_link(intra or gpu_link(g.name), g.name)
    inter_link = get_link(inter or gpu_network(g.name))
    if interconnect:
        if scope == "inter":
            inter_link = get_link(interconnect)
        else:
            intra_link = get_link(interconnect, g.name)
    return HardwareSpec(gpu=g, gpus_per_node=per_node, nodes=nodes, intra=intra_link, inter=inter_link,
                        timing=timing_model(), **overrides)
