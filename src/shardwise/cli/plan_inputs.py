"""The `plan` and `explain` commands' input handling (shardwise.cli.app): the hardware spec and the
flags given beside it, a --from file's values under the flags, flags that would change nothing,
the input warnings, and --emit with its fitting hint. Torch-free, as the planner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from shardwise.errors import ShardwiseError
from shardwise.numfmt import rate


def hardware_spec(hardware: str | None):
    """`--hardware auto|FILE` as a MachineHardware (None without the flag)."""
    if hardware is None:
        return None
    if hardware.strip().lower() == "auto":
        from shardwise.doctor import machine_hardware

        spec = machine_hardware()
        if spec.gpu is None:
            raise ShardwiseError("--hardware auto: " + "; ".join(spec.notes) + " (shardwise doctor says more); "
                                 "plan the GPUs you will run on with --gpu")
        return spec
    from shardwise.specs.machine import load_machine

    return load_machine(hardware)


def hardware_inputs(hardware: str | None, gpu: str | None, gpus: int | None, also_given=()) -> tuple:
    """(machine, gpu, gpus) for build_specs, the one way plan and explain read `--hardware`: with a
    spec, --gpu and --gpus keep their values only where given on the command line (or, for plan,
    by the --from file: `also_given`), else None so the spec's GPU and one node of it are planned;
    the other link and size flags are None unless given, and build_specs lets them override it."""
    machine = hardware_spec(hardware)
    if machine is None:
        return None, gpu, gpus
    given = given_flags() | set(also_given)
    return machine, (gpu if "gpu" in given else None), (gpus if "gpus" in given else None)


def given_flags() -> set[str]:
    """The plan() parameters given on the command line (not their defaults). typer 0.29 runs on
    its own copy of click (`typer._click`), whose context is not click's: read the one in use."""
    try:
        from typer._click.core import ParameterSource
        from typer._click.globals import get_current_context
    except ImportError:  # a typer on the click package
        from click import get_current_context
        from click.core import ParameterSource

    ctx = get_current_context()
    return {name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}


def plan_inputs(ctx: typer.Context, knob_values: dict, *, from_file: Path | None = None,
                extra: dict | None = None) -> tuple[dict, object]:
    """plan()'s inputs: the flags, and with --from FILE (or CONFIG) the file's values wherever no
    flag was given (a flag on the command line overrides the file). Returns (values, the file's
    reading or None); values["knobs"] are the engine knobs planned, values["cli_knobs"] those the
    command line gave. `from_file` plans that file instead of the command line's, with `extra`
    as flags given beside it (the advice's re-plan of an edited copy)."""
    from shardwise.config.flags import given_knobs

    values = dict(ctx.params)
    cli_knobs = given_knobs(knob_values)
    # by name: typer ships its own click (typer._click), whose ParameterSource is not click's
    given = {k for k in values if getattr(ctx.get_parameter_source(k), "name", "") in ("COMMANDLINE", "ENVIRONMENT")}
    if from_file is not None:
        values["from_file"], values["config"] = from_file, None
    values |= extra or {}
    given |= set(extra or ())
    path = values.pop("from_file")
    if values.get("config") is not None:
        if path is not None:
            raise ShardwiseError(f"plan {values['config']} --from {path}: give one file, as CONFIG or with --from")
        path = values["config"]
    sets = values.pop("set_") or []
    values["knobs"], values["cli_knobs"], values["shard_group"] = cli_knobs, cli_knobs, knob_values.get("shard_group")
    values["tp_impl"] = knob_values.get("tp_impl")
    values["zero_impl"] = knob_values.get("zero_impl")
    values["grad_reduce_in_bf16"] = knob_values.get("grad_reduce_in_bf16")
    if path is None:
        if sets:
            raise ShardwiseError(f"--set {sets[0]}: --set overrides a shardwise training YAML; give one "
                                 "(shardwise plan CONFIG.yaml --set KEY=VALUE)")
        return values, None
    from shardwise.ingest import read_source
    from shardwise.ingest.common import planner_defaults

    for k, v in planner_defaults().items():
        if values.get(k) is None:
            values[k] = v
    try:
        source = read_source(Path(path), given={k: values[k] for k in given if k in values}, defaults=values,
                             sets=sets, cli_knobs=cli_knobs)
    except ShardwiseError as e:
        raise naming_file(e, Path(path)) from None
    for k, v in source.values.items():
        if k not in given:
            values[k] = v
    knobs = {sec: {**source.knobs.get(sec, {}), **cli_knobs[sec]} for sec in ("ds", "fsdp", "ddp")}
    values["knobs"] = knobs
    if knob_values.get("shard_group") is None and source.shard_group is not None:
        values["shard_group"] = source.shard_group
    return values, source


