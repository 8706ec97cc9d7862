"""`shardwise calibrate`: measure this machine and write the hardware profile the planner reads."""

from __future__ import annotations

from pathlib import Path

import typer

from shardwise.cli_help import HELP
from shardwise.errors import ShardwiseError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__, **HELP)

GIB = 2**30


@app.command()
def calibrate(
    gpus: int = typer.Option(1, "--gpus", help="Local ranks for the collective measurement (1: none; under "
                             "torchrun / srun every launched rank takes part instead)."),
    out: Path | None = typer.Option(None, "--out", help="Profile path (default: the user's cache directory)."),
    model: str = typer.Option("llama-2-7b", "--model", "-m", help="Catalog model whose GEMM shapes are measured."),
    quick: bool = typer.Option(False, "--quick", help="Fewer repeats and smaller sizes (a rough profile in seconds)."),
) -> None:
    """GEMM, attention and memory throughput, the AdamW step rate, host AdamW, PCIe, and collective
    bus bandwidth inside a node (and across nodes when launched over several)."""
    from rich.console import Console
    from rich.markup import escape

    from shardwise.bench.calibrate import calibrate as run
    console = Console(stderr=True)
    try:
        if gpus < 1 or gpus > 64:
            raise ShardwiseError(f"--gpus {gpus}: expected the number of local ranks, 1..64")
        with console.status("measuring (a few minutes on a GPU, ~30 s --quick)…"):
            path, doc = run(gpus=gpus, out=out, model=model, quick=quick)
    except ShardwiseError as e:
        console.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    if doc is None:  # a rank other than 0 under torchrun / srun: rank 0 reports
        return
    raw, gpu = doc["raw"], doc["gpu"]
    con = Console()
    con.print(f"device: {doc['gpu_name']}" + (f" (catalog {raw['catalog_gpu']})" if raw.get("catalog_gpu") else ""))
    con.print(f"GEMM best {raw['gemm_best_flops'] / 1e12:.2f} TFLOP/s, attention {raw['attention_flops'] / 1e12:.2f} "
              f"TFLOP/s, memory {raw['memory_bytes_per_s'] / 1e9:.1f} GB/s, host AdamW "
              f"{doc['host_torch_adam_params_per_s'] / 1e9:.2f} G params/s", highlight=False)
    if "adamw_params_per_s" in gpu:
        con.print(f"AdamW step ({gpu['adamw_impl']}, the trainer's kernel here): "
                  f"{gpu['adamw_params_per_s'] / 1e9:.3f} G params/s", highlight=False)
    for level in ("intra", "inter"):
        if level in doc:
            c = raw["collectives"]
            lv = c["levels"][level]
            where = "inside each node" if level == "intra" else "across nodes (one rank per node, every rail at once)"
            con.print(f"collectives {where}: {lv['groups']} group(s) of {lv['group_size']} ({c['backend']}), bus "
                      f"{doc[level]['bus_bytes_per_s'] / 1e9:.2f} GB/s, latency {doc[level]['latency_s'] * 1e6:.0f} µs "
                      "per hop", highlight=False)
    con.print(f"efficiencies: {', '.join(f'{k} {v:.2f}' for k, v in gpu.items() if k.endswith('efficiency'))}",
              highlight=False)
    con.print(f"wrote {path}  (use: shardwise plan --profile {path}; trainer: hardware.profile)", highlight=False)


def main() -> None:
    from shardwise.train.launch.rank import run_cli

    run_cli(app)
