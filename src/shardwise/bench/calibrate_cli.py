"""`shardwise calibrate`: measure this machine and write the hardware profile the planner reads."""

from __future__ import annotations

from pathlib import Path

import typer

from shardwise.errors import ShardwiseError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, help=__doc__)

GIB = 2**30


@app.command()
def calibrate(
    gpus: int = typer.Option(1, "--gpus", help="Local ranks for the collective measurement (1: none)."),
    out: Path | None = typer.Option(None, "--out", help="Profile path (default: the user's cache directory)."),
    model: str = typer.Option("llama-2-7b", "--model", "-m", help="Catalog model whose GEMM shapes are measured."),
    quick: bool = typer.Option(False, "--quick", help="Fewer repeats and smaller sizes (a rough profile in seconds)."),
) -> None:
    """GEMM, attention and memory throughput, host AdamW, PCIe, and collective bus bandwidth."""
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
    raw, gpu = doc["raw"], doc["gpu"]
    con = Console()
    con.print(f"device: {doc['gpu_name']}" + (f" (catalog {raw['catalog_gpu']})" if raw.get("catalog_gpu") else ""))
    con.print(f"GEMM best {raw['gemm_best_flops'] / 1e12:.2f} TFLOP/s, attention {raw['attention_flops'] / 1e12:.2f} "
              f"TFLOP/s, memory {raw['memory_bytes_per_s'] / 1e9:.1f} GB/s, host AdamW "
              f"{doc['host_torch_adam_params_per_s'] / 1e9:.2f} G params/s", highlight=False)
    if "intra" in doc:
        c = raw["collectives"]
        con.print(f"collectives ({c['world']} ranks, {c['backend']}): bus {doc['intra']['bus_bytes_per_s'] / 1e9:.2f} GB/s, "
                  f"latency {doc['intra']['latency_s'] * 1e6:.0f} µs per hop", highlight=False)
    con.print(f"efficiencies: {', '.join(f'{k} {v:.2f}' for k, v in gpu.items() if k.endswith('efficiency'))}",
              highlight=False)
    con.print(f"wrote {path}  (use: shardwise plan --profile {path}; trainer: hardware.profile)", highlight=False)


def main() -> None:
    app()