@dataclass(frozen=True)
class PlanSetup:
    """What plan() plans, built and checked from its inputs: the specs, the engine knobs and the
    input warnings."""

    model: Any
    hw: Any
    train: Any
    knobs: Any
    warnings: list[str]


def plan_setup(a: dict, source) -> PlanSetup:
    """plan()'s inputs (`a`, from plan_inputs; `source`: the --from file's reading or None) as the
    specs it plans, with every check plan makes of them (flags that change nothing, the margin,
    --accounting, the FSDP and schedule flags, --device). Sets a["margin"] to the checked margin.
    The one path from parsed flags to specs: `plan` itself, its advice's re-plans and the check of
    its "same plan as flags" command go through it."""
    from shardwise.config.flags import build_knobs, schema_default
    from shardwise.plan.planner import build_specs, check_margin

    strategy, emit_strategy = a["strategy"], a["emit_strategy"]
    check_flags_apply(strategy, emit_strategy, a["cli_knobs"], a["ce_chunk"],
                      a["cross_entropy"] or schema_default("loss.implementation"))
    machine, gpu, gpus = hardware_inputs(a["hardware"], a["gpu"], a["gpus"],
                                         also_given=source.values if source is not None else ())
    m, hw, train = build_specs(
        model=a["model"], model_config=a["model_config"], params=a["params"], gpu=gpu, gpus=gpus, machine=machine,
        gpus_per_node=a["gpus_per_node"], interconnect=a["interconnect"], gpu_memory_gb=a["gpu_memory_gb"],
        host_memory_gb=a["host_memory_gb"], nics_per_node=a["nics_per_node"], profile=a["profile"],
        defaults=trainer_run(a) if source is None else None, **run_fields(a),
        base_quant="nf4" if a["qlora"] else "none", fused_norm=a["fused_norm"],
        fused_mlp=a.get("fused_mlp") or False,
        expandable_segments=a["expandable_segments"], sequence_parallel=a["sequence_parallel"],
        tp_comm_overlap=a["tp_comm_overlap"], **objective_fields(a["objective"], a["reference"]),
        fp8=a.get("fp8"), fp8_all_gather=a.get("fp8_all_gather") or None, grad_pass=grad_pass_field(a.get("grad_pass")),
    )
    check_fp8(hw, train, strategy, a.get("zero_impl") or "deepspeed")
    a["margin"] = check_margin(a["margin"])
    warnings = input_warnings(m, train)
    if a["accounting"] not in ("engine", "paper", "deepspeed"):
        raise ShardwiseError(f"--accounting {a['accounting']!r}: expected engine, paper or deepspeed")
    fsdp_given = a["cli_knobs"]["fsdp"]
    check_fsdp_flags([*(strategy or ()), *([emit_strategy] if emit_strategy else [])],
                     fsdp_given.get("reshard_after_forward"), "reduce_every_micro_batch" in fsdp_given,
                     "reshard_root" in fsdp_given)
    base = None
    if source is None and a["device"] in ("cuda", "cpu"):  # the trainer's, as for the run flags
        from shardwise.run.bridge import trainer_knobs

        base = trainer_knobs(a["device"])
    knobs = build_knobs(a["knobs"], a["shard_group"], a["tp_impl"], base=base, pp_schedule=a["pp_schedule"],
                        pp_virtual_stages=a["pp_virtual_stages"], cp=a.get("cp"), cp_impl=a.get("cp_impl"),
                        cp_load_balance=a.get("cp_load_balance"), ep=a.get("ep"),
                        ep_load_imbalance=a.get("ep_load_imbalance"), zero_impl=a.get("zero_impl"),
                        etp=a.get("etp"), ep_overlap=a.get("ep_overlap"),
                        grad_reduce_in_bf16=a.get("grad_reduce_in_bf16"))
    check_schedule_flags(a["pp"], knobs, m, train)
    if a["device"] not in ("cuda", "cpu"):
        raise ShardwiseError(f"--device {a['device']!r}: expected cuda or cpu")
    return PlanSetup(m, hw, train, knobs, warnings)


