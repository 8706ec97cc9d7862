"""`shardwise train CONFIG.yaml [--set key=value ...] [--nproc N] [--force]`.

Without a launcher in the environment this process validates everything (config, model,
data, strategy vs world size, the planner's memory check) and then starts `--nproc` local
ranks (or trains in-process for one). Under torchrun, the `deepspeed` launcher or `srun`
each rank validates the same way and joins the group the launcher set up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from shardwise.errors import ShardwiseError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Train with DeepSpeed ZeRO 0-3, FSDP2 or DDP from one YAML config.",
)


def _fail(err: Exception) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[red]error:[/] {err}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command("train")
def train_cmd(
    config: Annotated[Path, typer.Argument(help="YAML config (see examples/demo.yaml).")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override: section.field=value (repeatable).")
    ] = None,
    nproc: Annotated[
        int | None, typer.Option("--nproc", help="Local ranks to start (default: run.nproc).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Run even if the planner predicts OOM.")] = False,
) -> None:
    """Train a causal LM on SFT data; the strategy changes memory and speed, never the result."""
    from shardwise.train.config import load_config
    from shardwise.train.launch import detect_env, spawn
    from shardwise.train.preflight import preflight

    overrides = list(set_ or [])
    try:
        cfg = load_config(config, overrides)
        launched = detect_env()
        world = int(launched["world_size"]) if launched else (nproc or cfg.run.nproc)
        device = cfg.resolved_device()
        run, check = preflight(cfg, world, device, force=force)
    except ShardwiseError as e:
        _fail(e)
        return
    if launched is None and world > 1:
        argv = ["-m", "shardwise.train.cli", str(config), *[a for o in overrides for a in ("--set", o)]]
        argv += ["--force"] if force else []
        extra = {"DS_ACCELERATOR": "cpu"} if device == "cpu" else {}
        # CPU ranks share the cores: one intra-op pool per rank that does not oversubscribe.
        threads = max(1, (os.cpu_count() or 1) // world) if device == "cpu" else None
        rc = spawn(argv, world, extra_env=extra, threads_per_rank=threads)
        raise typer.Exit(rc)
    _worker(run, check.planned_bytes)


def _worker(run, planned_bytes: float | None) -> None:
    import torch

    from shardwise.plan.flops import model_flops_per_token
    from shardwise.train.launch import init_distributed
    from shardwise.train.loop import train
    from shardwise.train.metrics import Metrics

    cfg, device = run.config, run.device
    if device == "cpu" and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    env = init_distributed(device)
    # MFU against the planned GPU's dense peak for the compute dtype; no CPU peak to compare
    peak = run.hardware.gpu.peak_flops(run.train.compute_dtype) if device == "cuda" else None
    metrics = Metrics(cfg, planned_bytes, model_flops_per_token(run.model, run.train.seq_len), peak)
    try:
        result = train(run, env, metrics=metrics, export_weights=cfg.checkpointing.save_final)
        if env.is_main and result.final_weights is not None:
            from shardwise.train.export import export_hf

            export_hf(cfg, result.final_weights, Path(cfg.checkpointing.output_dir))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
