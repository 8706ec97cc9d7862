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
    interconnect: str | None = typer.Option(None, "--interconnect", help="Slowest link data-parallel traffic crosses."),
    gpu_memory_gb: float | None = typer.Option(None, "--gpu-memory-gb", help="Override GPU memory (GB)."),
    seq_len: int = typer.Option(2048, "--seq-len"),
    micro_batch: int = typer.Option(1, "--micro-batch"),
    grad_accum: int = typer.Option(1, "--grad-accum"),
    precision: str = typer.Option("bf16-mixed", "--precision", help="bf16-mixed | fp16-mixed | bf16-pure | fp32"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | sgd | adam8bit"),
    checkpointing: str = typer.Option("none", "--checkpointing", help="none | full | selective"),
    attention: str = typer.Option("sdpa", "--attention", help="eager | sdpa | flash"),
    lora_rank: int = typer.Option(0, "--lora-rank", help="0 = full fine-tuning."),
    cross_entropy: str = typer.Option("standard", "--cross-entropy", help="standard | chunked | fused"),
    strategy: list[str] | None = typer.Option(None, "--strategy", "-s", help="Repeatable; default: all."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel degree."),
    accounting: str = typer.Option("engine", "--accounting", help="engine | paper | deepspeed"),
    margin: float = typer.Option(0.05, "--margin", help="Fraction of GPU memory kept free."),
    host_memory_gb: float | None = typer.Option(None, "--host-memory-gb", help="Host RAM per node (GB), default 2048."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    emit: Path | None = typer.Option(None, "--emit", help="Write DeepSpeed/FSDP/accelerate configs and launch scripts here."),
    emit_strategy: str | None = typer.Option(None, "--emit-strategy", help="Strategy to emit (default: the recommended one)."),
    ds_bucket: float | None = typer.Option(None, "--ds-bucket", help="DeepSpeed reduce + all-gather bucket (elements; default 5e8)."),
    ds_reduce_bucket: float | None = typer.Option(None, "--ds-reduce-bucket", help="DeepSpeed reduce_bucket_size only (elements)."),
    ds_prefetch: float | None = typer.Option(None, "--ds-prefetch", help="ZeRO-3 stage3_prefetch_bucket_size (elements)."),
    ds_persistence_threshold: float | None = typer.Option(None, "--ds-persistence-threshold", help="ZeRO-3 stage3_param_persistence_threshold (elements)."),
    ds_max_live: float | None = typer.Option(None, "--ds-max-live", help="ZeRO-3 stage3_max_live_parameters."),
    ds_max_reuse: float | None = typer.Option(None, "--ds-max-reuse", help="ZeRO-3 stage3_max_reuse_distance."),
    ds_overlap_comm: bool | None = typer.Option(None, "--ds-overlap-comm/--no-ds-overlap-comm", help="Default: on for ZeRO-3 only."),
    ds_multi_rank_allreduce: bool | None = typer.Option(None, "--ds-multi-rank-allreduce/--no-ds-multi-rank-allreduce", help="ZeRO-1/2 use_multi_rank_bucket_allreduce (default on)."),
    ds_comm_dtype: str | None = typer.Option(None, "--ds-comm-dtype", help="DeepSpeed communication_data_type: auto | fp32 | bf16 | fp16."),
    fsdp_reduce_dtype: str | None = typer.Option(None, "--fsdp-reduce-dtype", help="FSDP2 gradient reduce dtype: fp32 (default) | param."),
    ddp_bucket_mb: float | None = typer.Option(None, "--ddp-bucket-mb", help="DDP bucket_cap_mb (default 25)."),
    shard_group: int | None = typer.Option(None, "--shard-group", help="fsdp-hybrid: GPUs per shard group (default: a node)."),
) -> None:
    """Per-GPU memory, communication and step time of every strategy; the recommended one and why."""
    from shardwise.plan.planner import build_specs, plan_strategies
    from shardwise.plan.recommend import recommend
    from shardwise.plan.report import plan_json, plan_table, time_table

    try:
        m, hw, train = build_specs(
            model=model, model_config=model_config, params=params, gpu=gpu, gpus=gpus,
            gpus_per_node=gpus_per_node, interconnect=interconnect, gpu_memory_gb=gpu_memory_gb,
            seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision,
            optimizer=optimizer, checkpointing=checkpointing, attention=attention,
            lora_rank=lora_rank, cross_entropy=cross_entropy, host_memory_gb=host_memory_gb,
        )
        if accounting not in ("engine", "paper", "deepspeed"):
            raise ShardwiseError(f"--accounting {accounting!r}: expected engine, paper or deepspeed")
        knobs = _knobs(
            ds={"reduce_bucket_size": ds_reduce_bucket or ds_bucket, "allgather_bucket_size": ds_bucket,
                "prefetch_bucket_size": ds_prefetch, "param_persistence_threshold": ds_persistence_threshold,
                "max_live_parameters": ds_max_live, "max_reuse_distance": ds_max_reuse,
                "overlap_comm": ds_overlap_comm, "use_multi_rank_bucket_allreduce": ds_multi_rank_allreduce,
                "communication_data_type": ds_comm_dtype},
            fsdp={"reduce_dtype": fsdp_reduce_dtype}, ddp={"bucket_cap_mb": ddp_bucket_mb}, shard_group=shard_group)
        evals = plan_strategies(m, hw, train, strategy, tp=tp, pp=pp, accounting=accounting, margin=margin,
                                knobs=knobs)
        try:
            rec = recommend(m, hw, train, strategies=strategy or None, margin=margin, knobs=knobs)
        except ShardwiseError as no_fit:
            rec, rec_error = None, str(no_fit)
        emitted = []
        if emit is not None:
            emitted = _emit(m, hw, train, evals, rec, emit, emit_strategy, tp, pp, knobs)
    except ShardwiseError as e:
        _fail(e)
    if as_json:
        doc = plan_json(m, hw, train, evals, accounting, rec)
        if rec is None:
            doc["recommended"], doc["reason"] = None, rec_error
        if emitted:
            doc["emitted"] = [str(p) for p in emitted]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from rich.console import Console

    console = Console()
    if console.width < 150:  # the table has 14 columns; wrap nothing, let the terminal scroll
        console = Console(width=150)
    console.print(plan_table(m, hw, train, [e.memory for e in evals]))
    console.print(time_table(evals))
    if rec is not None:
        console.print(f"[bold green]Recommended:[/] {rec.reason}", highlight=False)
    else:
        console.print(f"[bold red]Nothing fits:[/] {rec_error}", highlight=False)
    for path in emitted:
        console.print(f"wrote {path}", highlight=False)


def _knobs(ds: dict, fsdp: dict, ddp: dict, shard_group: int | None):
    """The engine knobs the --ds-*/--fsdp-*/--ddp-* flags set (unset flags: the engines' defaults)."""
    from shardwise.specs import DDPKnobs, DeepSpeedKnobs, FSDPKnobs
    from shardwise.specs.strategy import StrategyKnobs

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


def _emit(m, hw, train, evals, rec, out_dir, name, tp, pp, knobs):
    from shardwise.emit import emit_configs
    from shardwise.specs import Strategy

    if name:
        strategy = Strategy.with_knobs(name, knobs, tp=tp, pp=pp)
        chosen = next((e for e in evals if e.strategy.name == strategy.name), None)
        plan = chosen.memory if chosen else None
    elif rec is not None:
        best = rec.best
        if best.memory.layout.tp > 1 or best.memory.layout.pp > 1:
            # shardwise's trainer and the emitted launchers are data-parallel only: emit the best
            # configuration without TP/PP (the table still shows the TP/PP winner)
            from shardwise.plan.recommend import recommend

            best = recommend(m, hw, train, tps=(1,), pps=(1,), knobs=knobs).best
        strategy, train, plan = best.strategy, best.train, best.memory
    else:
        raise ShardwiseError("--emit: nothing fits, so there is no recommended strategy; name one with --emit-strategy")
    return emit_configs(m, hw, train, strategy, Path(out_dir), plan=plan)


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


def _passthrough(module: str, name: str, help_text: str):
    """Mount a verb whose implementation imports torch only when it is used."""

    @app.command(name=name, help=help_text, add_help_option=False,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _cmd(ctx: typer.Context) -> None:
        import importlib

        sub = importlib.import_module(module).app
        sub(args=list(ctx.args), prog_name=f"shardwise {name}")


_passthrough("shardwise.data.cli", "data", "SFT data tools: `shardwise data inspect FILE`.")
_passthrough("shardwise.train.cli", "train", "Train with DeepSpeed, FSDP2 or DDP from a YAML config.")
_passthrough("shardwise.train.export_cli", "export", "Export a checkpoint as a Hugging Face model directory.")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
