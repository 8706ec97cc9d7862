"""What every `plan --from` reader returns, and the file handling they share.

A reader turns one file into a `Source`: the plan's inputs under `shardwise plan`'s parameter
names (`values`: what a flag of that name would set; a flag given on the command line wins),
the engine knobs (`knobs`, by the fields of shardwise.specs' knob classes), and the keys it
read (with what each became) and ignored (with why). `edits` turns a planned setting into the
key: value lines of that file's format (shardwise.ingest.advice ranks them). Torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.config.file import DuplicateKey, parse_json, read_text
from shardwise.config.safe_yaml import key_lines, parse_yaml
from shardwise.errors import ShardwiseError


@dataclass(frozen=True)
class Setting:
    """What the advice changes: a strategy and its batch split and checkpointing."""

    strategy: str
    micro_batch: int
    grad_accum: int
    checkpointing: str


def planner_defaults() -> dict[str, Any]:
    """TrainSpec's own defaults in flag form: what a file of another tool is planned with where
    neither the file, its tool's defaults (set by its reader) nor a flag say otherwise. (A bare
    `shardwise plan` plans the trainer's defaults instead: shardwise.run.trainer_defaults.)"""
    from shardwise.config.flags import RUN_FLAGS
    from shardwise.specs.train import TrainSpec

    out = {}
    for f in RUN_FLAGS:
        if f.param == "ce_chunk":  # given only where asked for: it needs the chunked loss
            continue
        d = TrainSpec.model_fields[f.param].default
        out[f.param] = ",".join(d) if isinstance(d, tuple) else d
    return out


