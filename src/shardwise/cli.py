"""`shardwise` command line: plan (torch-free, fast), and the train/data verbs (loaded lazily)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from shardwise.errors import ShardwiseError

app = typer.Typer(add_completion=False, no_args_is_help=False, help=__doc__,
                  pretty_exceptions_enable=False)

DEFAULT_MODEL = "llama-2-7b"


def _print_version(value: bool) -> None:
    if value:
        from shardwise import __version__

        typer.echo(f"shardwise {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print shardwise's version and exit.")) -> None:
    """shardwise: plan, train and measure multi-GPU SFT across DeepSpeed ZeRO, FSDP2 and DDP."""



def _fail(err: Exception) -> None:
    from rich.console import Console
    from rich.markup import escape

    # escaped: a path like "[run]/x" is not markup; soft-wrapped: paths stay copyable
    Console(stderr=True).print(f"[red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def plan(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Catalog model name."),
    model_config: Path | None = typer.Option(None, "--model-config", help="Local HF config.json (overrides --model)."),
    params: float | None = typer.Option(None, "--params", help="Parameter count, e.g. 7e9 (Llama shape; overrides --model)."),
    gpu: str = typer.Option("a100-80g", "--gpu", help="GPU preset."),
    gpus: int = typer.Option(8, "--gpus", help="Total GPUs."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="Default: min(gpus, 8)."),
    interconnect: str | None = typer.Option(None, "--interconnect", help="Link inside a node (default: the GPU's own; "
                                            "nvlink/pcie: the GPU's generation, nvlink refused on a GPU without it) or "
                                            "between nodes (ib-*, roce-*, eth-*); needs --gpus-per-node."),
    gpu_memory_gb: float | None = typer.Option(None, "--gpu-memory-gb", help="Override GPU memory (GB)."),
    seq_len: int = typer.Option(2048, "--seq-len"),
    micro_batch: int = typer.Option(1, "--micro-batch"),
    grad_accum: int = typer.Option(1, "--grad-accum"),
    precision: str = typer.Option("bf16-mixed", "--precision", help="bf16-mixed | fp16-mixed | bf16-pure | fp32"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | sgd | adam8bit"),
    checkpointing: str = typer.Option("none", "--checkpointing", help="none | full | selective"),
    attention: str = typer.Option("sdpa", "--attention", help="eager | sdpa | flash"),
    lora_rank: int = typer.Option(0, "--lora-rank", help="0 = full fine-tuning."),
    lora_targets: str = typer.Option("q_proj,k_proj,v_proj,o_proj", "--lora-targets",
                                     help="Comma-separated module names, or all-linear."),
    lora_modules_to_save: str = typer.Option("", "--lora-modules-to-save",
                                             help="Comma-separated modules trained in full (e.g. lm_head)."),
    qlora: bool = typer.Option(False, "--qlora", help="LoRA on a 4-bit NF4 base (bitsandbytes)."),
    cross_entropy: str = typer.Option(
        "standard", "--cross-entropy", help="standard (HF logits, fp32 upcast whole) | chunked (the trainer's "
        "default: lm_head + loss fused per --ce-chunk tokens) | fused (Liger's kernel) | inplace (flash-attn's)"),
    ce_chunk: int | None = typer.Option(None, "--ce-chunk", help="Tokens per chunk of the chunked cross-entropy "
                                        "(the trainer's loss.chunk_tokens; default 1024); needs --cross-entropy "
                                        "chunked."),
    optimizer_impl: str = typer.Option("fused", "--optimizer-impl", help="AdamW kernel: fused | foreach | forloop."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay (the trainer's "
                                       "optimizer.weight_decay): above 0 norms, biases and embeddings form a second "
                                       "optimizer group, which DeepSpeed ZeRO-1/2 partitions on its own."),
    fused_kernels: bool = typer.Option(False, "--fused-kernels", help="Elementwise work fused (torch.compile, Megatron-style kernels)."),
    fused_norm: bool = typer.Option(False, "--fused-norm", help="RMSNorm as one fused kernel (torchtitan's fused_rmsnorm, "
                                    "Liger, apex; implied by --fused-kernels): its saved tensors and the bytes it moves."),
    expandable_segments: bool = typer.Option(False, "--expandable-segments", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less reserved slack)."),
    sequence_parallel: bool = typer.Option(True, "--sequence-parallel/--no-sequence-parallel",
                                           help="Under --tp > 1: norms, residuals and their elementwise work split "
                                           "over the TP ranks (Megatron-LM --sequence-parallel, torchtitan); "
                                           "off: replicated on every TP rank."),
    tp_comm_overlap: bool = typer.Option(False, "--tp-comm-overlap", help="Under --tp > 1: TP's collectives "
                                         "overlapped with the GEMMs they feed (Megatron-LM --tp-comm-overlap, "
                                         "torchtitan's async TP); off: on the critical path."),
    strategy: list[str] | None = typer.Option(None, "--strategy", "-s", help="Repeatable; default: all."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel degree of the table (default 1); given, the "
                                  "recommender keeps to it too (default: it sweeps 1, 2, 4, 8)."),
    pp: int | None = typer.Option(None, "--pp", help="Pipeline-parallel degree of the table (default 1); given, "
                                  "the recommender keeps to it too (default: it sweeps 1, 2, 4)."),
    accounting: str = typer.Option("engine", "--accounting", help="engine | paper | deepspeed"),
    margin: float = typer.Option(0.05, "--margin", help="Fraction of GPU memory kept free."),
    host_memory_gb: float | None = typer.Option(None, "--host-memory-gb", help="Host RAM per node (GB), default 2048."),
    nics_per_node: int | None = typer.Option(None, "--nics-per-node", help="Network cards per node (default: one per GPU on InfiniBand, one per node on Ethernet)."),
    profile: Path | None = typer.Option(None, "--profile", help="Hardware profile measured on your GPUs (JSON); replaces the catalog's rates."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    emit: Path | None = typer.Option(None, "--emit", help="Write DeepSpeed/FSDP/accelerate configs and launch scripts here."),
    emit_strategy: str | None = typer.Option(None, "--emit-strategy", help="Emit this strategy's row of the table "
                                             "(your --micro-batch, --grad-accum, --checkpointing) instead of the "
                                             "recommended configuration."),
    ds_bucket: float | None = typer.Option(None, "--ds-bucket", help="DeepSpeed reduce + all-gather bucket (elements; default 5e8)."),
    ds_reduce_bucket: float | None = typer.Option(None, "--ds-reduce-bucket", help="DeepSpeed reduce_bucket_size only (elements)."),
    ds_prefetch: float | None = typer.Option(None, "--ds-prefetch", help="ZeRO-3 stage3_prefetch_bucket_size (elements)."),
    ds_persistence_threshold: float | None = typer.Option(None, "--ds-persistence-threshold", help="ZeRO-3 stage3_param_persistence_threshold (elements)."),
    ds_max_live: float | None = typer.Option(None, "--ds-max-live", help="ZeRO-3 stage3_max_live_parameters."),
    ds_max_reuse: float | None = typer.Option(None, "--ds-max-reuse", help="ZeRO-3 stage3_max_reuse_distance."),
    ds_overlap_comm: bool | None = typer.Option(None, "--ds-overlap-comm/--no-ds-overlap-comm", help="Default: on for ZeRO-3 only."),
    ds_multi_rank_allreduce: bool | None = typer.Option(None, "--ds-multi-rank-allreduce/--no-ds-multi-rank-allreduce", help="ZeRO-1/2 use_multi_rank_bucket_allreduce (default on)."),
    ds_comm_dtype: str | None = typer.Option(None, "--ds-comm-dtype", help="DeepSpeed communication_data_type: auto | fp32 | bf16 | fp16."),
    ds_fetch_unit: str | None = typer.Option(None, "--ds-fetch-unit", help="ZeRO-3 fetch unit: auto (a decoder layer "
                                             "when it fits the gathered-parameter caps) | layer | module (DeepSpeed's default)."),
    fsdp_reduce_dtype: str | None = typer.Option(None, "--fsdp-reduce-dtype", help="FSDP2 gradient reduce dtype: fp32 (default) | param."),
    fsdp_single_rank: str | None = typer.Option(None, "--fsdp-single-rank", help="FSDP2 with a one-rank shard group "
                                                "(one GPU) runs as: auto (ddp where it fits and is no slower) | ddp | fsdp."),
    fsdp_reshard_after_forward: str | None = typer.Option(
        None, "--fsdp-reshard-after-forward", help="FSDP2 decoder layers freed after forward (gathered again in "
        "backward): not-last (the trainer's default) | all (stock fully_shard: accelerate, HF Trainer, torchtune) "
        "| none (every layer kept gathered, as fsdp-grad-op)."),
    fsdp_reduce_every_micro_batch: bool = typer.Option(
        False, "--fsdp-reduce-every-micro-batch", help="FSDP2 with --grad-accum: reduce-scatter every micro-batch "
        "(torch's default, stock trainers) instead of once per step (the trainer's)."),
    ddp_bucket_mb: float | None = typer.Option(None, "--ddp-bucket-mb", help="DDP bucket_cap_mb (default 25)."),
    ddp_wrap_one_rank: bool | None = typer.Option(None, "--ddp-wrap-one-rank/--no-ddp-wrap-one-rank",
                                                  help="DDP with one replica: keep DistributedDataParallel "
                                                  "(default: the bare module, no gradient buckets)."),
    shard_group: int | None = typer.Option(None, "--shard-group", help="fsdp-hybrid: GPUs per shard group (default: a node)."),
) -> None:
    """Per-GPU memory, communication and step time of every strategy; the recommended one and why."""
    from shardwise.plan.planner import build_specs, check_margin, plan_layouts
    from shardwise.plan.recommend import NothingFits, recommend
    from shardwise.plan.report import load_line, plan_json, plan_table, time_table

    rec = rec_error = None
    alternatives: tuple = ()
    ds_flags = {"--ds-bucket": ds_bucket, "--ds-reduce-bucket": ds_reduce_bucket, "--ds-prefetch": ds_prefetch,
                "--ds-persistence-threshold": ds_persistence_threshold, "--ds-max-live": ds_max_live,
                "--ds-max-reuse": ds_max_reuse, "--ds-overlap-comm": ds_overlap_comm,
                "--ds-multi-rank-allreduce": ds_multi_rank_allreduce, "--ds-comm-dtype": ds_comm_dtype,
                "--ds-fetch-unit": ds_fetch_unit}
    try:
        _check_flags_apply(strategy, emit_strategy, [f for f, v in ds_flags.items() if v is not None],
                           ce_chunk, cross_entropy)
        m, hw, train = build_specs(
            model=model, model_config=model_config, params=params, gpu=gpu, gpus=gpus,
            gpus_per_node=gpus_per_node, interconnect=interconnect, gpu_memory_gb=gpu_memory_gb,
            seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision,
            optimizer=optimizer, checkpointing=checkpointing, attention=attention,
            lora_rank=lora_rank, lora_targets=_names(lora_targets), lora_modules_to_save=_names(lora_modules_to_save),
            base_quant="nf4" if qlora else "none", cross_entropy=cross_entropy, host_memory_gb=host_memory_gb,
            **({} if ce_chunk is None else {"ce_chunk": ce_chunk}),
            nics_per_node=nics_per_node, profile=profile, optimizer_impl=optimizer_impl,
            fused_kernels=fused_kernels, fused_norm=fused_norm, expandable_segments=expandable_segments,
            sequence_parallel=sequence_parallel, tp_comm_overlap=tp_comm_overlap, weight_decay=weight_decay,
        )
        check_margin(margin)
        warnings = _input_warnings(m, train)
        if accounting not in ("engine", "paper", "deepspeed"):
            raise ShardwiseError(f"--accounting {accounting!r}: expected engine, paper or deepspeed")
        _check_fsdp_flags([*(strategy or ()), *([emit_strategy] if emit_strategy else [])],
                          fsdp_reshard_after_forward, fsdp_reduce_every_micro_batch)
        knobs = _knobs(
            ds={"reduce_bucket_size": ds_reduce_bucket or ds_bucket, "allgather_bucket_size": ds_bucket,
                "prefetch_bucket_size": ds_prefetch, "param_persistence_threshold": ds_persistence_threshold,
                "max_live_parameters": ds_max_live, "max_reuse_distance": ds_max_reuse,
                "overlap_comm": ds_overlap_comm, "use_multi_rank_bucket_allreduce": ds_multi_rank_allreduce,
                "communication_data_type": ds_comm_dtype, "fetch_unit": ds_fetch_unit},
            fsdp={"reduce_dtype": fsdp_reduce_dtype, "single_rank": fsdp_single_rank,
                  "reshard_after_forward": fsdp_reshard_after_forward,
                  "reduce_every_micro_batch": fsdp_reduce_every_micro_batch or None},
            ddp={"bucket_cap_mb": ddp_bucket_mb, "wrap_one_rank": ddp_wrap_one_rank}, shard_group=shard_group)
        evals, skipped = plan_layouts(m, hw, train, strategy, tp=1 if tp is None else tp,
                                      pp=1 if pp is None else pp, accounting=accounting, margin=margin, knobs=knobs)
        # -s, --tp and --pp restrict the recommender as they restrict the table
        try:
            rec = recommend(m, hw, train, strategies=strategy or None, tps=(tp,) if tp else None,
                            pps=(pp,) if pp else None, margin=margin, knobs=knobs)
            alternatives = rec.alternatives
        except NothingFits as no_fit:
            rec_error, alternatives = str(no_fit), no_fit.alternatives
        emitted, notes = None, []
        if emit is not None:
            emitted, notes = _emit(m, hw, train, rec, rec_error=rec_error, out_dir=emit, name=emit_strategy, tp=tp,
                                   pp=pp, knobs=knobs, margin=margin, accounting=accounting)
    except ShardwiseError as e:
        _fail(e)
    _warn(warnings)
    if as_json:
        doc = plan_json(m, hw, train, evals, accounting, rec, skipped=skipped, profile=profile)
        doc["warnings"] = warnings
        if rec is None:
            doc["recommended"], doc["recommended_setting"], doc["runner_up"] = None, None, None
            doc["reason"] = rec_error
            doc["plan_only_alternatives"] = [a.as_dict() for a in alternatives]
        if emitted:
            chosen, paths = emitted
            doc["emitted"] = [str(p) for p in paths]
            doc["emitted_setting"] = _setting(chosen) | {"notes": notes}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if console.width < 150:  # the table has 14 columns; wrap nothing, let the terminal scroll
        console = Console(width=150)
    console.print(plan_table(m, hw, train, [e.memory for e in evals]))
    line = load_line([e.memory for e in evals])
    if line:
        console.print(escape(line), highlight=False)
    console.print(time_table(evals))
    if skipped:
        console.print(f"Not in the table (cannot run with tp {tp or 1}, pp {pp or 1} here):", highlight=False)
        for name, why in skipped.items():
            console.print(f"  - {escape(why if repr(name) in why or why.startswith(name) else f'{name}: {why}')}",
                          highlight=False)
    if rec is None:
        console.print(f"[bold red]Nothing fits:[/] {escape(rec_error)}", highlight=False)
    elif rec.runnable:
        console.print(f"[bold green]Recommended:[/] {escape(rec.reason)}", highlight=False)
    else:
        console.print(f"[bold yellow]Recommended (plan-only: run it with {escape(rec.tool)}):[/] {escape(rec.reason)}",
                      highlight=False)
    if rec is not None and alternatives:
        console.print("[bold]Plan-only alternatives[/] (faster, but shardwise train and --emit cannot run them):",
                      highlight=False)
        for a in alternatives:
            console.print(f"  - {escape(a.why)}", highlight=False)
    if emitted:
        from shardwise.plan.recommend import describe

        chosen, paths = emitted
        console.print(f"Emitted {escape(describe(chosen))} to {escape(str(emit))}:", highlight=False)
        for n in notes:
            console.print(f"  note: {escape(n)}", highlight=False)
        for path in paths:
            console.print(f"wrote {escape(str(path))}", highlight=False)


# ZeRO-3's knobs (stage3_* and the fetch unit) and ZeRO-1/2's (use_multi_rank_bucket_allreduce)
_ZERO3_FLAGS = ("--ds-prefetch", "--ds-persistence-threshold", "--ds-max-live", "--ds-max-reuse", "--ds-fetch-unit")
_ZERO12_FLAGS = ("--ds-multi-rank-allreduce",)


def _check_flags_apply(strategies: list[str] | None, emit_strategy: str | None, ds_given: list[str],
                       ce_chunk: int | None, cross_entropy: str) -> None:
    """Flags that would change nothing are refused, naming the flag: DeepSpeed knobs when no
    planned strategy runs DeepSpeed (ZeRO-3's and ZeRO-1/2's own knobs when none is of that
    stage), and a chunk size for a loss that is not chunked."""
    from shardwise.specs import STRATEGY_NAMES, Strategy

    if ce_chunk is not None and cross_entropy != "chunked":
        raise ShardwiseError(f"--ce-chunk {ce_chunk} sets the chunk of the chunked cross-entropy, but --cross-entropy "
                             f"is {cross_entropy!r}: add --cross-entropy chunked, or drop --ce-chunk")
    if not ds_given:
        return
    names = list(strategies or STRATEGY_NAMES) + ([emit_strategy] if emit_strategy else [])
    try:
        planned = [Strategy.from_name(n) for n in names]
    except ShardwiseError:
        return  # an unknown strategy name is refused with its own message when it is planned
    shown = ", ".join(names)
    stages = {s.zero_stage for s in planned if s.engine == "deepspeed"}
    for flag in ds_given:
        if not stages:
            raise ShardwiseError(f"{flag} is a DeepSpeed knob, but no strategy planned runs DeepSpeed (-s {shown}): "
                                 "add a zero0..zero3 strategy with -s, or drop the flag")
        for flags, wanted, what in ((_ZERO3_FLAGS, {3}, "ZeRO-3"), (_ZERO12_FLAGS, {1, 2}, "ZeRO-1/2")):
            if flag in flags and not stages & wanted:
                raise ShardwiseError(f"{flag} is a {what} knob, but no {what} strategy is planned (-s {shown}): "
                                     "add one with -s, or drop the flag")


def _input_warnings(model, train) -> list[str]:
    """What is accepted but worth saying: a sequence beyond the model's trained context."""
    out = []
    if train.seq_len > model.max_position_embeddings:
        out.append(f"--seq-len {train.seq_len} is beyond {model.name}'s max_position_embeddings "
                   f"{model.max_position_embeddings}: planned as given (RoPE scaling or a longer-context "
                   "variant can run it; the model was not trained that long)")
    return out


