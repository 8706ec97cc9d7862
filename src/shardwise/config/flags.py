"""`shardwise plan`'s flags, from the schema: the engine knobs' flags generated from the knob
classes, the flags that set a field of the run (RUN_FLAGS) and the pipeline schedule's
(STRATEGY_FLAGS: strategy.pp_schedule, strategy.pp_virtual_stages, strategy.ep,
strategy.ep_load_imbalance, strategy.etp, strategy.ep_overlap), each with its YAML key.

One schema: the pydantic fields of `DeepSpeedKnobs`, `FSDPKnobs` and `DDPKnobs`
(shardwise.config.strategy) give the trainer's YAML sections (`config/schema._overrides`), `--set`,
these flags and what `plan --from` reads. Each field is the flag `--ds-FIELD` / `--fsdp-FIELD` /
`--ddp-FIELD` (underscores as dashes), its help is the field's description and its default the
field's default, stated once, there. Knobs that had a shorter flag before keep that name
(`ALIASES`: `--ds-reduce-bucket` is reduce_bucket_size), and `--ds-bucket` sets both DeepSpeed
buckets at once. Torch-free (the planner's CLI imports it).
"""

from __future__ import annotations

import functools
import inspect
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import typer
from pydantic import BaseModel

from shardwise.config.schema import TrainConfig
from shardwise.config.strategy import (
    CP_IMPLS,
    PP_SCHEDULES,
    DDPKnobs,
    DeepSpeedKnobs,
    FSDPKnobs,
    StrategyKnobs,
    virtual_refusal,
)
from shardwise.errors import ShardwiseError

# (StrategyKnobs attribute, flag prefix, the section's name in the trainer YAML, class)
SECTIONS: tuple[tuple[str, str, str, type[BaseModel]], ...] = (
    ("ds", "ds", "deepspeed", DeepSpeedKnobs),
    ("fsdp", "fsdp", "fsdp", FSDPKnobs),
    ("ddp", "ddp", "ddp", DDPKnobs),
)
# The names the flags had before they were generated: these knobs keep them (the help names the field).
ALIASES: dict[tuple[str, str], str] = {
    ("ds", "reduce_bucket_size"): "--ds-reduce-bucket",
    ("ds", "prefetch_bucket_size"): "--ds-prefetch",
    ("ds", "param_persistence_threshold"): "--ds-persistence-threshold",
    ("ds", "max_live_parameters"): "--ds-max-live",
    ("ds", "max_reuse_distance"): "--ds-max-reuse",
    ("ds", "use_multi_rank_bucket_allreduce"): "--ds-multi-rank-allreduce",
    ("ds", "communication_data_type"): "--ds-comm-dtype",
    ("ddp", "bucket_cap_mb"): "--ddp-bucket-mb",
}
BOTH_BUCKETS = "--ds-bucket"  # reduce_bucket_size and allgather_bucket_size together
# DeepSpeed knobs that only ZeRO-3 reads, and those only ZeRO-1/2 read (a flag for a stage nothing
# planned runs changes nothing and is refused).
ZERO3_ONLY = ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
              "fetch_unit")
ZERO12_ONLY = ("use_multi_rank_bucket_allreduce", "allgather_bucket_size", "reduce_scatter")


@dataclass(frozen=True)
class KnobFlag:
    section: str  # ds | fsdp | ddp
    field: str
    param: str  # the Python parameter typer passes it as
    names: tuple[str, ...]  # the flag's name (one)

    @property
    def flag(self) -> str:
        return self.names[0]


def _flag_name(prefix: str, field: str) -> str:
    return f"--{prefix}-{field.replace('_', '-')}"


def knob_flags() -> list[KnobFlag]:
    out = []
    for section, prefix, _, cls in SECTIONS:
        for field in cls.model_fields:
            alias = ALIASES.get((section, field))
            # one name per flag (help lines stay short): the short name users know where there is one
            out.append(KnobFlag(section, field, f"{section}__{field}", (alias or _flag_name(prefix, field),)))
    return out


FLAGS: tuple[KnobFlag, ...] = tuple(knob_flags())
BY_PARAM = {f.param: f for f in FLAGS}


