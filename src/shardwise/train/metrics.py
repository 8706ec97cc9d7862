"""Observability: rich progress bar, JSONL (always), the experiment trackers of
`logging.trackers` (TensorBoard, W&B, MLflow: shardwise.train.trackers, fed every JSONL row),
and the end summary comparing measured peak memory and throughput with the plan. Rank 0
writes; other ranks hold a no-op instance so the loop never branches on the rank.

`summary.json` always says where the run is: `running` from the moment it starts (written by
the launcher, `run_started`), then `completed`, `interrupted` or `failed` with the reason
(rank 0's `Metrics.close`; the launcher's `run_ended` when rank 0 could not: it hung, died or
failed before it trained). Every write is atomic (`write_summary`).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from shardwise.specs.hardware import GIB
from shardwise.train.config import TrainConfig
from shardwise.train.engines.base import DistEnv
from shardwise.train.outputs import TMP_PREFIX, TMP_SUFFIX

SUMMARY_NAME = "summary.json"
RUNNING = "running"


def write_summary(output_dir: str | Path, summary: dict[str, Any]) -> Path | None:
    """Replace `<output_dir>/summary.json` with `summary` in one rename: a reader (or a kill)
    never sees half a file. The temp file carries shardwise's temp name (start-up clean-up
    removes one a kill left behind). A write that fails (a full disk) leaves the earlier file,
    removes its temp file and says so on stderr: it never turns the run's own exit code into a
    traceback's. None then."""
    import sys

    d = Path(output_dir)
    tmp = d / f"{TMP_PREFIX}{SUMMARY_NAME}-{os.getpid()}{TMP_SUFFIX}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, d / SUMMARY_NAME)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"shardwise: could not write {d / SUMMARY_NAME} (status {summary.get('status')!r}): "
              f"{e.strerror or e}", file=sys.stderr, flush=True)
        return None
    return d / SUMMARY_NAME


def read_summary(output_dir: str | Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((Path(output_dir) / SUMMARY_NAME).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def run_started(output_dir: str | Path, config: str | Path | None, world_size: int) -> dict[str, Any]:
    """Write the `running` summary of a run that starts now (an earlier run's never survives
    a failed start) and return its `run` block: who started it, when, from which config. The
    final summary carries the same block; `run_ended` uses it to tell this run's marker apart."""
    import datetime

    run = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="milliseconds"),
        "config": str(Path(config).resolve()) if config is not None else None,
        "world_size": int(world_size),
    }
    write_summary(output_dir, {"status": RUNNING, "reason": None, "run": run})
    return run


def run_ended(output_dir: str | Path, run: dict[str, Any] | None, reason: str, **extra: Any) -> bool:
    """After the ranks exited: when summary.json is still this run's `running` marker (rank 0
    never wrote its own: it hung, was killed, or failed before it trained), replace it with
    `failed`, `reason` and `extra` (None values dropped). A summary rank 0 wrote in this run is
    the truth and stays; an empty `run` (this process wrote no marker) changes nothing. True
    when it wrote."""
    if not run:
        return False
    current = read_summary(output_dir)
    if current is None or current.get("status") != RUNNING or current.get("run") != run:
        return False
    extra = {k: v for k, v in extra.items() if v is not None}
    write_summary(output_dir, {"status": "failed", "reason": reason, "run": run, **extra})
    return True


def _this_run(output_dir: Path) -> dict[str, Any] | None:
    """The `run` block of the running marker this process's run wrote (in-process and
    torchrun's rank 0 wrote it themselves, a spawned rank 0's launcher is its parent)."""
    current = read_summary(output_dir)
    if current is None or current.get("status") != RUNNING:
        return None
    run = current.get("run")
    return run if isinstance(run, dict) and run.get("pid") in (os.getpid(), os.getppid()) else None


