"""`shardwise train CONFIG.yaml [--set key=value ...] [--nproc N] [--force]`.

Without a launcher in the environment this process validates everything (config, model,
data, strategy vs world size, the planner's memory check) and then starts `--nproc` local
ranks (or trains in-process for one). Under torchrun, the `deepspeed` launcher or `srun`
each rank validates the same way and joins the group the launcher set up.
"""

from __future__ import annotations

import os
import sys
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
    from rich.markup import escape

    Console(stderr=True).print(f"[red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
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
    resume: Annotated[
        str | None,
        typer.Option("--resume", help="'latest' (newest complete checkpoint in output_dir) or a checkpoint dir."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Run even if the planner predicts OOM.")] = False,
) -> None:
    """Train a causal LM on SFT data; the strategy changes memory and speed, never the result.

    Exit codes: 0 completed, 2 bad input (nothing ran), 3 NaN/Inf loss (nothing exported),
    4 a rank hung, 75 interrupted by SIGTERM/SIGUSR1/SIGINT after saving a checkpoint
    (`--resume latest` continues), 1 anything else; a rank killed by a signal: 128 + signal.
    """
    from shardwise.train.config import load_config
    from shardwise.train.launch import detect_env
    from shardwise.train.preflight import preflight, resolve_checkpoint
    from shardwise.train.spawn import spawn

    overrides = list(set_ or []) + ([f"checkpointing.resume={resume}"] if resume else [])
    launched = detect_env()
    by_us = os.environ.get("SHARDWISE_LAUNCHED") == "1"  # a rank of our own spawn: checks are done
    lock = None
    try:
        cfg = load_config(config, overrides)
        world = int(launched["world_size"]) if launched else (nproc if nproc is not None else cfg.run.nproc)
        device = cfg.resolved_device()
        rank = int(launched["rank"]) if launched else 0
        owner = rank == 0 and not by_us  # takes the output dir's lock, cleans, verifies hashes
        run, check = preflight(cfg, world, device, force=force)
        resume_dir = resolve_checkpoint(cfg, run, verify_hashes=owner)
        if owner:
            lock = _own_output_dir(cfg)
    except ShardwiseError as e:
        _fail(e)
        return
    try:
        if launched is None and world > 1:
            argv = ["-m", "shardwise.train.cli", str(config), *[a for o in set_ or [] for a in ("--set", o)]]
            argv += ["--force"] if force else []
            argv += ["--resume", str(resume_dir)] if resume_dir else []
            extra = {"SHARDWISE_LAUNCHED": "1"} | ({"DS_ACCELERATOR": "cpu"} if device == "cpu" else {})
            # CPU ranks share the cores: one intra-op pool per rank that does not oversubscribe.
            threads = max(1, (os.cpu_count() or 1) // world) if device == "cpu" else None
            rc = spawn(argv, world, extra_env=extra, threads_per_rank=threads, run_dir=_run_dir(cfg))
            raise typer.Exit(rc)
        raise typer.Exit(_worker(run, check.planned_bytes, resume_dir))
    finally:
        if lock is not None:
            lock.release()


def _run_dir(cfg) -> Path:
    """Where ranks keep their heartbeats (shardwise.train.watchdog) for the launcher to read."""
    return Path(cfg.checkpointing.output_dir) / ".shardwise"


def _own_output_dir(cfg):
    """Lock the output dir for this run and clear what killed runs left behind."""
    from shardwise.train.checkpoint import checkpoints_dir, clean_stale
    from shardwise.train.outputs import OutputLock, clean_stale_outputs

    lock = OutputLock(cfg.checkpointing.output_dir).acquire()
    stale = clean_stale_outputs(cfg.checkpointing.output_dir) + clean_stale(checkpoints_dir(cfg.checkpointing.output_dir))
    if stale:
        print(f"shardwise: removed unfinished files of an earlier run: {', '.join(stale)}")
    return lock


def _worker(run, planned_bytes: float | None, resume_dir: Path | None) -> int:
    """One rank: train, export, write the summary with the run's status; return the exit code."""
    import traceback

    import torch

    from shardwise.errors import ExitCode
    from shardwise.plan.flops import run_flops_per_token
    from shardwise.train.launch import detect_env, init_distributed
    from shardwise.train.loop import Interrupted, NonFiniteError, train
    from shardwise.train.metrics import Metrics
    from shardwise.train.signals import StopRequest
    from shardwise.train.watchdog import Watchdog

    cfg, device = run.config, run.device
    if device == "cpu" and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    found = detect_env() or {"rank": 0, "world_size": 1}
    # Started before the process group, so a rank that never joins is named by those that did.
    watchdog = Watchdog(_run_dir(cfg), int(found["rank"]), int(found["world_size"]), cfg.run.timeout_s).start()
    watchdog.phase("init_process_group", 0)
    env = init_distributed(device, timeout_s=cfg.run.timeout_s)
    if env.world_size > 1:  # under torchrun/srun each rank resolved `latest` itself: rank 0's choice wins
        import torch.distributed as dist

        choice = [str(resume_dir) if resume_dir else None]
        dist.broadcast_object_list(choice, src=0)
        resume_dir = Path(choice[0]) if choice[0] else None
    # MFU against the planned GPU's dense peak for the compute dtype; no CPU peak to compare
    peak = run.hardware.gpu.peak_flops(run.train.compute_dtype) if device == "cuda" else None
    metrics = Metrics(cfg, planned_bytes, run_flops_per_token(run.model, run.train), peak)
    status, reason, code = "failed", None, ExitCode.FAILED
    # the engine that ran: FSDP2 with a one-rank shard group may run as DDP (FSDPKnobs.single_rank)
    extra: dict = {"strategy": run.strategy.name, "engine": run.engine_strategy.engine}
    try:
        with StopRequest() as stop, watchdog:
            result = train(run, env, metrics=metrics, export_weights=cfg.checkpointing.save_final,
                           resume=resume_dir, stop=stop, watchdog=watchdog)  # fmt: skip
            extra["checkpoint"] = str(result.checkpoint) if result.checkpoint else None
            if env.is_main and result.final_weights is not None:
                from shardwise.train.export import export_dir, export_final

                watchdog.phase("export write", cfg.run.steps)
                extra["export"] = str(export_final(cfg, result.final_weights, export_dir(cfg)))
        status, code = "completed", ExitCode.OK
    except Interrupted as e:
        status, reason, code = "interrupted", str(e), ExitCode.INTERRUPTED
        extra["checkpoint"] = str(e.checkpoint) if e.checkpoint else None
        print(f"shardwise: rank {env.rank}: {e}", flush=True)
    except NonFiniteError as e:
        reason, code = str(e), ExitCode.NONFINITE
        print(f"shardwise: rank {env.rank}: {e}", file=sys.stderr, flush=True)
    except Exception as e:  # reported with its traceback; the summary names it
        reason = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        metrics.close(status, reason, **extra)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return int(code)


def main() -> None:
    from shardwise.train.launch import run_cli

    run_cli(app)


if __name__ == "__main__":
    main()