def _base(annotation: Any) -> Any:
    """`X | None` -> X."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1 else annotation


def _choices(kind: Any) -> tuple[Any, ...] | None:
    """The values a Literal field takes, or those of a `Literal[...] | bool` one (a bool knob
    with an "auto" beside it: `fsdp.reduce_every_micro_batch`); None for other types."""
    if get_origin(kind) is Literal:
        return get_args(kind)
    if get_origin(kind) in (typing.Union, types.UnionType):
        args = get_args(kind)
        lits = [a for a in args if get_origin(a) is Literal]
        if lits and all(a is bool or get_origin(a) is Literal for a in args):
            return (*(v for a in lits for v in get_args(a)), *((True, False) if bool in args else ()))
    return None


def _choice_text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _default_text(cls: type[BaseModel], field: str) -> str:
    d = cls.model_fields[field].default
    if d is None:
        return ""
    if isinstance(d, bool):
        return f" Default: {'on' if d else 'off'}."
    if isinstance(d, int) and d >= 10_000 and float(f"{d:.0e}") == d:  # 500000000 as 5e8, exactly
        return f" Default: {d:.0e}".replace("e+0", "e").replace("e+", "e") + "."
    return f" Default: {d}."


def _option(flag: KnobFlag) -> tuple[Any, Any]:
    """(annotation, typer.Option) of one knob flag: defaults None (the field's default applies)."""
    cls = dict((s, c) for s, _, _, c in SECTIONS)[flag.section]
    f = cls.model_fields[flag.field]
    kind = _base(f.annotation)
    section_yaml = dict((s, y) for s, _, y, _ in SECTIONS)[flag.section]
    desc = (f.description or "").rstrip(".")
    where = f" (YAML strategy.{section_yaml}.{flag.field})"
    if kind is bool:
        names = [f"{n}/--no-{n[2:]}" for n in flag.names]
        return bool | None, typer.Option(None, *names, help=f"{desc}{where}.{_default_text(cls, flag.field)}",
                                         show_default=False)
    if _choices(kind) is not None:
        choices = " | ".join(_choice_text(c) for c in _choices(kind))
        return str | None, typer.Option(None, *flag.names, help=f"{desc}: {choices}{where}."
                                        f"{_default_text(cls, flag.field)}", show_default=False)
    # numbers as floats: element counts are given as 5e7 or 50000000 (checked whole in given_knobs)
    return float | None, typer.Option(None, *flag.names, help=f"{desc}{where}.{_default_text(cls, flag.field)}",
                                      show_default=False)


def generated_parameters() -> list[inspect.Parameter]:
    params = []
    for flag in FLAGS:
        annotation, option = _option(flag)
        params.append(inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
    params.append(inspect.Parameter(
        "ds_bucket", inspect.Parameter.KEYWORD_ONLY, annotation=float | None,
        default=typer.Option(None, BOTH_BUCKETS, show_default=False,
                             help="reduce_bucket_size and allgather_bucket_size at once (elements); a --ds-reduce-"
                             "bucket-size given beside it sets the reduce bucket.")))
    params.append(inspect.Parameter(
        "shard_group", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
        default=typer.Option(None, "--shard-group", help="fsdp-hybrid: GPUs per shard group (default: a node).")))
    params.append(inspect.Parameter(
        "tp_impl", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
        default=typer.Option(None, "--tp-impl", help="TP rows of DeepSpeed and DDP strategies as: auto (each "
                             "engine's own: DeepSpeed's AutoTP for ZeRO-0/1/2, DTensor for DDP) or megatron "
                             "(Megatron-LM / Megatron-DeepSpeed: sequence parallel, vocabulary-parallel). "
                             "FSDP2 rows keep DTensor's.")))
    params.append(inspect.Parameter(
        "zero_impl", inspect.Parameter.KEYWORD_ONLY, annotation=str | None,
        default=typer.Option(None, "--zero-impl", help="zero1 rows' sharded optimizer as: deepspeed (ZeRO stage 1, "
                             "what shardwise train runs) or megatron (Megatron-Core's distributed optimizer: fp32 "
                             "gradient buffer the size of the model for bf16, reduce-scatter and param all-gather "
                             "overlapped where --ds-overlap-comm says, as --overlap-grad-reduce "
                             "--overlap-param-gather; plan-only).")))
    params.append(inspect.Parameter(
        "grad_reduce_in_bf16", inspect.Parameter.KEYWORD_ONLY, annotation=bool | None,
        default=typer.Option(None, "--grad-reduce-in-bf16", show_default=False,
                             help="With --zero-impl megatron: the gradient buffer and its reduce-scatter in bf16 "
                             "(Megatron-LM --grad-reduce-in-bf16 or --main-grads-dtype bf16; Megatron-Bridge "
                             "grad_reduce_in_fp32 false), not Megatron-LM's fp32 for bf16 runs.")))
    return params


def with_knob_flags(func):
    """Add the generated knob flags to a typer command: `func` receives them as one dict,
    `knob_values` (parameter name -> value, None where not given)."""
    hints = typing.get_type_hints(func, include_extras=True)
    sig = inspect.signature(func)
    own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
           if p.name != "knob_values"]
    generated = generated_parameters()
    names = [p.name for p in generated]

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        values = {n: kwargs.pop(n, None) for n in names}
        return func(*args, **kwargs, knob_values=values)

    wrapper.__signature__ = sig.replace(parameters=[*own, *generated])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in (*own, *generated)}
    del wrapper.__wrapped__  # typer must read the signature above, not the wrapped function's
    return wrapper