def check_fp8(hw, train, strategies: list[str] | None, zero_impl: str = "deepspeed") -> None:
    """--fp8 on a GPU with FP8 tensor cores, before anything is planned; --fp8-all-gather where an
    FSDP2 strategy or Megatron's distributed optimizer (zero1 with `zero_impl` megatron) is planned
    (it changes nothing else), with a recipe each named strategy gathers."""
    from shardwise.specs import Strategy

    if train.fp8 != "none":
        from shardwise.plan.fp8 import recipe_refusal

        hw.gpu.peak_flops("fp8")  # refused, naming the GPU, where it has none
        if why := recipe_refusal(hw.gpu, train):
            raise ShardwiseError(why)
    if not train.fp8_all_gather:
        return
    from shardwise.plan.fp8 import all_gather_refusal

    if not strategies and zero_impl != "megatron" and train.fp8 != "tensorwise":
        # every strategy planned: the float8 all-gather asked for is FSDP2's, which is torchao's tensorwise
        raise ShardwiseError(all_gather_refusal(Strategy.from_name("fsdp"), train))
    if strategies:
        try:
            named = [Strategy.from_name(n, zero_impl=zero_impl if n.strip().lower() == "zero1" else "deepspeed")
                     for n in strategies]
        except ShardwiseError:
            return  # an unknown name is refused with its own message when it is planned
        for s in named:
            if why := all_gather_refusal(s, train):
                raise ShardwiseError(why)
        if not any(s.engine == "fsdp2" or s.zero_impl == "megatron" for s in named):
            raise ShardwiseError(f"--fp8-all-gather is FSDP2's (torchao's float8 all-gather of fully_shard's "
                                 f"weights) or Megatron-Core's (--fp8-param-gather), but no FSDP2 strategy is planned, "
                                 f"nor zero1 with --zero-impl megatron (-s {', '.join(strategies)}): add one, or drop "
                                 "the flag")


def naming_file(err: ShardwiseError, path: Path | None) -> ShardwiseError:
    """`err` naming the --from file whose values were planned (unless it does already)."""
    if path is None or str(path) in str(err):
        return err
    return ShardwiseError(f"{err} (planning --from {path})")