def _warn(warnings: list[str]) -> None:
    """On stderr, so --json's stdout stays one JSON object."""
    if not warnings:
        return
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    for w in warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", highlight=False, soft_wrap=True)


def _setting(e) -> dict:
    lay = e.memory.layout
    return {"strategy": e.strategy.name, "tp": lay.tp, "pp": lay.pp, "micro_batch": e.train.micro_batch,
            "grad_accum": e.train.grad_accum, "checkpointing": e.train.checkpointing,
            "tokens_per_s_per_gpu": e.time.tokens_per_s_per_gpu, "memory_total": e.memory.gpu.total}


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated flag value as names (empty parts dropped)."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


def _check_fsdp_flags(named: list[str], reshard: str | None, reduce_every: bool) -> None:
    """--fsdp-reshard-after-forward / --fsdp-reduce-every-micro-batch need a strategy they change:
    with -s / --emit-strategy, one of those named (without, they apply to the FSDP2 rows)."""
    from typing import get_args

    from shardwise.specs.strategy import STRATEGIES, Resharding

    if reshard is not None and reshard not in get_args(Resharding):
        raise ShardwiseError(f"--fsdp-reshard-after-forward {reshard!r}: expected {', '.join(get_args(Resharding))}")
    names = [n.strip().lower() for n in named if n.strip().lower() in STRATEGIES]  # unknown: refused elsewhere
    if not names:
        return
    fsdp = [n for n in STRATEGIES if STRATEGIES[n].engine == "fsdp2"]
    resharded = [n for n in fsdp if STRATEGIES[n].fsdp_sharding != "grad-op" or reshard == "none"]
    for flag, given, applies in (("--fsdp-reshard-after-forward", reshard is not None, resharded),
                                 ("--fsdp-reduce-every-micro-batch", reduce_every, fsdp)):
        if given and not set(names) & set(applies):
            raise ShardwiseError(f"{flag} applies to {', '.join(applies)}; not to {', '.join(names)}"
                                 + (" (fsdp-grad-op keeps every layer gathered: none)"
                                    if "fsdp-grad-op" in names and flag.endswith("forward") else ""))