def _whole(flag: str, v: float) -> int:
    if not math.isfinite(v) or v != int(v):
        raise ShardwiseError(f"{flag} {v}: expected a finite whole number of elements (e.g. 5e7)")
    return int(v)


def given_knobs(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of the knob flags given (checked against their types; element
    counts as whole numbers), with --ds-bucket spread over both buckets."""
    out: dict[str, dict[str, Any]] = {"ds": {}, "fsdp": {}, "ddp": {}}
    if values.get("ds_bucket") is not None:
        n = _whole(BOTH_BUCKETS, values["ds_bucket"])
        check_knob(BOTH_BUCKETS, "ds", "reduce_bucket_size", n)
        out["ds"] |= {"reduce_bucket_size": n, "allgather_bucket_size": n}
    for param, v in values.items():
        flag = BY_PARAM.get(param)
        if flag is None or v is None:
            continue
        cls = dict((s, c) for s, _, _, c in SECTIONS)[flag.section]
        kind = _base(cls.model_fields[flag.field].annotation)
        choices = _choices(kind)
        if choices is not None:
            by_text = {_choice_text(c): c for c in choices}
            if str(v).strip().lower() not in by_text:
                raise ShardwiseError(f"{flag.flag} {v!r}: expected {', '.join(by_text)} "
                                     f"({flag.section}.{flag.field}: {cls.model_fields[flag.field].description})")
            v = by_text[str(v).strip().lower()]
        if kind is int:
            v = _whole(flag.flag, v)
        out[flag.section][flag.field] = v
    return out


def check_knob(flag: str, section: str, field: str, value: Any) -> None:
    """`value` of one knob against its field in the schema (type, finite, bounds), or the
    ShardwiseError naming `flag`."""
    cls = dict((s, c) for s, _, _, c in SECTIONS)[section]
    try:
        cls(**{field: value})
    except ShardwiseError as e:  # "<Class>: field '<field>' = <value>: <why>"
        shown = f"{value:g}" if isinstance(value, int | float) and not isinstance(value, bool) else repr(value)
        raise ShardwiseError(f"{flag} {shown}: {str(e).rsplit(': ', 1)[-1]} ({section}.{field}: "
                             f"{cls.model_fields[field].description})") from None


def flag_of(section: str, field: str) -> str:
    """The flag name of a knob (its alias where it has one), for messages and equivalent command lines."""
    return ALIASES.get((section, field)) or _flag_name({"ds": "ds", "fsdp": "fsdp", "ddp": "ddp"}[section], field)


def as_flags(section: str, field: str, value: Any) -> list[str]:
    """The command-line words that set one knob."""
    name = flag_of(section, field)
    cls = dict((s, c) for s, _, _, c in SECTIONS)[section]
    if isinstance(value, bool) and _base(cls.model_fields[field].annotation) is bool:
        return [name if value else f"--no-{name[2:]}"]
    if isinstance(value, bool):  # a choice beside "auto": the flag takes the word
        return [name, _choice_text(value)]
    return [name, str(value)]


def build_knobs(knobs: dict[str, dict[str, Any]], shard_group: int | None, tp_impl: str | None = None,
                base: tuple[DeepSpeedKnobs, FSDPKnobs, DDPKnobs] | None = None, *, pp_schedule: str | None = None,
                pp_virtual_stages: int | None = None, cp: int | None = None,
                cp_impl: str | None = None, cp_load_balance: bool | None = None, ep: int | None = None,
                ep_load_imbalance: float | None = None, zero_impl: str | None = None,
                etp: int | None = None, ep_overlap: bool | None = None,
                grad_reduce_in_bf16: bool | None = None) -> StrategyKnobs:
    """StrategyKnobs of {section: {field: value}}, the rest at `base` (the trainer's knobs for the
    device: shardwise.run.trainer_knobs), else at the classes' defaults (the engines' own), with
    the pipeline schedule of the PP rows and the context parallelism of every row where given; a
    bad value names its flag."""
    from shardwise.config.fields import check_count

    if shard_group is not None:
        check_count("--shard-group", shard_group, hint=" (GPUs per fsdp-hybrid shard group)")
    if tp_impl not in (None, "auto", "megatron"):
        raise ShardwiseError(f"--tp-impl {tp_impl!r}: expected auto or megatron")
    if zero_impl not in (None, "deepspeed", "megatron"):
        raise ShardwiseError(f"--zero-impl {zero_impl!r}: expected deepspeed or megatron")
    if pp_schedule is not None and pp_schedule not in PP_SCHEDULES:
        raise ShardwiseError(f"--pp-schedule {pp_schedule!r}: expected {', '.join(PP_SCHEDULES)}")
    if pp_virtual_stages is not None:
        check_count("--pp-virtual-stages", pp_virtual_stages, hint=" (stages per pipeline rank)")
    if cp is not None:
        check_count("--cp", cp, hint=" (GPUs each sequence is split over)")
    if cp_impl is not None and cp_impl not in CP_IMPLS:
        raise ShardwiseError(f"--cp-impl {cp_impl!r}: expected {', '.join(CP_IMPLS)}")
    if ep is not None:
        check_count("--ep", ep, hint=" (expert-parallel degree)")
    if ep_load_imbalance is not None and not (math.isfinite(ep_load_imbalance) and ep_load_imbalance >= 1.0):
        raise ShardwiseError(f"--ep-load-imbalance {ep_load_imbalance}: expected a finite number ≥ 1.0 (1.0: the "
                             "busiest expert-parallel rank gets the balanced share of routed tokens)")
    if ep_load_imbalance not in (None, 1.0) and (ep or 1) == 1:
        raise ShardwiseError(f"--ep-load-imbalance {ep_load_imbalance} needs expert parallelism: give --ep 2 or more")
    if etp is not None:
        check_count("--etp", etp, hint=" (TP ranks each routed expert is split over: 1 or tp)")
        if (ep or 1) == 1:
            raise ShardwiseError(f"--etp {etp} needs expert parallelism: give --ep 2 or more")
    if ep_overlap and (ep or 1) == 1:
        raise ShardwiseError("--ep-overlap needs expert parallelism: give --ep 2 or more")
    if grad_reduce_in_bf16 and zero_impl != "megatron":
        raise ShardwiseError("--grad-reduce-in-bf16 sets Megatron-Core's gradient buffer dtype: give --zero-impl "
                             "megatron (-s zero1); DeepSpeed's reduction dtype is --ds-comm-dtype, FSDP2's "
                             "--fsdp-reduce-dtype")
    why = virtual_refusal(pp_schedule or "1f1b", pp_virtual_stages or 1)
    if why:
        given = (f"--pp-schedule {pp_schedule}" if pp_schedule else "") + (
            f" --pp-virtual-stages {pp_virtual_stages}" if pp_virtual_stages is not None else "")
        raise ShardwiseError(f"{given.strip()}: {why}")
    built = {}
    for section, _, _, cls in SECTIONS:
        for field, v in knobs.get(section, {}).items():  # each value on its own: the error names its flag
            check_knob(flag_of(section, field), section, field, v)
        start = {} if base is None else base[[s for s, *_ in SECTIONS].index(section)].model_dump()
        try:
            built[section] = cls(**(start | knobs.get(section, {})))
        except ShardwiseError as e:
            fields = ", ".join(flag_of(section, f) for f in knobs.get(section, {}))
            raise ShardwiseError(f"{fields}: {e}") from None
    return StrategyKnobs(**built, shard_group=shard_group, tp_impl=tp_impl or "auto", pp_schedule=pp_schedule,
                         pp_virtual_stages=pp_virtual_stages, cp=cp, cp_impl=cp_impl,
                         cp_load_balance=cp_load_balance, ep=ep, ep_load_imbalance=ep_load_imbalance, etp=etp, ep_overlap=ep_overlap,
                         zero_impl=zero_impl or "deepspeed", grad_reduce_in_bf16=grad_reduce_in_bf16)


# --- plan's flags that set a field of the run -------------------------------------------------
#
# Each is a key of the training YAML: its help is that field's description and its default is the
# schema's (TrainConfig), stated once, there. Given no flag, `shardwise plan` plans what
# `shardwise train` runs with the same settings (the bridge, shardwise.run.train_spec, resolves
# the device-dependent ones); `also` lists the values the planner prices beyond what the trainer
# runs (another engine's settings, planned for comparison).


@dataclass(frozen=True)
class RunFlag:
    param: str  # plan()'s parameter, and the TrainSpec field it sets
    flag: str
    key: str  # the dotted YAML key
    also: tuple[str, ...] = ()  # planner-only values beside the schema's
    note: str = ""  # how the planner reads the key, where it is not one value


RUN_FLAGS: tuple[RunFlag, ...] = (
    RunFlag("seq_len", "--seq-len", "data.sft.max_length", note="(data.synthetic.seq_len for synthetic data)"),
    RunFlag("micro_batch", "--micro-batch", "run.micro_batch"),
    RunFlag("grad_accum", "--grad-accum", "run.grad_accum"),
    RunFlag("precision", "--precision", "precision"),
    RunFlag("optimizer", "--optimizer", "optimizer.name", also=("sgd",)),
    RunFlag("checkpointing", "--checkpointing", "checkpointing.activation", also=("selective",)),
    RunFlag("attention", "--attention", "model.attention", also=("flash", "triton")),
    RunFlag("packed_attention", "--packed-attention", "data.sft.packed_attention",
            also=("none", "flash_varlen", "sdpa_varlen"),
            note="(planned as the kernel it resolves to: none without packed SFT rows; flash_varlen or "
                 "sdpa_varlen for varlen)"),
    RunFlag("lora_rank", "--lora-rank", "lora.rank"),
    RunFlag("lora_targets", "--lora-targets", "lora.target_modules", note="(comma-separated)"),
    RunFlag("lora_modules_to_save", "--lora-modules-to-save", "lora.modules_to_save", note="(comma-separated)"),
    RunFlag("lora_dropout", "--lora-dropout", "lora.dropout"),
    RunFlag("cross_entropy", "--cross-entropy", "loss.implementation", also=("fused", "inplace", "chunked-output"),
            note="(fused: Liger's kernel; inplace: flash-attn's; chunked-output: torchtune's "
                 "CEWithChunkedOutputLoss)"),
    RunFlag("ce_chunk", "--ce-chunk", "loss.chunk_tokens"),
    RunFlag("weight_decay", "--weight-decay", "optimizer.weight_decay"),
    RunFlag("optimizer_impl", "--optimizer-impl", "optimizer.fused", also=("fused", "foreach", "forloop"),
            note="(fused where set, else fused on CUDA; foreach / forloop: torch's non-fused kernels)"),
    RunFlag("optimizer_in_backward", "--optimizer-in-backward", "optimizer.in_backward"),
    RunFlag("activation_offload", "--activation-offload", "checkpointing.offload"),
    RunFlag("fused_kernels", "--fused-kernels", "run.compile",
            note="(compiled decoder layers: elementwise work fused; unset: on CUDA under fsdp* and ddp)"),
)
RUN_FLAG = {f.param: f for f in RUN_FLAGS}


def schema_field(key: str) -> Any:
    """The pydantic FieldInfo of a dotted training-YAML key (a section left null by default, such
    as `lora`, is read through its class)."""
    cls: Any = TrainConfig
    *sections, name = key.split(".")
    for part in sections:
        cls = _base(cls.model_fields[part].annotation)
    return cls.model_fields[name]


def schema_default(key: str) -> Any:
    """The schema's default of a dotted training-YAML key."""
    f = schema_field(key)
    return f.get_default(call_default_factory=True)