def check_flags_apply(strategies: list[str] | None, emit_strategy: str | None, given: dict[str, dict],
                       ce_chunk: int | None, cross_entropy: str) -> None:
    """Flags that would change nothing are refused, naming the flag: DeepSpeed knobs when no
    planned strategy runs DeepSpeed (ZeRO-3's and ZeRO-1/2's own knobs when none is of that
    stage), and a chunk size for a loss that is not chunked. `given`: the knob flags given
    (shardwise.config.flags.given_knobs)."""
    from shardwise.config.flags import BOTH_BUCKETS, ZERO3_ONLY, ZERO12_ONLY, flag_of
    from shardwise.config.strategy import STRATEGY_NAMES
    from shardwise.specs import Strategy

    if ce_chunk is not None and cross_entropy != "chunked":
        raise ShardwiseError(f"--ce-chunk {ce_chunk} sets the chunk of the chunked cross-entropy, but --cross-entropy "
                             f"is {cross_entropy!r}: add --cross-entropy chunked, or drop --ce-chunk")
    ds = dict(given["ds"])
    if not ds:
        return
    both = ds.get("reduce_bucket_size") == ds.get("allgather_bucket_size") and "allgather_bucket_size" in ds
    flags = {f: (BOTH_BUCKETS if both and f in ("reduce_bucket_size", "allgather_bucket_size") else flag_of("ds", f))
             for f in ds}
    names = list(strategies or STRATEGY_NAMES) + ([emit_strategy] if emit_strategy else [])
    try:
        planned = [Strategy.from_name(n) for n in names]
    except ShardwiseError:
        return  # an unknown strategy name is refused with its own message when it is planned
    shown = ", ".join(names)
    stages = {s.zero_stage for s in planned if s.engine == "deepspeed"}
    for field, flag in flags.items():
        if not stages:
            raise ShardwiseError(f"{flag} is a DeepSpeed knob, but no strategy planned runs DeepSpeed (-s {shown}): "
                                 "add a zero0..zero3 strategy with -s, or drop the flag")
        if flag == BOTH_BUCKETS:
            continue
        for fields, wanted, what in ((ZERO3_ONLY, {3}, "ZeRO-3"), (ZERO12_ONLY, {1, 2}, "ZeRO-1/2")):
            if field in fields and not stages & wanted:
                raise ShardwiseError(f"{flag} is a {what} knob, but no {what} strategy is planned (-s {shown}): "
                                     "add one with -s, or drop the flag")


def check_schedule_flags(pp: int | None, knobs, model, train) -> None:
    """--pp-schedule / --pp-virtual-stages (or a --from file's schedule) against the table's layout:
    with --pp 1 they change nothing; with --pp N the schedule must run its stages and the run's
    micro-batches (specs.pipeline.schedule_refusal, what the trainer's bridge asks). Without --pp
    they apply to the recommender's PP rows."""
    from shardwise.specs.pipeline import schedule_refusal

    if (knobs.pp_schedule is None and knobs.pp_virtual_stages is None) or pp is None:
        return
    given = " ".join(f"{flag} {v}" for flag, v in (("--pp-schedule", knobs.pp_schedule),
                                                   ("--pp-virtual-stages", knobs.pp_virtual_stages)) if v is not None)
    if pp == 1:
        raise ShardwiseError(f"{given} sets the schedule of pipeline stages, but --pp is 1: give --pp 2 or more, "
                             "or drop it (without --pp it applies to the recommender's PP rows)")
    why = schedule_refusal(pp, knobs.pp_schedule or "1f1b", knobs.pp_virtual_stages or 1, train.grad_accum,
                           model.num_layers)
    if why:
        raise ShardwiseError(f"--pp {pp} {given} with --grad-accum {train.grad_accum}: {why}")


def input_warnings(model, train) -> list[str]:
    """What is accepted but worth saying: a sequence beyond the model's trained context."""
    out = []
    if train.seq_len > model.max_position_embeddings:
        out.append(f"--seq-len {train.seq_len} is beyond {model.name}'s max_position_embeddings "
                   f"{model.max_position_embeddings}: planned as given (RoPE scaling or a longer-context "
                   "variant can run it; the model was not trained that long)")
    return out


def print_warnings(warnings: list[str]) -> None:
    """On stderr, so --json's stdout stays one JSON object."""
    if not warnings:
        return
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    for w in warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)


def run_fields(values: dict) -> dict:
    """The run flags' values as TrainSpec fields (None: not given; comma lists as names)."""
    from shardwise.config.flags import RUN_FLAGS

    out = {f.param: values.get(f.param) for f in RUN_FLAGS}
    for name in ("lora_targets", "lora_modules_to_save"):
        if out[name] is not None:
            out[name] = comma_names(out[name])
    return out