def _knobs(ds: dict, fsdp: dict, ddp: dict, shard_group: int | None):
    """The engine knobs the --ds-*/--fsdp-*/--ddp-* flags set (unset flags: the engines' defaults)."""
    from shardwise.catalog import check_count
    from shardwise.specs import DDPKnobs, DeepSpeedKnobs, FSDPKnobs
    from shardwise.specs.strategy import StrategyKnobs

    if shard_group is not None:
        check_count("--shard-group", shard_group, hint=" (GPUs per fsdp-hybrid shard group)")

    def given(d: dict) -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, float) and k != "bucket_cap_mb":  # element counts, given as 5e7 or 50000000
                if v != int(v):
                    raise ShardwiseError(f"DeepSpeed {k} = {v}: expected a whole number of elements (e.g. 5e7)")
                v = int(v)
            if v is not None:
                out[k] = v
        return out

    return StrategyKnobs(ds=DeepSpeedKnobs(**given(ds)), fsdp=FSDPKnobs(**given(fsdp)), ddp=DDPKnobs(**given(ddp)),
                         shard_group=shard_group)


def _emit(m, hw, train, rec, *, rec_error, out_dir, name, tp, pp, knobs, margin, accounting):
    """Write exactly the configuration the plan shows, or refuse and say why: the recommended
    one (strategy, micro-batch, accumulation, checkpointing), or with --emit-strategy that
    strategy's row of the table. Returns ((evaluation, paths), notes)."""
    from shardwise.emit import emit_configs, emitted_run
    from shardwise.plan.evaluate import evaluate
    from shardwise.plan.recommend import describe, tool_for
    from shardwise.specs import Strategy

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
    s = chosen.strategy
    if not s.trainable:
        raise ShardwiseError(
            f"{what} is plan-only: shardwise train and the emitted launchers run data parallelism, and tensor "
            f"parallelism with FSDP2 (pp 1), this has tp {s.tp}, pp {s.pp}. Run it with "
            f"{tool_for(s, chosen.train, m)}, or {drop}.")
    if not chosen.fits:
        raise ShardwiseError(f"{what} does not fit: {_shortfall(chosen)}{_fitting_hint(m, hw, train, s, knobs, margin)}")
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