def _section_absent(key: str) -> str | None:
    """The section on `key`'s path that the schema leaves null by default (lora), if any."""
    top = key.split(".")[0]
    return top if "." in key and TrainConfig.model_fields[top].default is None else None


def run_option(param: str) -> Any:
    """plan's typer.Option for one run flag: None unless given (the schema's default then applies,
    through the bridge); the help names the YAML key and its default."""
    f = RUN_FLAG[param]
    field = schema_field(f.key)
    desc = (field.description or f.key.rsplit(".", 1)[-1].replace("_", " ")).rstrip(".")
    kind = _base(field.annotation)
    choices = [str(c) for c in get_args(kind)] if get_origin(kind) is Literal else []
    choices += [c for c in f.also if c not in choices]
    default = schema_default(f.key)
    section = _section_absent(f.key)
    if section is not None and param == "lora_rank":
        shown = f"0: {section} is null by default, full fine-tuning"
    elif section is not None:
        shown = f"{default} with {section} set"
    elif default is None or isinstance(default, bool):
        shown = {None: "unset", True: "on", False: "off"}[default]
    else:
        shown = str(default)
    text = (f"{desc}{': ' + ' | '.join(choices) if choices else ''} {f.note}".strip()
            + f" (YAML {f.key}; default {shown}).")
    text = text[0].upper() + text[1:]
    names = [f"{f.flag}/--no-{f.flag[2:]}"] if kind is bool or param == "fused_kernels" else [f.flag]
    return typer.Option(None, *names, help=text, show_default=False)


