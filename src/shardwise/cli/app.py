"""`shardwise` command line: plan (torch-free, fast), and the train/data verbs (loaded lazily)."""

from __future__ import annotations

from pathlib import Path

import typer

from shardwise import strict_json
from shardwise.cli.plan_inputs import (
    emit_plan,
    hardware_inputs,
    naming_file,
    plan_cpu,
    plan_inputs,
    plan_setup,
    print_warnings,
    trainer_run,
)
from shardwise.cli_help import HELP, whole_short_help
from shardwise.config.flags import run_option, strategy_option, with_knob_flags
from shardwise.errors import ShardwiseError

app = typer.Typer(add_completion=False, no_args_is_help=False, help=__doc__,
                  pretty_exceptions_enable=False, **HELP)

DEFAULT_MODEL = "llama-2-7b"
# `shardwise plan` when nothing it can recommend fits (the table and the reason are still printed;
# docs/planner.md): distinct from 2, a refused input, so scripts can tell the two apart.
NOTHING_FITS_EXIT = 3


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
@with_knob_flags
def plan(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help="A shardwise training YAML to plan (the RunSpec `shardwise "
                                         "train` plans; with --set as there); the same as --from CONFIG."),
    from_file: Path | None = typer.Option(None, "--from", help="Plan the run a file describes, read by its content: "
                                          "a DeepSpeed JSON (HF's \"auto\" values resolved as HF/accelerate do), an "
                                          "accelerate config YAML, a shardwise training YAML, a TrainingArguments "
                                          "JSON, a LLaMA-Factory or an axolotl YAML (docs/from.md). Flags given beside "
                                          "it override the file."),
    set_: list[str] | None = typer.Option(None, "--set", help="With a shardwise YAML: KEY=VALUE override, the "
                                          "trainer's syntax (repeatable)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Catalog model or Hugging Face id (ORG/NAME)."),
    model_config: Path | None = typer.Option(None, "--model-config", help="Local HF config.json (overrides --model)."),
    params: float | None = typer.Option(None, "--params", help="Parameter count, e.g. 7e9 (Llama shape; overrides --model)."),
    gpu: str = typer.Option("a100-80g", "--gpu", help="GPU preset."),
    gpus: int = typer.Option(8, "--gpus", help="Total GPUs (with --device cpu: ranks)."),
    device: str = typer.Option("cuda", "--device", help="cuda | cpu: with cpu, each strategy's host memory per rank "
                               "and per node of a run on CPU ranks (process, the step's tensors, heap, the load), "
                               "what shardwise train checks before it starts them (default: a YAML's run.device)."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="Default: min(gpus, 8)."),
    interconnect: str | None = typer.Option(None, "--interconnect", help="Link inside a node (default: the GPU's own; "
                                            "nvlink/pcie: the GPU's generation, nvlink refused on a GPU without it) or "
                                            "between nodes (ib-*, roce-*, eth-*); needs --gpus-per-node."),
    gpu_memory_gb: float | None = typer.Option(None, "--gpu-memory-gb", help="Override GPU memory (GB)."),
    # the run's fields (shardwise.config.flags.RUN_FLAGS): help and default from the schema
    seq_len: int | None = run_option("seq_len"),
    micro_batch: int | None = run_option("micro_batch"),
    grad_accum: int | None = run_option("grad_accum"),
    precision: str | None = run_option("precision"),
    optimizer: str | None = run_option("optimizer"),
    checkpointing: str | None = run_option("checkpointing"),
    attention: str | None = run_option("attention"),
    packed_attention: str | None = run_option("packed_attention"),
    lora_rank: int | None = run_option("lora_rank"),
    lora_targets: str | None = run_option("lora_targets"),
    lora_modules_to_save: str | None = run_option("lora_modules_to_save"),
    lora_dropout: float | None = run_option("lora_dropout"),
    qlora: bool = typer.Option(False, "--qlora", help="LoRA on a 4-bit NF4 base (bitsandbytes; YAML "
                               "lora.quantization: nf4)."),
    cross_entropy: str | None = run_option("cross_entropy"),
    ce_chunk: int | None = run_option("ce_chunk"),
    optimizer_impl: str | None = run_option("optimizer_impl"),
    weight_decay: float | None = run_option("weight_decay"),
    optimizer_in_backward: bool | None = run_option("optimizer_in_backward"),
    activation_offload: bool | None = run_option("activation_offload"),
    fused_kernels: bool | None = run_option("fused_kernels"),
    fused_norm: bool = typer.Option(False, "--fused-norm", help="RMSNorm as one fused kernel (torchtitan's fused_rmsnorm, "
                                    "Liger, apex; implied by --fused-kernels): its saved tensors and the bytes it moves."),
    fused_mlp: bool = typer.Option(False, "--fused-mlp", help="A gated MLP's activation and product as one kernel "
                                   "(Liger's SwiGLU/GeGLU): it saves gate and up, not act(gate), and moves fewer "
                                   "bytes."),
    expandable_segments: bool = typer.Option(False, "--expandable-segments", help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less reserved slack)."),
    sequence_parallel: bool = typer.Option(True, "--sequence-parallel/--no-sequence-parallel",
                                           help="Under --tp > 1: norms, residuals and their elementwise work split "
                                           "over the TP ranks (Megatron-LM --sequence-parallel, torchtitan); "
                                           "off: replicated on every TP rank."),
    objective: str | None = typer.Option(None, "--objective", help="Planner-only (shardwise train runs sft): sft | "
                                         "dpo | orpo | kto | simpo. dpo, orpo and simpo run each example's chosen "
                                         "and rejected sequences in one batch (2 × --micro-batch sequences of "
                                         "--seq-len tokens); dpo and kto add a reference's forward (docs/planner.md "
                                         "\"Preference objectives\"). Default: sft."),
    reference: str | None = typer.Option(None, "--reference", help="With --objective dpo or kto: model (a frozen "
                                         "copy in the compute dtype, sharded as the policy under ZeRO-3 and FSDP2) | "
                                         "precomputed (TRL precompute_ref_log_probs: no reference in the step) | "
                                         "adapters-off (LoRA: the base with the adapters disabled, no extra "
                                         "weights). Default: model, adapters-off under LoRA."),
    fp8: str | None = typer.Option(None, "--fp8", help="Planner-only (shardwise train runs bf16): the decoder "
                                   "linears' GEMMs in fp8: tensorwise | rowwise (torchao float8: torchtitan --float8."
                                   "recipe_name) | delayed (Transformer Engine: Megatron-LM --fp8-format hybrid, "
                                   "Composer amp_fp8) | current (Transformer Engine's current scaling: Megatron-LM "
                                   "--fp8-recipe tensorwise, NeMo FP8-CS) | mxfp8 (Transformer Engine's MXFP8 block scaling, Blackwell "
                                   "only: NeMo's FP8-MX) | mxfp8-torchao (torchao's MXLinear: torchtitan's mx converter; Blackwell only) | "
                                   "none (default). GPUs with FP8 tensor cores only."),
    fp8_all_gather: bool = typer.Option(False, "--fp8-all-gather", help="With --fp8, the linears' weights "
                                        "all-gathered and held in fp8: the FSDP2 rows' (--fp8 tensorwise: torchao "
                                        "enable_fsdp_float8_all_gather); zero1 with --zero-impl megatron "
                                        "(Megatron-LM --fp8-param-gather: the module keeps them in fp8)."),
    grad_pass: str | None = typer.Option(None, "--grad-pass", help="What runs over every gradient between backward "
                                         "and the optimizer step: clip (global-norm clipping: the trainer's, HF "
                                         "Trainer's, torchtitan's, Megatron-LM's; default) | scale (torchtune's "
                                         "per-tensor 1/tokens scaling) | none. None runs with "
                                         "--optimizer-in-backward whatever this says."),
    tp_comm_overlap: bool = typer.Option(False, "--tp-comm-overlap", help="Under --tp > 1: TP's collectives "
                                         "overlapped with the GEMMs they feed (Megatron-LM --tp-comm-overlap, "
                                         "torchtitan's async TP); off: on the critical path."),
    strategy: list[str] | None = typer.Option(None, "--strategy", "-s", help="Repeatable; default: all."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel degree of the table (default 1); given, the "
                                  "recommender keeps to it too (default: it sweeps 1, 2, 4, 8)."),
    pp: int | None = typer.Option(None, "--pp", help="Pipeline-parallel degree of the table (default 1); given, "
                                  "the recommender keeps to it too (default: it sweeps 1, 2, 4)."),
    pp_schedule: str | None = strategy_option(
        "pp_schedule", note="for the PP rows; given, the recommender keeps to it too (unset: the table plans 1f1b, "
        "the recommender sweeps 1f1b and, for FSDP2 stages, interleaved-1f1b over 2 stages a rank)"),
    pp_virtual_stages: int | None = strategy_option("pp_virtual_stages"),
    cp: int | None = strategy_option("cp", note="for every row; the recommender keeps to it"),
    cp_impl: str | None = strategy_option("cp_impl"),
    cp_load_balance: bool | None = strategy_option("cp_load_balance"),
    ep: int | None = strategy_option("ep", note="for the MoE rows of the table and the recommender"),
    ep_load_imbalance: float | None = strategy_option("ep_load_imbalance"),
    etp: int | None = strategy_option("etp"),
    ep_overlap: bool | None = strategy_option("ep_overlap"),
    accounting: str = typer.Option("engine", "--accounting", help="engine | paper | deepspeed"),
    margin: float | None = typer.Option(None, "--margin", show_default=False, help="Fraction of GPU memory kept free "
                                        "(default: the memory model's default_margin, catalog/memory.yaml)."),
    host_memory_gb: float | None = typer.Option(None, "--host-memory-gb", help="Host RAM per node (GB), default 2048."),
    nics_per_node: int | None = typer.Option(None, "--nics-per-node", help="Network cards per node (default: one per GPU on InfiniBand, one per node on Ethernet)."),
    profile: Path | None = typer.Option(None, "--profile", help="Hardware profile measured on your GPUs (JSON); replaces the catalog's rates."),
    hardware: str | None = typer.Option(None, "--hardware", help="auto (read this machine, as shardwise doctor) "
                                        "or a hardware spec file (shardwise doctor --write): GPU, GPUs per node, "
                                        "links, NICs, host memory; --gpu/--gpus/... given too override it."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the same as --format json)."),
    fmt: str = typer.Option("table", "--format", help="table (fits the terminal: COLUMNS when piped) | markdown | "
                            "csv (one row per strategy, every column) | json."),
    emit: Path | None = typer.Option(None, "--emit", help="Write DeepSpeed/FSDP/accelerate configs and launch scripts here."),
    emit_strategy: str | None = typer.Option(None, "--emit-strategy", help="Emit this strategy's row of the table "
                                             "(your --micro-batch, --grad-accum, --checkpointing) instead of the "
                                             "recommended configuration."),
    knob_values: dict | None = None,
) -> None:
    """Per-GPU memory, communication and step time of every strategy; the recommended one and why.
    The engine knobs (--ds-*, --fsdp-*, --ddp-*) are generated from shardwise.specs' knob classes:
    each is the trainer YAML's strategy.deepspeed/fsdp/ddp field of the same name."""
    from shardwise.cli.render import PlanOutput, check_format, print_plan
    from shardwise.plan.planner import plan_layouts
    from shardwise.plan.recommend import NothingFits, recommend

    rec = rec_error = None
    alternatives: tuple = ()
    source = None
    try:
        a, source = plan_inputs(ctx, knob_values or {})
        fmt = check_format(a["fmt"], a["as_json"])
        setup = plan_setup(a, source)
        m, hw, train, knobs, warnings = setup.model, setup.hw, setup.train, setup.knobs, setup.warnings
        tp, pp, accounting, margin, emit = a["tp"], a["pp"], a["accounting"], a["margin"], a["emit"]
        strategy, emit_strategy, profile = a["strategy"], a["emit_strategy"], a["profile"]
        if a["device"] == "cpu":
            if emit is not None:
                raise ShardwiseError("--emit writes GPU launch configs; a CPU run is a shardwise YAML with "
                                     "run.device: cpu (drop --device cpu to emit, or --emit to plan CPU ranks)")
            cpu = plan_cpu(m, hw, train, strategy, knobs, a, source)
        else:
            cpu = None
    except ShardwiseError as e:
        _fail(naming_file(e, source.path if source is not None else None))
    if cpu is not None:
        from shardwise.cli.render_cpu import print_cpu_plan

        print_warnings([*(source.warnings if source is not None else ()), *warnings])
        print_cpu_plan(cpu, fmt)
        if not any(r["fits"] for r in cpu.rows):
            raise typer.Exit(NOTHING_FITS_EXIT)
        return
    try:
        evals, skipped = plan_layouts(m, hw, train, strategy, tp=1 if tp is None else tp,
                                      pp=1 if pp is None else pp, accounting=accounting, margin=margin, knobs=knobs)
        # -s, --tp and --pp restrict the recommender as they restrict the table
        try:
            rec = recommend(m, hw, train, strategies=strategy or None, tps=(tp,) if tp else None,
                            pps=(pp,) if pp else None, margin=margin, knobs=knobs, accounting=accounting,
                            base_layout=(tp or 1, pp or 1))
            alternatives = rec.alternatives
        except NothingFits as no_fit:
            rec_error, alternatives = str(no_fit), no_fit.alternatives
        emitted, notes = None, []
        if emit is not None and train.fp8 != "none":
            raise ShardwiseError(f"--emit writes shardwise train's launchers, which run bf16; --fp8 {train.fp8} is "
                                 "planner-only: drop --emit")
        if emit is not None and train.objective != "sft":
            raise ShardwiseError(f"--emit writes shardwise train's launchers, which run SFT only; --objective "
                                 f"{train.objective} is planner-only: drop --emit")
        if emit is not None:
            emitted, notes = emit_plan(m, hw, train, rec, rec_error=rec_error, out_dir=emit, name=emit_strategy, tp=tp,
                                   pp=pp, knobs=knobs, margin=margin, accounting=accounting)
        if source is not None:
            from shardwise.cli.advice_checks import check_as_flags, replanner
            from shardwise.ingest.advice import advise

            source = advise(source, m, hw, train, knobs, margin=margin, accounting=accounting, tp=tp or 1, pp=pp or 1,
                            replan=replanner(ctx, knob_values or {}, source))
            source.command, source.command_refused = check_as_flags(ctx, knob_values or {}, source, a, setup,
                                                                    planned=evals)
    except ShardwiseError as e:
        _fail(naming_file(e, source.path if source is not None else None))
    print_warnings([*(source.warnings if source is not None else ()), *warnings])
    print_plan(PlanOutput(m, hw, train, evals, accounting, rec=rec, rec_error=rec_error, alternatives=alternatives,
                          skipped=skipped, profile=profile, warnings=warnings, emitted=emitted, notes=notes,
                          emit_dir=emit, tp=tp, pp=pp, hardware=a["hardware"], source=source), fmt)
    if rec is None:
        raise typer.Exit(NOTHING_FITS_EXIT)