def _fitting_hint(m, hw, train, strategy, knobs, margin) -> str:
    """The fastest setting of the same strategy and layout that fits, as flags to pass."""
    from shardwise.plan.recommend import sweep

    found = [e for e in sweep(m, hw, train, strategies=[strategy.name], tps=(strategy.tp,), pps=(strategy.pp,),
                              checkpointing=("none", "full"), margin=margin, knobs=knobs) if e.fits]
    if not found:
        return f". No micro-batch (1-8) or checkpointing makes {strategy.name} fit here."
    b = max(found, key=lambda e: e.time.tokens_per_s_per_gpu)
    return (f". It fits with --micro-batch {b.train.micro_batch} --grad-accum {b.train.grad_accum} "
            f"--checkpointing {b.train.checkpointing} ({b.memory.gpu.total / 2**30:.1f} GiB, "
            f"{b.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU).")


@app.command()
def explain(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Catalog model name."),
    model_config: Path | None = typer.Option(None, "--model-config", help="Local HF config.json."),
    params: float | None = typer.Option(None, "--params", help="Parameter count (Llama shape)."),
    gpu: str = typer.Option("a100-80g", "--gpu"),
    gpus: int = typer.Option(8, "--gpus"),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node"),
    interconnect: str | None = typer.Option(None, "--interconnect"),
    seq_len: int = typer.Option(2048, "--seq-len"),
    micro_batch: int = typer.Option(1, "--micro-batch"),
    checkpointing: str = typer.Option("none", "--checkpointing"),
) -> None:
    """ZeRO-1/2/3 vs FSDP for your model and hardware: what each shards, memory, traffic, crossovers."""
    from rich.console import Console
    from rich.markdown import Markdown

    from shardwise.plan.explain import explain as explain_text
    from shardwise.plan.planner import build_specs

    try:
        m, hw, train = build_specs(model=model, model_config=model_config, params=params, gpu=gpu, gpus=gpus,
                                   gpus_per_node=gpus_per_node, interconnect=interconnect, seq_len=seq_len,
                                   micro_batch=micro_batch, checkpointing=checkpointing)
        text = explain_text(m, hw, train)
    except ShardwiseError as e:
        _fail(e)
    if sys.stdout.isatty():
        Console().print(Markdown(text))
    else:
        sys.stdout.write(text + "\n")