class Metrics:
    def __init__(
        self,
        cfg: TrainConfig,
        planned_bytes: float | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        run: Any = None,
    ):
        """`run`: the RunSpec, whose plan the trackers attach (none without it)."""
        self.cfg, self.planned_bytes, self.run = cfg, planned_bytes, run
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.records: list[Any] = []
        self.summary: dict[str, Any] = {}
        self._on = False

    def start(self, cfg: TrainConfig, env: DistEnv, num_params: int, start_step: int = 0) -> None:
        """Open the logs; a run resumed at `start_step` keeps the earlier run's lines up to that
        step and drops any it logged after its last checkpoint (they are trained again)."""
        self.env, self.num_params, self.start_step = env, num_params, start_step
        self._on = env.is_main
        if not self._on:
            return
        self.dir = Path(cfg.checkpointing.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        kept = []
        if start_step and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= start_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the crash
        self.jsonl = open(path, "w")
        self.jsonl.writelines(line + "\n" for line in kept)
        self.jsonl.flush()
        self.progress = None
        from shardwise.train.trackers import Trackers

        self.trackers = Trackers()
        if cfg.logging.progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.progress.add_task("train", total=cfg.run.steps, info="")
            self.progress.start()
        self.t0 = time.perf_counter()
        self.trackers.start(cfg, self.run)  # last: a tracker that cannot start fails a run that can close

    def memory_bytes(self) -> tuple[float, str]:
        if self.env.device == "cuda":
            return float(torch.cuda.max_memory_allocated()), "GPU max allocated"
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "host peak RSS"

    def log_step(self, rec: Any) -> None:
        self.records.append(rec)
        if not self._on:
            return
        tps = rec.tokens / rec.step_time_s
        row = asdict(rec) | {"tokens_per_s": tps, "memory_bytes": self.memory_bytes()[0]}
        if self.flops_per_token:
            row["tflops"] = tps * self.flops_per_token / 1e12
            if self.peak_flops:
                row["mfu"] = tps * self.flops_per_token / (self.peak_flops * self.env.world_size)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        self.trackers.log(row)
        if rec.step % self.cfg.logging.every and rec.step != self.cfg.run.steps:
            return
        if self.progress:
            mfu = f" mfu {row['mfu']:.1%}" if "mfu" in row else ""
            info = (
                f"loss {rec.loss:.4f} lr {rec.lr:.2e} gnorm {rec.grad_norm:.3f} {tps:,.0f} tok/s{mfu} "
                f"mem {row['memory_bytes'] / GIB:.2f} GiB{getattr(self, '_eval_info', '')}"
            )
            self.progress.update(self.task, completed=rec.step, info=info)

    def log_eval(self, rec: Any) -> None:
        """An evaluation (shardwise.train.loop.EvalRecord): a `"kind": "eval"` line in
        metrics.jsonl, `eval/loss`, `eval/ppl`, ... in the trackers, the progress line, and the best
        and last eval loss for summary.json. Every rank keeps the numbers (they are all-reduced)."""
        self.evals = [*getattr(self, "evals", []), rec]
        if not self._on:
            return
        row = {"kind": "eval", **asdict(rec)}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        self.trackers.log(row)
        if self.progress:  # kept on the line until the next evaluation
            self._eval_info = f" | eval {rec.eval_loss:.4f} (ppl {rec.eval_ppl:.2f}, step {rec.step})"
            self.progress.update(self.task, info=f"eval loss {rec.eval_loss:.4f} ppl {rec.eval_ppl:.2f} "
                                 f"(step {rec.step}, {rec.eval_tokens:,} targets)")
        else:
            print(f"shardwise: step {rec.step}: eval loss {rec.eval_loss:.4f}, ppl {rec.eval_ppl:.3f} "
                  f"over {rec.eval_tokens:,} target tokens", flush=True)

    def close(self, status: str = "completed", reason: str | None = None, **extra: Any) -> dict[str, Any]:
        """Write `summary.json` (atomically) with the run's final `status`: completed,
        interrupted (a checkpoint to resume from) or failed (with the reason)."""
        if not getattr(self, "_on", False):
            return {}
        self._on = False
        if self.progress:
            self.progress.stop()
        times = [r.step_time_s for r in self.records[1:]] or [r.step_time_s for r in self.records]
        step_s = statistics.median(times) if times else float("nan")
        tokens = self.records[-1].tokens if self.records else 0
        mem, mem_kind = self.memory_bytes()
        self.summary = {
            "status": status,
            "reason": reason,
            "start_step": self.start_step,
            "steps": len(self.records),
            "first_loss": self.records[0].loss if self.records else None,
            "final_loss": self.records[-1].loss if self.records else None,
            "median_step_s": step_s,
            "tokens_per_s": tokens / step_s if step_s else None,
            "measured_memory_bytes": mem,
            "measured_memory_kind": mem_kind,
            "planned_gpu_bytes": self.planned_bytes,
            "wall_s": time.perf_counter() - self.t0,
            "params": self.num_params,
        }
        evals = getattr(self, "evals", [])
        if evals:
            self.summary["best_eval_loss"] = min(e.eval_loss for e in evals)
            self.summary["best_eval_step"] = min(evals, key=lambda e: e.eval_loss).step
            self.summary["final_eval_loss"] = evals[-1].eval_loss
            self.summary["final_eval_step"] = evals[-1].step
        if self.flops_per_token and self.summary["tokens_per_s"]:
            self.summary["tflops"] = self.summary["tokens_per_s"] * self.flops_per_token / 1e12
        run = _this_run(self.dir)
        if run is not None:
            self.summary["run"] = run
        self.summary.update(extra)
        if self.cfg.logging.trackers:  # where each tracker's run is, and any that failed
            self.summary["trackers"] = self.trackers.locations()
            if self.trackers.failed:
                self.summary["trackers_failed"] = dict(self.trackers.failed)
        write_summary(self.dir, self.summary)
        self.jsonl.close()
        self.trackers.close(status, self.summary)
        print_summary(self.summary)
        return self.summary


def print_summary(s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="shardwise train: summary", show_header=False)
    gib = GIB
    t.add_row("status", s["status"] + (f" ({s['reason']})" if s.get("reason") else ""))
    t.add_row("steps", str(s["steps"]) + (f" (resumed after step {s['start_step']})" if s.get("start_step") else ""))
    if not s["steps"]:
        Console().print(t)
        return
    t.add_row("loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    if s.get("final_eval_loss") is not None:
        t.add_row("eval loss", f"{s['final_eval_loss']:.4f} final, {s['best_eval_loss']:.4f} best "
                  f"(step {s['best_eval_step']})")
    t.add_row("step time (median)", f"{s['median_step_s'] * 1e3:.1f} ms")
    t.add_row(
        "throughput",
        f"{s['tokens_per_s']:,.0f} tokens/s" + (f" ({s['tflops']:.3f} TFLOP/s)" if "tflops" in s else ""),
    )
    measured = f"{s['measured_memory_bytes'] / gib:.2f} GiB measured ({s['measured_memory_kind']})"
    if not s["planned_gpu_bytes"]:
        memory = f"{measured}; no plan"
    elif s["measured_memory_kind"].startswith("GPU"):
        memory = f"{measured} vs {s['planned_gpu_bytes'] / gib:.2f} GiB planned per GPU"
    else:  # a CPU run: host RSS holds the interpreter and libraries; the plan is a GPU's memory
        memory = (f"{measured}; the plan ({s['planned_gpu_bytes'] / gib:.2f} GiB per GPU) is for a GPU "
                  "and not comparable")
    t.add_row("peak memory", memory)
    Console().print(t)
