"""`shardwise` command line: plan (torch-free, fast), and the train/data verbs (loaded lazily)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from shardwise.errors import ShardwiseError

app = typer.Typer(add_completion=False, no_args_is_help=False, help=__doc__,
                  pretty_exceptions_enable=False)

DEFAULT_MODEL = "llama-2-7b"


def _fail(err: Exception) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[red]error:[/] {err}", highlight=False)
    raise typer.Exit(2)


@app.command()
def plan(
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Catalog model name."),
    model_config: Optional[Path] = typer.Option(None, "--model-config", help="Local HF config.json (overrides --model)."),
    params: Optional[float] = typer.Option(None, "--params", help="Parameter count, e.g. 7e9 (Llama shape; overrides --model)."),
    gpu: str = typer.Option("a100-80g", "--gpu", help="GPU preset."),
    gpus: int = typer.Option(8, "--gpus", help="Total GPUs."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="Default: min(gpus, 8)."),
    interconnect: Optional[str] = typer.Option(None, "--interconnect", help="Slowest link data-parallel traffic crosses."),
    gpu_memory_gb: Optional[float] = typer.Option(None, "--gpu-memory-gb", help="Override GPU memory (GB)."),
    seq_len: int = typer.Option(2048, "--seq-len"),
    micro_batch: int = typer.Option(1, "--micro-batch"),
    grad_accum: int = typer.Option(1, "--grad-accum"),
    precision: str = typer.Option("bf16-mixed", "--precision", help="bf16-mixed | fp16-mixed | bf16-pure | fp32"),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | sgd | adam8bit"),
    checkpointing: str = typer.Option("none", "--checkpointing", help="none | full | selective"),
    attention: str = typer.Option("sdpa", "--attention", help="eager | sdpa | flash"),
    lora_rank: int = typer.Option(0, "--lora-rank", help="0 = full fine-tuning."),
    cross_entropy: str = typer.Option("standard", "--cross-entropy", help="standard | chunked | fused"),
    strategy: Optional[list[str]] = typer.Option(None, "--strategy", "-s", help="Repeatable; default: all."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel degree."),
    accounting: str = typer.Option("engine", "--accounting", help="engine | paper | deepspeed"),
    margin: float = typer.Option(0.05, "--margin", help="Fraction of GPU memory kept free."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Per-GPU memory of every strategy for a model, hardware and training setup."""
    from pydantic import ValidationError

    from shardwise.plan.planner import build_specs, plan_strategies
    from shardwise.plan.report import plan_json, plan_table

    try:
        m, hw, train = build_specs(
            model=model, model_config=model_config, params=params, gpu=gpu, gpus=gpus,
            gpus_per_node=gpus_per_node, interconnect=interconnect, gpu_memory_gb=gpu_memory_gb,
            seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision,
            optimizer=optimizer, checkpointing=checkpointing, attention=attention,
            lora_rank=lora_rank, cross_entropy=cross_entropy,
        )
        if accounting not in ("engine", "paper", "deepspeed"):
            raise ShardwiseError(f"--accounting {accounting!r}: expected engine, paper or deepspeed")
        plans = plan_strategies(m, hw, train, strategy, tp=tp, pp=pp, accounting=accounting, margin=margin)
    except (ShardwiseError, ValidationError) as e:
        _fail(e)
    if as_json:
        sys.stdout.write(json.dumps(plan_json(m, hw, train, plans, accounting), indent=2) + "\n")
    else:
        from rich.console import Console

        console = Console()
        if console.width < 140:  # the table has 13 columns; wrap nothing, let the terminal scroll
            console = Console(width=140)
        console.print(plan_table(m, hw, train, plans))


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