@dataclass
class Source:
    format: str  # one of FORMATS' keys
    path: Path
    values: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, dict[str, Any]] = field(default_factory=lambda: {"ds": {}, "fsdp": {}, "ddp": {}})
    shard_group: int | None = None
    read: list[tuple[str, str]] = field(default_factory=list)  # (key, what it set)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    notes: list[str] = field(default_factory=list)
    # what changes memory or time and the file leaves unsaid or the plan cannot follow: printed
    # first, before the tables (the CLI's warnings), and in --json's from.warnings
    warnings: list[str] = field(default_factory=list)
    # (strategies this file's format can switch to, setting -> {key: value} in its format)
    family: tuple[str, ...] = ()
    keys_of: Callable[[Setting], dict[str, Any]] | None = None
    # the memory savers a TrainSpec turns on (shardwise.plan.recommend.SAVERS) -> {key: value} in
    # this format; None where the format cannot say one of them
    saver_keys: Callable[[Any], dict[str, Any] | None] | None = None
    advice: dict[str, Any] | None = None  # filled by shardwise.ingest.advice.advise
    # the `shardwise plan` words that plan the same, the flags given beside the file included,
    # checked by plan itself (shardwise.cli.advice_checks); None, with why, where they would not
    command: list[str] | None = None
    command_refused: str | None = None

    def as_flags(self, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """The `shardwise plan` words that plan what this file plans (without the flags given beside
        it: `skip` names plan's parameters given beside it, whose words the file's values leave out)."""
        from shardwise.config.flags import BY_PARAM, ZERO3_ONLY, ZERO12_ONLY, as_flags
        from shardwise.config.strategy import STRATEGIES

        words: list[str] = []
        engines = {STRATEGIES[s].engine for s in self.values.get("strategy") or STRATEGIES if s in STRATEGIES}
        values, knobs_of = dict(self.values), {k: dict(v) for k, v in self.knobs.items()}
        if self.format != "shardwise":  # another tool's run: the planner's defaults, not the trainer's
            values = {k: v for k, v in planner_defaults().items()
                      if not (k.startswith("lora_") and k != "lora_rank" and not values.get("lora_rank"))} | values
            knobs_of["ds"].setdefault("communication_data_type", "auto")
        skipped_knobs = {(BY_PARAM[n].section, BY_PARAM[n].field) for n in skip if n in BY_PARAM}
        # a stage's own knobs where no planned strategy is of that stage (plan refuses them as flags)
        stages = {STRATEGIES[s].zero_stage for s in self.values.get("strategy") or () if s in STRATEGIES
                  and STRATEGIES[s].engine == "deepspeed"}
        skipped_knobs |= {("ds", f) for fields, wanted in ((ZERO3_ONLY, {3}), (ZERO12_ONLY, {1, 2}))
                          if not stages & wanted for f in fields}
        if "ds_bucket" in skip:
            skipped_knobs |= {("ds", "reduce_bucket_size"), ("ds", "allgather_bucket_size")}
        for name, v in values.items():
            if v == "" or name in skip:  # an empty list flag: its default
                continue
            flag = "--" + name.replace("_", "-")
            if name == "strategy":
                words += [w for s in v for w in ("-s", s)]
            elif isinstance(v, bool):
                words += [flag] if v else ([f"--no-{flag[2:]}"] if name in ("sequence_parallel", "fused_kernels",
                                                                                   "optimizer_in_backward",
                                                                                   "activation_offload",
                                                                                   "cp_load_balance")
                                           else [])
            elif v is not None:
                words += [flag, str(v)]
        for section, knobs in knobs_of.items():
            if {"ds": "deepspeed", "fsdp": "fsdp2"}.get(section, "ddp") not in engines | {"ddp"}:
                continue  # knobs of an engine nothing planned runs (plan refuses them as flags)
            for field_name, v in knobs.items():
                if (section, field_name) not in skipped_knobs:
                    words += as_flags(section, field_name, v)
        if self.shard_group is not None and "shard_group" not in skip:
            words += ["--shard-group", str(self.shard_group)]
        return words

    def as_dict(self) -> dict[str, Any]:
        return {"file": str(self.path), "format": self.format, "format_name": FORMAT_NAMES[self.format],
                "as_flags": self.as_flags(), "command": self.command, "command_refused": self.command_refused,
                "read": [{"key": k, "as": v} for k, v in self.read],
                "ignored": [{"key": k, "why": v} for k, v in self.ignored],
                "notes": list(self.notes), "warnings": list(self.warnings), "values": {k: _jsonable(v) for k, v in self.values.items()},
                "knobs": self.knobs, "what_to_change": self.advice}


def ignore(src: Source, key: str, why: str) -> None:
    """`key` is not planned and changes memory or time: listed as ignored and said in the plan's first lines."""
    src.ignored.append((key, why))
    src.warnings.append(f"{src.path.name}: {key} is not planned ({why}): the plan is of the run without it")


def refuse(doc: Doc, key: tuple | str, value: Any, why: str) -> ShardwiseError:
    """A key whose run shardwise cannot plan: refused naming file, line and key, and why."""
    key = (key,) if isinstance(key, str) else key
    return ShardwiseError(f"{doc.where(*key)}: {dotted(key)} = {value!r}: not plannable: {why}")


def unstated(src: Source, ctx: Context, *, precision: bool) -> None:
    """What a DeepSpeed JSON or accelerate YAML cannot say (or did not), said in the plan's first
    lines: the model, GPUs and sequence the plan fell back on, and the precision, which `accelerate
    launch` (mixed_precision "no") and raw DeepSpeed (no fp16/bf16 section) run in fp32."""
    given = ctx.given
    if not any(k in given or k in src.values for k in ("model", "model_config", "params")):
        how = (f"{FORMAT_NAMES[src.format]}s have no key for it" if src.format in ("deepspeed", "accelerate")
               else "no model_name_or_path")
        src.warnings.append(f"model: not named in the file ({how}); planned as {ctx.defaults.get('model')} — pass "
                            "--model")
    rest = [f"--{n.replace('_', '-')} {ctx.value(n, src)}" for n in ("gpus", "gpu", "seq_len")
            if n not in given and n not in src.values]
    if rest:
        src.warnings.append(f"not in the file, planned with shardwise's defaults: {' '.join(rest)} (pass your own)")
    if precision and "precision" not in src.values and "precision" not in given:
        src.values["precision"] = "fp32"
        src.warnings.append("precision: the file names none; planned as fp32, as "
                            + ("accelerate launch runs it (mixed_precision defaults to \"no\")"
                               if src.format == "accelerate" else
                               "DeepSpeed runs it without an fp16/bf16 section")
                            + " — pass --precision bf16-mixed if your script sets it")


def _jsonable(v: Any) -> Any:
    return str(v) if isinstance(v, Path) else v


FORMAT_NAMES = {
    "deepspeed": "DeepSpeed config JSON",
    "accelerate": "accelerate config YAML",
    "shardwise": "shardwise training YAML",
    "training_args": "Hugging Face TrainingArguments JSON",
    "llama_factory": "LLaMA-Factory training YAML",
    "axolotl": "axolotl config YAML",
    "torchtune": "torchtune recipe config YAML",
    "torchtitan": "torchtitan job config TOML",
    "litgpt": "LitGPT finetune config YAML",
}


@dataclass
class Doc:
    """One parsed file: its mapping and the line of each key path."""

    path: Path
    data: dict[str, Any]
    lines: dict[tuple, int]
    kind: str  # "json" | "yaml" | "toml"

    def where(self, *key: str | int) -> str:
        """`FILE:LINE` of a key path (its nearest enclosing key in the file)."""
        for n in range(len(key), 0, -1):
            if tuple(key[:n]) in self.lines:
                return f"{self.path}:{self.lines[tuple(key[:n])]}"
        return str(self.path)

    def error(self, key: tuple | str, value: Any, expected: str) -> ShardwiseError:
        key = (key,) if isinstance(key, str) else key
        dotted = ".".join(str(k) for k in key)
        return ShardwiseError(f"{self.where(*key)}: {dotted} = {value!r}: expected {expected}")


def load(path: Path) -> Doc:
    """The file as a mapping with key lines, read within shardwise.config.safe_yaml's bounds (a regular
    file of at most MAX_CONFIG_BYTES): JSON as RFC 8259 has it (no NaN or infinities, no key
    twice, numbers that fit), a `.toml` file as TOML 1.0 (the standard library's parser: no key
    twice, no code), else YAML through shardwise.config.safe_yaml (no alias bombs, bad bytes,
    duplicate keys). Every refusal is a ShardwiseError naming the file."""
    try:
        text = read_text(path)
    except ShardwiseError as e:
        raise ShardwiseError(f"--from {e}") from None
    if path.suffix.lower() == ".toml":
        return Doc(path, _parse_toml(text, path), _toml_key_lines(text), "toml")
    looks_json = path.suffix.lower() == ".json" or text.lstrip().startswith("{")
    if looks_json:
        try:
            data = parse_json(text, path)
        except DuplicateKey:
            parse_yaml(text, path)  # JSON is YAML: its reader names the key and both lines, where it reads the file
            raise
        lines: dict[tuple, int] = {}
        try:  # JSON is YAML: the same reader gives each key's line
            node, _ = parse_yaml(text, path)
            lines = key_lines(node) if node is not None else {}
        except ShardwiseError:
            pass
        kind = "json"
    else:
        node, data = parse_yaml(text, path)
        lines = key_lines(node) if node is not None else {}
        kind = "yaml"
    if not isinstance(data, dict):
        raise ShardwiseError(f"{path}: expected a mapping of keys at the top, got {type(data).__name__}")
    return Doc(path, data, lines, kind)


def _parse_toml(text: str, path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package
        import tomli as tomllib
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ShardwiseError(f"{path}: not valid TOML: {e}") from None
    for key, v in flatten(data).items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ShardwiseError(f"{path}: {dotted(key)} = {v}: expected a finite number")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**40:
            raise ShardwiseError(f"{path}: {dotted(key)}: an integer of more than 40 digits")
    return data


_TOML_TABLE = re.compile(r"^\[\[?\s*([^\]]+?)\s*\]\]?")
_TOML_KEY = re.compile(r"^([A-Za-z0-9_\-.\"' ]+?)\s*=")


def _toml_key_lines(text: str) -> dict[tuple, int]:
    """The line of each table header and key of a TOML file ([a.b] tables, dotted and quoted keys)."""
    def parts(s: str) -> tuple:
        return tuple(p.strip().strip("\"'") for p in s.split("."))

    lines: dict[tuple, int] = {}
    table: tuple = ()
    for n, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if (m := _TOML_TABLE.match(s)) is not None:
            table = parts(m.group(1))
            lines.setdefault(table, n)
        elif (m := _TOML_KEY.match(s)) is not None:
            lines.setdefault(table + parts(m.group(1)), n)
    return lines


def flatten(d: dict[str, Any], prefix: tuple = ()) -> dict[tuple, Any]:
    """{key path: leaf value} of nested mappings (lists are leaves)."""
    out: dict[tuple, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= flatten(v, (*prefix, k))
        else:
            out[(*prefix, k)] = v
    return out


def dotted(key: tuple) -> str:
    return ".".join(str(k) for k in key)


def as_bool(doc: Doc, key: tuple, value: Any) -> bool:
    """A boolean the way the tools read one: YAML/JSON true/false, or accelerate/HF's strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "1", "on", "y", "t"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "no", "0", "off", "n", "f"):
        return False
    raise doc.error(key, value, "true or false")


def as_count(doc: Doc, key: tuple, value: Any, *, zero: bool = False) -> int:
    """A whole number (5e8 and 500000000 alike), at least 1 (0 allowed with `zero`)."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value != int(value) or value < (0 if zero else 1)):
        raise doc.error(key, value, f"a whole number{'' if zero else ' ≥ 1'}")
    return int(value)


def as_number(doc: Doc, key: tuple, value: Any) -> float:
    """A finite number ≥ 0 (a number, or a string of one as the tools' argument parsers take it)."""
    v = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        v = float(value)
    elif isinstance(value, str):
        try:
            v = float(value.strip())
        except ValueError:
            pass
    if v is None or not math.isfinite(v) or v < 0:
        raise doc.error(key, value, "a finite number ≥ 0")
    return v


def lora_dropout(doc: Doc, key: tuple, value: Any, src: Source, default: str = "") -> None:
    """A LoRA dropout probability (PEFT's lora_dropout, torchtune's and LitGPT's alike): at least 0
    and below 1, as --lora-dropout; `default` says whose default it is where the file left it unset."""
    p = as_number(doc, key, value)
    if p >= 1:
        raise doc.error(key, value, "a dropout probability, at least 0 and below 1")
    src.values["lora_dropout"] = p
    src.read.append((dotted(key), f"--lora-dropout {p:g}" + (f" ({default})" if default else "")
                     + (": each adapted linear keeps its dropped input and the mask for backward" if p else "")))


def resolve_path(doc: Doc, key: tuple, value: Any) -> Path:
    """A file the config names: as the tools resolve it (the working directory), else beside the config."""
    if not isinstance(value, str) or not value.strip():
        raise doc.error(key, value, "a path to a file")
    p = Path(value).expanduser()
    for cand in (p, doc.path.parent / p) if not p.is_absolute() else (p,):
        if cand.is_file():
            return cand
    raise ShardwiseError(f"{doc.where(*key)}: {dotted(key)} = {value!r}: file not found (looked in the working "
                         f"directory and beside {doc.path.name})")


@dataclass(frozen=True)
class Context:
    """What a reader knows beside the file: the flags given (they win), every flag's value
    (defaults included), the --set overrides (shardwise YAML only) and the knob flags given."""

    given: dict[str, Any]
    defaults: dict[str, Any]
    sets: list[str]
    cli_knobs: dict[str, dict[str, Any]]

    def value(self, name: str, src: Source) -> Any:
        """The value a parameter will be planned with: the flag's, else the file's, else the default."""
        if name in self.given:
            return self.given[name]
        return src.values.get(name, self.defaults.get(name))

    def hidden_size(self, src: Source) -> int:
        """hidden_size of the model being planned (HF's "auto" buckets are derived from it)."""
        from shardwise.plan.planner import resolve_model

        names = ("model", "model_config", "params")
        m = resolve_model(*(self.value(n, src) for n in names))
        return m.hidden_size


def hub_model(doc: Doc, key: tuple, value: Any, src: Source, ctx: Context) -> None:
    """A model named as the tools name it (`model_name_or_path`, `base_model`): a local directory
    with config.json is read; any other name resolves as `--model` does
    (shardwise.catalog.find_model: the catalog by its key or a Hugging Face id it lists, else the
    id's config.json from the Hugging Face cache or, online, the Hub). The file's own
    `trust_remote_code: true` (LLaMA-Factory's and axolotl's key) lets a Hub config.json that
    ships its own code (`auto_map`) be planned as transformers' own class for its model_type;
    that plan names the file read (--model-config), since no flag of plan trusts code."""
    from shardwise import catalog
    from shardwise.specs.hf_config import read_config_json

    if not isinstance(value, str) or not value.strip():
        raise doc.error(key, value, "a model id or a local directory")
    trust = as_bool(doc, ("trust_remote_code",), doc.data.get("trust_remote_code", False))
    if "trust_remote_code" in doc.data:
        src.read.append(("trust_remote_code", "lets a Hugging Face config.json with auto_map be planned as "
                         "transformers' own class (shardwise runs no checkpoint code)" if trust else
                         "no change to memory or time"))
    if any(k in ctx.given for k in ("model", "model_config", "params")):
        src.read.append((dotted(key), f"{value} (overridden by the --model/--model-config/--params given)"))
        return
    local = Path(value).expanduser()
    if (local / "config.json").is_file():
        src.values["model_config"] = local
        src.read.append((dotted(key), f"--model-config {local}"))
        return
    name = value.strip()
    try:
        spec, path = catalog.find_model(name, trust_remote_code=trust, opt_in=(
            f"set trust_remote_code: true in {doc.path.name} to plan transformers' own class for it, or "
            "pass --model-config DIR/config.json"))
    except ShardwiseError as e:
        raise ShardwiseError(f"{doc.where(*key)}: {dotted(key)} = {value!r}: {e}") from None
    if path is None:
        src.values["model"] = spec.name
        src.read.append((dotted(key), f"--model {spec.name}" + ("" if spec.name == name.lower() else
                                                                 f" (the catalog entry listing {name})")))
    elif read_config_json(path)[0].get("auto_map"):  # trusted by this file: plan has no flag for it
        src.values["model_config"] = path
        src.read.append((dotted(key), f"--model-config {path} (its Hugging Face config.json, which ships its own "
                                      "code: planned as transformers' own class, trust_remote_code: true)"))
    else:
        src.values["model"] = name
        src.read.append((dotted(key), f"--model {name} (its config.json: {path})"))