def trainer_run(values: dict):
    """build_specs' `defaults`: for each run flag not given, what `shardwise train` runs with the
    schema's defaults (shardwise.run.trainer_defaults) on the planned device, for the planned model."""
    from shardwise.config.flags import RUN_FLAGS
    from shardwise.run.bridge import trainer_defaults
    from shardwise.specs import Strategy

    device = values.get("device") if values.get("device") in ("cuda", "cpu") else "cuda"
    lora = bool(values.get("lora_rank"))
    keep = {f.param for f in RUN_FLAGS} | {"compiled_engines"}

    engines = set()
    for name in values.get("strategy") or ():
        try:
            engines.add(Strategy.from_name(name).engine)
        except ShardwiseError:
            engines = set()  # refused with its own message when it is planned
            break

    def defaults(model) -> dict:
        out = {k: v for k, v in trainer_defaults(device, model.family, lora=lora).items() if k in keep}
        compiled = out.pop("compiled_engines")
        if values.get("fused_kernels") is not None:  # given: one value for every strategy
            return out
        if engines and len({e in compiled for e in engines}) == 1:  # the named strategies agree: one value
            return out | {"fused_kernels": next(iter(engines)) in compiled}
        return out | {"compiled_engines": compiled}  # decided per strategy, as the trainer decides it

    return defaults


def grad_pass_field(grad_pass: str | None) -> str | None:
    """--grad-pass as TrainSpec's field (None: not given)."""
    from typing import get_args

    from shardwise.specs.train import GradPass

    if grad_pass is not None and grad_pass not in get_args(GradPass):
        raise ShardwiseError(f"--grad-pass {grad_pass!r}: expected {', '.join(get_args(GradPass))}")
    return grad_pass


def objective_fields(objective: str | None, reference: str | None) -> dict:
    """--objective / --reference as TrainSpec fields (None: not given; the reference by its flag
    spelling, adapters-off, or the field's); an unknown value names its flag."""
    from typing import get_args

    from shardwise.specs.train import Objective, Reference

    out: dict = {}
    if objective is not None:
        if objective not in get_args(Objective):
            raise ShardwiseError(f"--objective {objective!r}: expected {', '.join(get_args(Objective))}")
        out["objective"] = objective
    if reference is not None:
        ref = reference.replace("-", "_")
        if ref not in get_args(Reference):
            raise ShardwiseError(f"--reference {reference!r}: expected "
                                 f"{', '.join(r.replace('_', '-') for r in get_args(Reference))}")
        out["reference"] = ref
    return out