# --- plan's flags that set a field of the strategy the planner's Strategy takes ----------------


STRATEGY_FLAGS: dict[str, str] = {  # plan()'s parameter (the Strategy field) -> its flag
    "pp_schedule": "--pp-schedule",
    "pp_virtual_stages": "--pp-virtual-stages",
    "cp": "--cp",
    "cp_impl": "--cp-impl",
    "cp_load_balance": "--cp-load-balance",
    "ep": "--ep",
    "ep_load_imbalance": "--ep-load-imbalance",
    "etp": "--etp",
    "ep_overlap": "--ep-overlap",
}


def strategy_option(param: str, note: str = "") -> Any:
    """plan's typer.Option for a `strategy.FIELD` of the training YAML (STRATEGY_FLAGS): None unless
    given; the help is the schema's description, choices and default, with the YAML key."""
    key = f"strategy.{param}"
    field = schema_field(key)
    kind = _base(field.annotation)
    choices = " | ".join(str(c) for c in get_args(kind)) if get_origin(kind) is Literal else ""
    desc = (field.description or param.replace("_", " ")).rstrip(".")
    text = f"{desc}{': ' + choices if choices else ''} {note}".strip() + f" (YAML {key}; default {schema_default(key)})."
    names = [f"{STRATEGY_FLAGS[param]}/--no-{STRATEGY_FLAGS[param][2:]}"] if kind is bool else [STRATEGY_FLAGS[param]]
    return typer.Option(None, *names, help=text[0].upper() + text[1:], show_default=False)
