"""Known silent failures of a training setup (`silent_failures(setup)`): configurations that
start and train, but not as planned, each with its public report.

The setup comes from plan flags or a config file: shardwise's training YAML, a DeepSpeed JSON,
an accelerate config YAML (its `deepspeed_config_file` followed), or a TrainingArguments /
LLaMA-Factory / axolotl YAML or JSON, read for the few keys these checks need (`read_setup`;
`plan --from` reads the whole file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.doctor.checks import Finding
from shardwise.errors import ShardwiseError

FLOAT_STORAGE = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Setup:
    """What the checks look at; None: not said (the tool's default applies)."""

    engine: str | None = None  # deepspeed | fsdp2 | fsdp1 | ddp
    zero_stage: int | None = None
    four_bit: bool = False  # a bitsandbytes 4-bit (QLoRA) base
    quant_storage: str | None = None  # bnb_4bit_quant_storage (bitsandbytes' default: uint8)
    hpz_partition_size: int | None = None  # ZeRO++ zero_hpz_partition_size
    source: str = "flags"
    keys_read: tuple[str, ...] = field(default_factory=tuple)
    strategy: str | None = None  # a shardwise strategy name (its YAML's strategy.name, or -s)
    shardwise: bool = False  # shardwise's own YAML: its trainer refuses QLoRA on a sharding strategy


def _walk(doc: Any, prefix: str = ""):
    if isinstance(doc, dict):
        for k, v in doc.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            yield key, v
            yield from _walk(v, key)


def _load(path: Path) -> Any:
    from shardwise.config.safe_yaml import read_yaml

    if not path.is_file():
        raise ShardwiseError(f"{path}: setup file not found (expected a DeepSpeed JSON, an accelerate YAML or a "
                             "training YAML)")
    return read_yaml(path)[1]  # JSON is YAML: one safe reader


def read_setup(path: str | Path) -> Setup:
    path = Path(path)
    doc = _load(path)
    if not isinstance(doc, dict):
        raise ShardwiseError(f"{path}: expected a mapping of settings, got {type(doc).__name__}")
    found: dict[str, Any] = {}
    read: list[str] = []
    for key, value in _walk(doc):
        leaf = key.rsplit(".", 1)[-1]
        if leaf in ("stage", "zero_hpz_partition_size", "bnb_4bit_quant_storage", "quant_storage",
                    "bnb_4bit_quant_storage_dtype", "load_in_4bit", "quantization_bit", "fsdp_version",
                    "distributed_type", "deepspeed", "deepspeed_config_file", "fsdp", "quantization", "name",
                    "zero_stage"):
            if leaf == "stage" and not key.endswith("zero_optimization.stage"):
                continue
            if leaf == "name" and key != "strategy.name":
                continue
            if leaf == "quantization" and key != "lora.quantization":
                continue
            found[leaf] = value
            read.append(key)
    engine, stage = None, found.get("stage", found.get("zero_stage"))  # accelerate's deepspeed_config.zero_stage
    ds_file = found.get("deepspeed_config_file") or (found.get("deepspeed") if isinstance(found.get("deepspeed"), str)
                                                      else None)
    if ds_file:
        # beside the file, else from the working directory (LLaMA-Factory's examples name
        # examples/deepspeed/ds_z3_config.json from the repository root)
        beside = Path(ds_file) if Path(ds_file).is_absolute() else path.parent / ds_file
        inner = read_setup(beside if beside.is_file() or not Path(ds_file).is_file() else Path(ds_file))
        stage, read = inner.zero_stage, [*read, *(f"{ds_file}: {k}" for k in inner.keys_read)]
        found.setdefault("zero_hpz_partition_size", inner.hpz_partition_size)
        engine = "deepspeed"
    if found.get("distributed_type") == "DEEPSPEED" or stage is not None:
        engine = "deepspeed"
    elif found.get("distributed_type") == "FSDP" or found.get("fsdp"):
        engine = "fsdp2" if str(found.get("fsdp_version", 1)) == "2" else "fsdp1"
    name = str(found.get("name", ""))
    if name:
        from shardwise.specs import Strategy

        s = Strategy.from_name(name)
        engine, stage = s.engine, s.zero_stage if s.engine == "deepspeed" else None
    four = bool(found.get("load_in_4bit")) or str(found.get("quantization_bit", "")) == "4" \
        or found.get("quantization") == "nf4"
    storage = found.get("bnb_4bit_quant_storage") or found.get("bnb_4bit_quant_storage_dtype") \
        or found.get("quant_storage")
    hpz = found.get("zero_hpz_partition_size")
    return Setup(engine=engine, zero_stage=int(stage) if isinstance(stage, int | str) and str(stage).isdigit()
                 else None, four_bit=four, quant_storage=str(storage) if storage else None,
                 hpz_partition_size=int(hpz) if isinstance(hpz, int) else None, source=str(path),
                 keys_read=tuple(read), strategy=name or None, shardwise=bool(name))


def _shards_base(name: str) -> bool:
    from shardwise.specs import Strategy

    st = Strategy.from_name(name)
    return st.shards_params or st.offload_params


def silent_failures(s: Setup, deepspeed_version: str | None = None) -> list[Finding]:
    if s.shardwise and s.four_bit and s.strategy and _shards_base(s.strategy):
        # not silent in shardwise: train/lora.check_qlora refuses it before any rank starts
        return [Finding("error", "qlora-sharded", (
            f"{s.source}: lora.quantization nf4 with a strategy that shards or offloads parameters: shardwise "
            "train refuses it before any rank starts (a replicated base: ddp, zero0, zero1, zero2); the same "
            "setup in accelerate/DeepSpeed needs bnb_4bit_quant_storage set to the model's dtype."))]
    out = []
    storage = (s.quant_storage or "uint8").removeprefix("torch.")
    integer_storage = storage not in FLOAT_STORAGE
    said = f"bnb_4bit_quant_storage {storage}" + ("" if s.quant_storage else " (bitsandbytes' default)")
    if s.four_bit and s.engine == "fsdp2" and integer_storage:
        out.append(Finding("error", "fsdp2-qlora-uint8", (
            f"FSDP2 with a 4-bit base and {said}: fully_shard shards the uint8 Params4bit like any tensor and "
            "loses their quant_state, which crashes or silently corrupts the base (accelerate#3983). Set "
            "bnb_4bit_quant_storage to the model's dtype (bfloat16), as FSDP-QLoRA requires.")))
    if s.four_bit and s.engine == "fsdp1" and integer_storage:
        out.append(Finding("error", "fsdp-qlora-uint8", (
            f"FSDP with a 4-bit base and {said}: FSDP flattens only floating tensors of one dtype; set "
            "bnb_4bit_quant_storage to the model's dtype (bitsandbytes' FSDP-QLoRA guide).")))
    if s.four_bit and s.engine == "deepspeed" and s.zero_stage == 3 and integer_storage:
        out.append(Finding("error", "zero3-4bit-unsharded", (
            f"ZeRO-3 with a 4-bit base and {said}: ZeRO-3 cannot partition integer-stored 4-bit weights, so each "
            "rank keeps its whole quantized base (and zero.Init is skipped for QLoRA: transformers#29587) — "
            "the memory of sharding is not there. Set bnb_4bit_quant_storage to the model's dtype (peft's "
            "'QLoRA and DeepSpeed ZeRO-3' guide).")))
    if s.engine == "deepspeed" and s.hpz_partition_size and s.hpz_partition_size > 1:
        out.append(Finding("warning", "zero-hpz", (
            f"ZeRO++ hpZ (zero_hpz_partition_size {s.hpz_partition_size}): reported to leave the loss stuck or "
            "at 0 with a zero grad norm (DeepSpeed#6926, #5059), to converge worse (#4851) and to start high "
            f"after a resume (#7606){f', on DeepSpeed {deepspeed_version} here' if deepspeed_version else ''}. "
            "Compare the first steps' loss with hpZ off before a long run.")))
    return out


def from_flags(strategy: str | None, qlora: bool, quant_storage: str | None) -> Setup | None:
    """The setup `doctor -s NAME [--qlora] [--quant-storage DTYPE]` describes (None: no setup)."""
    if strategy is None and not qlora:
        return None
    engine = stage = None
    if strategy:
        from shardwise.specs import Strategy

        st = Strategy.from_name(strategy)
        engine, stage = st.engine, st.zero_stage if st.engine == "deepspeed" else None
    return Setup(engine=engine, zero_stage=stage, four_bit=qlora, quant_storage=quant_storage, strategy=strategy,
                 keys_read=tuple(k for k, v in (("--strategy", strategy), ("--qlora", qlora),
                                                ("--quant-storage", quant_storage)) if v))