# The extra of pyproject.toml that installs each third-party package the lazily mounted verbs
# import (the core install, `pip install shardwise`, is the planner: plan and explain).
EXTRA_OF = {m: "train" for m in ("torch", "transformers", "deepspeed", "datasets", "safetensors", "tokenizers",
                                  "peft", "accelerate", "matplotlib", "tensorboard", "pyarrow", "numpy",
                                  "filelock", "jinja2", "huggingface_hub")} | {"bitsandbytes": "qlora"}  # fmt: skip
# What each verb cannot start without: checked before it runs, so a planner-only install is
# answered before the command does anything (a run's output dir, its plan).
NEEDS = {"data": ("numpy", "transformers"), "train": ("torch", "transformers"),
         "export": ("torch", "transformers"), "calibrate": ("torch",), "bench": ("torch", "transformers")}


def missing_extra(name: str, module: str) -> ShardwiseError | None:
    """The user error for `shardwise NAME` when the third-party `module` cannot be imported
    (None when it is not one an extra installs: a bug, left to its traceback)."""
    top = module.partition(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return ShardwiseError(
        f"shardwise {name}: the Python package {top!r} is not installed; `shardwise {name}` needs the "
        f"{extra!r} extra: pip install 'shardwise[{extra}]' (the core install, pip install shardwise, is the "
        "planner only: plan and explain)")


def _absent(modules: tuple[str, ...]) -> str | None:
    """The first of `modules` that cannot be found (nothing is imported)."""
    from importlib.util import find_spec

    for m in modules:
        try:
            if find_spec(m) is None:
                return m
        except (ImportError, ValueError):  # an import hook refusing it; a module without a spec
            return m
    return None


def _passthrough(module: str, name: str, help_text: str):
    """Mount a verb whose implementation imports torch only when it is used. Without the extra
    it needs, it is one message naming the extra (exit 2), not an import traceback."""

    @app.command(name=name, help=help_text, add_help_option=False,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _cmd(ctx: typer.Context) -> None:
        import importlib

        args = list(ctx.args)
        absent = None if "--help" in args else _absent(NEEDS.get(name, ()))
        if absent is not None:
            _fail(missing_extra(name, absent) or ShardwiseError(f"shardwise {name}: {absent!r} is not installed"))
        try:
            sub = importlib.import_module(module).app
            sub(args=args, prog_name=f"shardwise {name}")
        except ModuleNotFoundError as err:
            error = missing_extra(name, err.name or "")
            if error is None:
                raise
            _fail(error)


_passthrough("shardwise.data.cli", "data", "SFT data tools: `shardwise data inspect FILE`.")
_passthrough("shardwise.train.cli", "train", "Train with DeepSpeed, FSDP2 or DDP from a YAML config.")
_passthrough("shardwise.train.export_cli", "export", "Export a checkpoint as a Hugging Face model directory.")
_passthrough("shardwise.bench.calibrate_cli", "calibrate", "Measure this machine's GPUs and links into a hardware profile.")
_passthrough("shardwise.bench.bench_cli", "bench", "Run a few trainer steps; measured memory, time and comm vs the plan.")


@app.command(name="version")
def version_cmd(full: bool = typer.Option(False, "--full", help="Also Python, torch (with its CUDA and NCCL), "
                                          "DeepSpeed, transformers, accelerate, PEFT, datasets, safetensors, "
                                          "bitsandbytes."),
                as_json: bool = typer.Option(False, "--json", help="As a JSON object.")) -> None:
    """shardwise's version; with --full, the libraries a run's numbers depend on."""
    from shardwise import __version__
    from shardwise.versions import full_report

    report = full_report() if full else {"shardwise": __version__}
    if as_json:
        typer.echo(json.dumps(report))
        return
    for name, value in report.items():
        missing = "none (a CPU build)" if name.startswith("torch ") else "not installed"
        typer.echo(f"{name} {value if value is not None else missing}")


def main() -> None:
    from shardwise.train.launch import run_cli

    run_cli(app)


if __name__ == "__main__":
    main()
