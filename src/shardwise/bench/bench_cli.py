"""`shardwise bench CONFIG.yaml [--steps N] [--set k=v ...] [--nproc N] [--out DIR] [--sweep k=v1,v2 ...]`:
run the trainer for a few steps and compare measured memory, time and collective bytes with the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shardwise.cli_help import HELP
from shardwise.errors import ShardwiseError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__, **HELP)


@app.command()
def bench(
    config: Annotated[Path, typer.Argument(help="YAML config (as for `shardwise train`).")],
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps per point (>= 3: steady-state comm).")] = 5,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: section.field=value (repeatable).")] = None,
    nproc: Annotated[int | None, typer.Option("--nproc", help="Local ranks to start (default: run.nproc).")] = None,
    out: Annotated[Path, typer.Option("--out", help="Where bench.json, report.md and the plots go.")] = Path(
        "runs/bench"),
    sweep: Annotated[list[str] | None, typer.Option(
        "--sweep", help="section.field=v1,v2 or strategy= / micro_batch= / grad_accum= / seq_len= / "
                        "checkpointing= (repeatable; the cartesian product is run, one launch per point).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Run even if the planner predicts OOM.")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="Show every third-party warning and log line (shardwise.quiet lists what is "
        "otherwise silenced, and why).")] = False,
) -> None:
    """Per rank: model-state bytes by term (census of the live engine) vs the planner, memory after
    forward / backward / optimizer step (CUDA allocator peaks; host RSS on CPU, never compared with
    the GPU plan) and its timeline over one step, the step split into forward / backward / optimizer /
    exposed communication vs the planner's, tokens/s, MFU (CUDA), and collective bytes per kind vs
    the planner; when exposed communication is over 40% of the step, the strategy the planner
    expects to fix it. Under torchrun / deepspeed / srun each process is a rank (--nproc does not
    apply) and rank 0 writes the outputs. Exit codes: 0 done, 2 bad input (nothing ran), 75 stopped
    by SIGTERM/SIGINT/SIGHUP/SIGUSR1, else the failed point's (when stopped or failed, bench.json and
    report.md hold the points measured before). Progress: a bar on a terminal, a timestamped line
    per point start and end otherwise."""
    from shardwise import quiet

    quiet.apply(verbose or None)  # the ranks inherit --verbose through the environment
    from rich.console import Console
    from rich.markup import escape

    from shardwise.bench.bench_report import print_table
    from shardwise.bench.points import BenchFailed, bench_points

    err = Console(stderr=True)
    try:
        doc = bench_points(config, list(set_ or []), steps, nproc, out, sweep, force)
    except ShardwiseError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except BenchFailed as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(e.code) from None
    if doc is None:  # a rank other than 0 under torchrun / deepspeed / srun: rank 0 reports
        return
    print_table(doc)
    Console().print(f"wrote {out / 'bench.json'} and {out / 'report.md'}", highlight=False)


def main() -> None:
    from shardwise.train.launch.rank import run_cli

    run_cli(app)


if __name__ == "__main__":
    main()