@app.command()
def explain(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Catalog model or Hugging Face id (ORG/NAME)."),
    model_config: Path | None = typer.Option(None, "--model-config", help="Local HF config.json."),
    params: float | None = typer.Option(None, "--params", help="Parameter count (Llama shape)."),
    gpu: str = typer.Option("a100-80g", "--gpu"),
    gpus: int = typer.Option(8, "--gpus"),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node"),
    interconnect: str | None = typer.Option(None, "--interconnect"),
    seq_len: int | None = run_option("seq_len"),
    micro_batch: int | None = run_option("micro_batch"),
    checkpointing: str | None = run_option("checkpointing"),
    hardware: str | None = typer.Option(None, "--hardware", help="As plan's: auto (read this machine, as "
                                        "shardwise doctor) or a hardware spec file (shardwise doctor --write): GPU, "
                                        "GPUs per node, links, NICs, host memory; --gpus defaults to one node; "
                                        "--gpu/--gpus/--gpus-per-node/--interconnect given too override it."),
    as_json: bool = typer.Option(False, "--json", help="The comparison and the text as one JSON object (the same "
                                 "as --format json)."),
    fmt: str = typer.Option("table", "--format", help="table (wrapped to the terminal: COLUMNS when piped) | "
                            "markdown (the text as Markdown) | csv (the comparison, one row per strategy) | json."),
) -> None:
    """ZeRO-1/2/3 vs FSDP for your model and hardware: what each shards, memory, traffic, crossovers."""
    from dataclasses import asdict

    from shardwise.cli.render import check_format
    from shardwise.cli.render_explain import print_explain
    from shardwise.plan.explain import compare
    from shardwise.plan.explain import explain as explain_text
    from shardwise.plan.planner import build_specs

    try:
        fmt = check_format(fmt, as_json)
        machine, gpu, gpus = hardware_inputs(hardware, gpu, gpus)  # as plan reads it
        m, hw, train = build_specs(model=model, model_config=model_config, params=params, gpu=gpu, gpus=gpus,
                                   machine=machine, gpus_per_node=gpus_per_node, interconnect=interconnect, seq_len=seq_len,
                                   micro_batch=micro_batch, checkpointing=checkpointing, defaults=trainer_run({}))
        text = explain_text(m, hw, train)
        rows = [asdict(r) for r in compare(m, hw, train).values()] if fmt in ("csv", "json") else []
    except ShardwiseError as e:
        _fail(e)
    print_explain(text, rows, fmt)


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
_passthrough("shardwise.train.export.cli", "export", "Export a checkpoint as a Hugging Face model directory.")
_passthrough("shardwise.bench.calibrate_cli", "calibrate", "Measure this machine's GPUs and links into a hardware profile.")
_passthrough("shardwise.bench.bench_cli", "bench", "Run a few trainer steps; measured memory, time and comm vs the plan.")
_passthrough("shardwise.doctor.cli", "doctor", "This machine's GPUs, topology, network, NCCL settings and host: what "
             "will hurt, and the hardware spec plan --hardware uses.")


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
        typer.echo(strict_json.dumps(report))
        return
    for name, value in report.items():
        missing = "none (a CPU build)" if name.startswith("torch ") else "not installed"
        typer.echo(f"{name} {value if value is not None else missing}")


whole_short_help(app)


def main() -> None:
    from shardwise.train.launch.rank import run_cli

    run_cli(app)


if __name__ == "__main__":
    main()
