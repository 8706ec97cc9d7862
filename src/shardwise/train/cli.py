"""`shardwise train CONFIG.yaml [--set key=value ...] [--nproc N] [--force]`.

Without a launcher in the environment this process validates everything (config, model,
data, strategy vs world size, the planner's memory check) and then starts `--nproc` local
ranks (or trains in-process for one). Ranks it forks inherit the checked run; ranks it execs
(CUDA) read the config again and take preflight's verdict from the launcher (`HANDOFF_ENV`,
refused if the file changed since). Under torchrun, the `deepspeed` launcher or `srun` each
rank validates the same way and joins the group the launcher set up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from shardwise.cli_help import HELP
from shardwise.errors import ExitCode, ShardwiseError

HANDOFF_ENV = "SHARDWISE_PREFLIGHT"  # to exec'd ranks: the config file's sha256, preflight's verdicts

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Train with DeepSpeed ZeRO 0-3, FSDP2 or DDP from one YAML config.",
    **HELP,
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
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Start fresh in an output_dir that holds an earlier run's checkpoints or model "
        "(they are deleted; refused without this or --resume).")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="Show every third-party warning and log line (shardwise.quiet lists what is "
        "otherwise silenced, and why).")] = False,
) -> None:
    """Train a causal LM on SFT data; the strategy changes memory and speed, never the result.

    Exit codes: 0 completed, 2 bad input (nothing ran), 3 NaN/Inf beyond the patience or on
    the last step (nothing exported), 4 a rank hung, 74 a save, the export or a log ran out of
    disk space (the previous checkpoint is intact), 75 interrupted by SIGTERM/SIGUSR1/SIGINT/SIGHUP
    after saving a checkpoint (`--resume latest` continues), or before any rank started (nothing
    ran, nothing written), 1 anything else; a rank killed by a signal: 128 + signal.
    docs/training.md lists what each leaves in the output dir.

    Progress: a bar on a terminal, timestamped lines when stdout is not one (logging.progress).
    """
    from shardwise import quiet

    quiet.apply(verbose or None)  # spawned ranks inherit --verbose through the environment
    from shardwise.train.launch.rank import detect_env
    from shardwise.train.launch.signals import StoppedBeforeStart, stop_before_start
    from shardwise.train.launch.spawn import spawn_job

    overrides = list(set_ or []) + ([f"checkpointing.resume={resume}"] if resume else [])
    overrides += ["checkpointing.overwrite=true"] if overwrite else []
    launched = detect_env()
    by_us = os.environ.get("SHARDWISE_LAUNCHED") == "1"  # a rank of our own spawn: checks are done
    lock = None
    try:
        # shardwise's own launcher (or the in-process rank): a stop while it checks ends it at once, exit 75
        with stop_before_start() if launched is None else contextlib.nullcontext():
            cfg, world, device, run, check, resume_dir, lock, fork = _checked(config, overrides, launched, by_us,
                                                                              nproc, force)
    except StoppedBeforeStart as e:
        print(f"shardwise: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    except ShardwiseError as e:
        _fail(e)
        return
    owner = lock is not None
    try:
        from shardwise.train.launch.signals import hold_at_start
        from shardwise.train.observe.metrics import run_ended, run_started

        out = cfg.checkpointing.output_dir
        if launched is None and world > 1:
            argv = ["-m", "shardwise.train.cli", str(config), *[a for o in set_ or [] for a in ("--set", o)]]
            argv += ["--force"] if force else []
            argv += ["--resume", str(resume_dir)] if resume_dir else []
            extra = {"SHARDWISE_LAUNCHED": "1"} | ({"DS_ACCELERATOR": "cpu"} if device == "cpu" else {})
            extra[HANDOFF_ENV] = json.dumps({"config_sha256": _sha256(config), "memory": dataclasses.asdict(check),
                                             "recompute": dataclasses.asdict(run.recompute) if run.recompute else None})
            # CPU ranks share the cores: one intra-op pool per rank that does not oversubscribe.
            threads = max(1, (os.cpu_count() or 1) // world) if device == "cpu" else None
            target = None
            if fork is not None:  # forked ranks (shardwise.train.launch.fork): they get their thread counts back
                from shardwise.train.launch import fork as rank_fork

                extra |= {name: value for name, value in fork.items() if name != "OMP_NUM_THREADS"}
                os.environ["DS_ACCELERATOR"] = extra["DS_ACCELERATOR"]  # CPU ranks; read as deepspeed loads
                try:
                    _preload(run)
                except ImportError:  # exec'd, each rank reports it as it always has: with its traceback
                    pass
                else:
                    if rank_fork.forkable():
                        target = functools.partial(_worker, run, check.planned_bytes, resume_dir)
            # summary.json says `running` once the launcher's handlers are in place; when rank 0
            # could not write the final one (hung, killed, failed before it trained), `failed`.
            marker: dict = {}
            job = spawn_job(argv, world, extra_env=extra, threads_per_rank=threads, run_dir=_run_dir(cfg),
                            hold_signals=True, on_start=lambda: marker.update(run_started(out, config, world)),
                            fork_target=target)
            run_ended(out, marker, job.reason or f"the job exited with code {job.rc}; rank 0 wrote no summary",
                      exit_code=job.rc, failed_rank=job.failed_rank, signal=job.signal, heartbeats=job.heartbeats,
                      collateral=job.collateral)  # fmt: skip
            raise typer.Exit(job.rc)
        hold_at_start()  # this process trains: a stop from now on is kept for the first step boundary
        marker = run_started(out, config, world) if owner else {}
        try:
            rc = _worker(run, check.planned_bytes, resume_dir)
        except BaseException as e:
            run_ended(out, marker, f"rank 0: {type(e).__name__}: {e}", exit_code=1)
            raise
        run_ended(out, marker, f"rank 0 exited with code {rc} without writing its summary", exit_code=rc)
        raise typer.Exit(rc)
    finally:
        if lock is not None:
            lock.release()


def _checked(config: Path, overrides: list[str], launched: dict | None, by_us: bool, nproc: int | None,
             force: bool):
    """Everything checked before any rank starts: (cfg, world size, device, run, preflight's
    check, the resolved checkpoint to resume, the output dir's lock when this process owns it
    (shardwise's launcher, the in-process rank, torchrun's rank 0), else None, and, where this
    launcher will fork its ranks, the thread variables' values to give them back, else None)."""
    from shardwise.config.load import load_config
    from shardwise.train.checkpoint.resume_checks import resolve_checkpoint
    from shardwise.train.launch.fork import launch_device
    from shardwise.train.preflight import preflight

    cfg = load_config(config, overrides)
    world = int(launched["world_size"]) if launched else (nproc if nproc is not None else cfg.run.nproc)
    # before the checks load torch (the tokenizer, the data): a launcher that forks never starts an OpenMP pool
    device, fork = launch_device(cfg, world) if launched is None else (cfg.resolved_device(), None)
    rank = int(launched["rank"]) if launched else 0
    owner = rank == 0 and not by_us  # takes the output dir's lock, cleans, verifies hashes
    if owner:  # in a second, before the data cache is built
        _check_fresh(cfg)
        note = cfg.logging.deprecation(cfg.source)
        if note:
            print(f"shardwise: {note}", file=sys.stderr, flush=True)
    handoff = _handoff(config) if by_us else None
    if handoff is None:
        run, check = preflight(cfg, world, device, force=force)
    else:  # a rank exec'd by shardwise's launcher, which ran preflight on this file
        from shardwise.plan.recompute import RecomputeChoice
        from shardwise.run.bridge import run_spec
        from shardwise.train.preflight import MemoryCheck

        decided = handoff["recompute"]  # `checkpointing: auto` as the launcher decided it
        run = run_spec(cfg, world, device, recompute=RecomputeChoice(**decided) if decided else None)
        check = MemoryCheck(**handoff["memory"])
    resume_dir = resolve_checkpoint(cfg, run, verify_hashes=owner)
    lock = _own_output_dir(cfg, resume_dir) if owner else None
    return cfg, world, device, run, check, resume_dir, lock, fork


def _sha256(config: Path) -> str:
    return hashlib.sha256(Path(config).read_bytes()).hexdigest()


def _handoff(config: Path) -> dict | None:
    """What shardwise's launcher checked, for a rank it exec'd (HANDOFF_ENV; None without it).
    The config file must be the one it checked."""
    given = os.environ.get(HANDOFF_ENV)
    if given is None:
        return None
    handoff = json.loads(given)
    if handoff["config_sha256"] != _sha256(config):
        raise ShardwiseError(f"{config}: changed since `shardwise train` checked it and started the ranks; "
                             "start the run again")
    return handoff


def _run_dir(cfg) -> Path:
    """Where ranks keep their heartbeats (shardwise.train.launch.watchdog) for the launcher to read."""
    return Path(cfg.checkpointing.output_dir) / ".shardwise"


def _check_fresh(cfg) -> None:
    from shardwise.train.outputs import check_fresh_output

    cp = cfg.checkpointing
    logs = ("metrics.jsonl", "summary.json", *(("tensorboard",) if "tensorboard" in cfg.logging.trackers else ()))
    check_fresh_output(cp.output_dir, resume=cp.resume, overwrite=cp.overwrite, logs=logs,
                       where=f"{cfg.source}: checkpointing.output_dir")  # fmt: skip


def _own_output_dir(cfg, resume_dir: Path | None):
    """Lock the output dir for this run, clear what killed runs left behind (and, for a fresh
    run, the earlier run's logs, or with --overwrite all its outputs), and record this run's
    lineage (shardwise.train.checkpoint.lineage) for its ranks: all before any rank starts."""
    from shardwise.train.checkpoint.lineage import RUN_ID_ENV, start_lineage, write_lineage
    from shardwise.train.outputs import OutputLock, clean_stale_outputs, clear_earlier_run

    cp = cfg.checkpointing
    lock = OutputLock(cp.output_dir).acquire()
    try:
        if resume_dir is None:
            _check_fresh(cfg)  # again, under the lock
            gone, left = clear_earlier_run(cp.output_dir, overwrite=cp.overwrite)
            if gone:
                print(f"shardwise: a fresh run: removed the earlier run's {', '.join(gone)}")
            if left:
                print(f"shardwise: left {', '.join(left)} as it is: shardwise did not write it (this run does not "
                      "write there)")
        stale = clean_stale_outputs(cp.output_dir)
        if stale:
            print(f"shardwise: removed unfinished files of an earlier run: {', '.join(stale)}")
        lineage = start_lineage(cp.output_dir, resume_dir)
        write_lineage(cp.output_dir, lineage)
        os.environ[RUN_ID_ENV] = lineage.run_id  # the in-process rank, and every rank spawned from here
    except BaseException:
        lock.release()
        raise
    return lock


def _preload(run) -> None:
    """Import what every rank of `run` imports (`_worker`'s imports, the engine's libraries, the
    model's transformers code), once, in a launcher that forks its ranks; a module left out costs
    each rank its import, nothing more."""
    import importlib

    import torch
    import torch.distributed  # noqa: F401

    import shardwise.train.export.hf_dir
    import shardwise.train.launch.watchdog
    import shardwise.train.loop
    import shardwise.train.observe.metrics
    from shardwise.train.engines import engine_class
    from shardwise.train.model.hf import causal_lm_class, run_model_type

    for name in getattr(engine_class(run), "libraries", ()):  # what the engine imports as it starts
        importlib.import_module(name)
    causal_lm_class(run_model_type(run))
    if run.config.lora is not None:
        import peft  # noqa: F401

        import shardwise.train.model.lora  # noqa: F401


def _worker(run, planned_bytes: float | None, resume_dir: Path | None) -> int:
    """One rank: train, export, write the summary with the run's status; return the exit code."""
    import traceback

    import torch

    from shardwise.errors import ExitCode, NonFiniteError, OutOfSpaceError
    from shardwise.plan.flops import run_flops_per_token
    from shardwise.train.launch.rank import detect_env, init_distributed
    from shardwise.train.launch.signals import StopRequest
    from shardwise.train.launch.watchdog import Watchdog
    from shardwise.train.loop import Interrupted, train
    from shardwise.train.observe.metrics import Metrics

    cfg, device = run.config, run.device
    if device == "cpu" and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    found = detect_env() or {"rank": 0, "world_size": 1}
    from shardwise.console import library_bars, resolve_mode

    # transformers' own bars ("Loading weights", downloads): rank 0's on a terminal only
    library_bars(int(found["rank"]) == 0 and resolve_mode(cfg.logging.progress) == "bar")
    from shardwise.train.model.hf import causal_lm_class, run_model_type

    # transformers' modeling code for this model (seconds of imports) before the watchdog starts:
    # run.timeout_s bounds a rank that stalls, not a rank's start-up
    causal_lm_class(run_model_type(run))
    from shardwise.train.launch.signals import hold_at_start, share

    hold_at_start()  # (a forked rank's stop signals are blocked from the fork until here)
    share(_run_dir(cfg), int(found["rank"]), int(found["world_size"]))  # a stop signal's name reaches rank 0
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
    host = None
    if device == "cpu":  # the rank's host RSS is measured against the plan of it
        from shardwise.train.host_memory import planned_cpu

        host = planned_cpu(run).peak
    metrics = Metrics(cfg, planned_bytes, run_flops_per_token(run.model, run.train), peak, run=run,
                      planned_host_bytes=host)
    status, reason, code = "failed", None, ExitCode.FAILED
    # the engine that ran: FSDP2 with a one-rank shard group may run as DDP (FSDPKnobs.single_rank)
    extra: dict = {"strategy": run.strategy.name, "engine": run.engine_strategy.engine}
    if run.grad_sync is not None:  # FSDP2 under accumulation: held grads or a reduce-scatter per micro-batch
        extra["grad_sync"] = run.grad_sync.as_dict()
    # what ran: checkpointing.activation, or what `auto` was decided to be and why
    extra |= {"checkpointing": run.train.checkpointing,
              "checkpointing_choice": run.recompute.as_dict() if run.recompute else None}
    try:
        with StopRequest() as stop, watchdog:
            result = train(run, env, metrics=metrics, final_export=cfg.checkpointing.save_final,
                           resume=resume_dir, stop=stop, watchdog=watchdog, lineage=_lineage(cfg, env))  # fmt: skip
            extra["checkpoint"] = str(result.checkpoint) if result.checkpoint else None
            if env.is_main and result.final is not None:  # streamed from disk, one shard at a time
                from shardwise.train.export.hf_dir import export_dir, export_final

                watchdog.phase("export write", cfg.run.steps)
                try:
                    # each read group and shard counts as progress: a long export is not a hang
                    extra["export"] = str(export_final(cfg, result.final.path, export_dir(cfg), progress=lambda: (
                        watchdog.phase("export write", cfg.run.steps))))
                finally:
                    result.final.discard()
        status, code = "completed", ExitCode.OK
    except Interrupted as e:
        status, reason, code = "interrupted", str(e), ExitCode.INTERRUPTED
        extra["checkpoint"] = str(e.checkpoint) if e.checkpoint else None
        print(f"shardwise: rank {env.rank}: {e}", flush=True)
    except NonFiniteError as e:
        reason, code = str(e), ExitCode.NONFINITE
        print(f"shardwise: rank {env.rank}: {e}", file=sys.stderr, flush=True)
    except OutOfSpaceError as e:
        reason, code = str(e), ExitCode.NO_SPACE
        extra["space"] = {"path": e.path, "need_bytes": e.need_bytes, "free_bytes": e.free_bytes}
        print(f"shardwise: rank {env.rank}: {e}", file=sys.stderr, flush=True)
    except Exception as e:  # reported with its traceback; the summary names it
        reason = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        if cfg.checkpointing.offload:  # what this rank moved to host memory (shardwise.train.model.activation_offload)
            from shardwise.train.model.activation_offload import process_totals

            extra["activation_offload"] = process_totals()
        metrics.close(status, reason, **extra)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return int(code)


def _lineage(cfg, env):
    """The lineage the launcher recorded for this run (rank 0 writes the manifests); None lets
    the loop start one (a rank whose launcher is not shardwise's: torchrun, srun)."""
    from shardwise.train.checkpoint.lineage import RUN_ID_ENV, read_lineage

    if not env.is_main:
        return None
    lineage = read_lineage(cfg.checkpointing.output_dir)
    return lineage if lineage is not None and lineage.run_id == os.environ.get(RUN_ID_ENV) else None


def main() -> None:
    from shardwise.train.launch.rank import run_cli

    run_cli(app)


if __name__ == "__main__":
    main()