def comma_names(value: str) -> tuple[str, ...]:
    """A comma-separated flag value as names (empty parts dropped)."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


def check_fsdp_flags(named: list[str], reshard: str | None, reduce_every: bool, reshard_root: bool = False) -> None:
    """--fsdp-reshard-after-forward / --fsdp-reduce-every-micro-batch / --fsdp-reshard-root need a
    strategy they change: with -s / --emit-strategy, one of those named (without, they apply to the
    FSDP2 rows)."""
    from typing import get_args

    from shardwise.config.strategy import STRATEGIES, Resharding

    if reshard is not None and reshard not in get_args(Resharding):
        raise ShardwiseError(f"--fsdp-reshard-after-forward {reshard!r}: expected {', '.join(get_args(Resharding))}")
    names = [n.strip().lower() for n in named if n.strip().lower() in STRATEGIES]  # unknown: refused elsewhere
    if not names:
        return
    fsdp = [n for n in STRATEGIES if STRATEGIES[n].engine == "fsdp2"]
    resharded = [n for n in fsdp if STRATEGIES[n].fsdp_sharding != "grad-op" or reshard == "none"]
    for flag, given, applies in (("--fsdp-reshard-after-forward", reshard is not None, resharded),
                                 ("--fsdp-reduce-every-micro-batch", reduce_every, fsdp),
                                 ("--fsdp-reshard-root", reshard_root, fsdp)):
        if given and not set(names) & set(applies):
            raise ShardwiseError(f"{flag} applies to {', '.join(applies)}; not to {', '.join(names)}"
                                 + (" (fsdp-grad-op keeps every layer gathered: none)"
                                    if "fsdp-grad-op" in names and flag.endswith("forward") else ""))


def emit_plan(m, hw, train, rec, *, rec_error, out_dir, name, tp, pp, knobs, margin, accounting):
    """Write exactly the configuration the plan shows, or refuse and say why: the recommended
    one (strategy, micro-batch, accumulation, checkpointing), or with --emit-strategy that
    strategy's row of the table. Returns ((evaluation, paths), notes)."""
    from shardwise.emit import emit_configs, emitted_run
    from shardwise.plan.evaluate import evaluate
    from shardwise.plan.recommend import describe, tool_for
    from shardwise.specs import Strategy
    from shardwise.specs.pipeline import trainer_pp_gap

    if name:
        flags = f"--emit-strategy {name}" + (f" --tp {tp}" if tp and tp > 1 else "") + (
            f" --pp {pp}" if pp and pp > 1 else "")
        try:
            strategy = Strategy.with_knobs(name, knobs, tp=tp or 1, pp=pp or 1)
            chosen = evaluate(m, hw, train, strategy, accounting=accounting, margin=margin)
        except ShardwiseError as e:
            raise ShardwiseError(f"{flags}: {e}") from None
        what = f"{flags}: {describe(chosen)}"
        drop = "drop --tp/--pp"
    elif rec is None:
        raise ShardwiseError(f"--emit: nothing to write, no configuration shardwise can train fits: {rec_error}")
    else:
        chosen = rec.best
        what = f"--emit: the recommended {describe(chosen)}"
        drop = "drop --tp/--pp for a recommendation it can run"
        if rec.equivalent is not None:
            drop += (f" (at this layout it runs {describe(rec.equivalent)}: add -s {rec.equivalent.strategy.name} to "
                     "emit that)")
    s = chosen.strategy
    if not s.trainable:
        raise ShardwiseError(
            f"{what} is plan-only: shardwise train and the emitted launchers run data parallelism, tensor "
            f"parallelism with FSDP2 or ZeRO-1/2 (no offload) and pipeline parallelism with FSDP2 (no offload); this "
            f"is {s.name} with tp {s.tp}, pp {s.pp}. Run it with {tool_for(s, chosen.train, m)}, or {drop}.")
    why = trainer_pp_gap(m, s, chosen.train)
    if why:
        raise ShardwiseError(f"{what} is plan-only: shardwise train does not run its pipeline stages: {why}. Run "
                             f"it with {tool_for(s, chosen.train, m)}, or {drop}.")
    if not chosen.fits:
        raise ShardwiseError(f"{what} does not fit: {_shortfall(chosen)}{_fitting_hint(m, hw, train, s, knobs, margin, accounting)}")
    notes = emitted_run(m, hw, chosen.train, s)[1]
    paths = emit_configs(m, hw, chosen.train, s, Path(out_dir), plan=chosen.memory)
    return (chosen, paths), notes


def _shortfall(e) -> str:
    """Why an evaluation does not fit, in numbers."""
    from shardwise.specs.hardware import GIB

    mem = e.memory
    parts = []
    if mem.gpu.required > mem.usable_bytes:
        parts.append(f"{mem.gpu.required / GIB:.1f} GiB per GPU against {mem.usable_bytes / GIB:.1f} GiB usable "
                     f"({mem.capacity_bytes / GIB:.1f} GiB less the {mem.margin:.0%} margin; needed: the allocated "
                     "peak, allocator slack a cache flush cannot return, CUDA context, NCCL)")
    if mem.host.peak > mem.host_capacity_bytes:
        parts.append(f"{mem.host.peak / GIB:.0f} GiB of host memory per node against {mem.host_capacity_bytes / GIB:.0f}"
                     + (" (loading the weights)" if mem.host.load.per_node >= mem.host.training else ""))
    return " and ".join(parts)


def _fitting_hint(m, hw, train, strategy, knobs, margin, accounting="engine") -> str:
    """The fastest setting of the same strategy and layout that fits, as flags to pass."""
    from shardwise.plan.recommend import sweep

    found = [e for e in sweep(m, hw, train, strategies=[strategy.name], tps=(strategy.tp,), pps=(strategy.pp,),
                              checkpointing=("none", "full"), margin=margin, knobs=knobs, accounting=accounting,
                              base_layout=(strategy.tp, strategy.pp))
             if e.fits]
    if not found:
        return f". No micro-batch (1-8) or checkpointing makes {strategy.name} fit here."
    b = max(found, key=lambda e: e.time.tokens_per_s_per_gpu)
    return (f". It fits with --micro-batch {b.train.micro_batch} --grad-accum {b.train.grad_accum} "
            f"--checkpointing {b.train.checkpointing} ({b.memory.gpu.total / 2**30:.1f} GiB, "
            f"{rate(b.time.tokens_per_s_per_gpu)} tokens/s per GPU).")


def plan_cpu(m, hw, train, strategies, knobs, a: dict, source) -> object:
    """`plan --device cpu`: each strategy's host memory per rank and per node on CPU ranks
    (shardwise.plan.host_cpu), the figure `shardwise train` checks before it starts them. The
    load phase is read off `--model-config`'s directory when it holds weights (else the model is
    built from its config, as the trainer builds a catalog model); the node's memory is
    --host-memory-gb, else MemAvailable of this machine."""
    from shardwise.cli.render_cpu import CpuPlan, cpu_rows
    from shardwise.plan.host_cpu import cpu_checkpointing_choice, cpu_rank_memory
    from shardwise.plan.planner import plan_layouts
    from shardwise.plan.recompute import grouped_lines
    from shardwise.run.host import node_memory
    from shardwise.specs.hardware import GIB

    if "optimizer_impl" not in given_flags() and source is None:  # the trainer's AdamW on CPU: the for-loop
        train = train.model_copy(update={"optimizer_impl": "forloop"})
    fmt_, largest = None, 0.0
    cfg_path = a.get("model_config")
    if cfg_path is not None and Path(cfg_path).is_dir():
        from shardwise.train.model.weights import checkpoint_weights

        fmt_, largest = checkpoint_weights(cfg_path)
    evals, _ = plan_layouts(m, hw, train, strategies, tp=a["tp"] or 1, pp=a["pp"] or 1, knobs=knobs)
    per_node = max(1, min(hw.world_size, hw.gpus_per_node))
    available, where = (node_memory(a.get("host_memory_gb"), "--host-memory-gb")
                        or (hw.host_memory_bytes, "the default host memory; --host-memory-gb sets it"))
    # `checkpointing: auto` decided per strategy against the node's memory, as the trainer decides it on CPU
    choices, mems = [], {}
    for e in evals:
        choice = cpu_checkpointing_choice(m, hw, train, e.strategy, available)
        t = train if choice is None else train.model_copy(update={"checkpointing": choice.checkpointing})
        mems[e.strategy.name] = cpu_rank_memory(m, hw, t, e.strategy, fmt_, largest)
        choices += [choice] if choice else []
    title = (f"{m.name} ({m.params / 1e9:.2f}B params) on {hw.world_size} CPU rank(s), {per_node} per node, seq "
             f"{train.seq_len} × micro-batch {train.micro_batch} × accum {train.grad_accum}, {train.precision}, "
             f"checkpointing {train.checkpointing}"
             + (f", LoRA rank {train.lora_rank} on {', '.join(train.lora_targets)}" if train.lora_rank else ""))
    load_from = (f"weights: {fmt_} files in {cfg_path} (largest {largest / GIB:.2f} GiB)" if fmt_
                 else "weights: none read (the model is built from its config, as a catalog model is)")
    notes = [load_from, *grouped_lines(choices)]
    return CpuPlan(title, cpu_rows(evals, mems, available), available, where, notes, source)
