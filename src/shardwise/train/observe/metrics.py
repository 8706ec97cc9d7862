"""Observability: the progress bar or lines (shardwise.console), JSONL (always), the experiment
trackers of `logging.trackers` (TensorBoard, W&B, MLflow: shardwise.train.observe.trackers, fed every
JSONL row), and the end summary comparing measured peak memory and throughput with the plan.
Rank 0 writes; other ranks hold a no-op instance so the loop never branches on the rank.

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
from typing import TYPE_CHECKING, Any

from shardwise import strict_json
from shardwise.config.schema import TrainConfig
from shardwise.numfmt import rate
from shardwise.specs.hardware import GIB
from shardwise.train.outputs import TMP_PREFIX, TMP_SUFFIX, record_own
from shardwise.versions import run_versions

if TYPE_CHECKING:  # torch is imported where a rank measures: the launcher writes summaries without it
    from shardwise.train.engines.base import DistEnv

SUMMARY_NAME = "summary.json"
RUNNING = "running"


def write_summary(output_dir: str | Path, summary: dict[str, Any]) -> Path | None:
    """Replace `<output_dir>/summary.json` with `summary` (strict JSON: shardwise.strict_json) in
    one rename: a reader (or a kill) never sees half a file. The temp file carries shardwise's
    temp name (start-up clean-up removes one a kill left behind); the written file is recorded as
    shardwise's (shardwise.train.outputs.record_own). A disk too full for it gives up the space
    `run_started` reserved for this (`RESERVE_NAME`) and tries once more. A write that still fails
    leaves the earlier file, removes its temp file and says so on stderr: it never turns the run's
    own exit code into a traceback's. None then."""
    import errno
    import sys

    d = Path(output_dir)
    tmp = d / f"{TMP_PREFIX}{SUMMARY_NAME}-{os.getpid()}{TMP_SUFFIX}"
    text = strict_json.dumps(summary, indent=2) + "\n"
    for attempt in (1, 2):
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, d / SUMMARY_NAME)
            break
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if attempt == 1 and e.errno in (errno.ENOSPC, errno.EDQUOT) and _release_reserve(d):
                continue
            print(f"shardwise: could not write {d / SUMMARY_NAME} (status {summary.get('status')!r}): "
                  f"{e.strerror or e}", file=sys.stderr, flush=True)
            return None
    record_own(d, SUMMARY_NAME)
    return d / SUMMARY_NAME


# Space kept for the final summary.json (and its record) on a disk that fills up during the run:
# written when the run starts, given up only when that write finds the disk full.
RESERVE_NAME = Path(".shardwise") / "summary-reserve"
RESERVE_BYTES = 256 << 10


def reserve_space(output_dir: str | Path) -> None:
    """Write the reserve (`RESERVE_NAME`, zeros: real blocks, not a sparse file); a disk too full
    for it already goes without."""
    path = Path(output_dir) / RESERVE_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        path.unlink(missing_ok=True)


def _release_reserve(d: Path) -> bool:
    try:
        (d / RESERVE_NAME).unlink()
        return True
    except OSError:
        return False


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
    reserve_space(output_dir)
    write_summary(output_dir, {"status": RUNNING, "reason": None, "run": run})
    return run


def run_ended(output_dir: str | Path, run: dict[str, Any] | None, reason: str, **extra: Any) -> bool:
    """After the ranks exited: when summary.json is still this run's `running` marker (rank 0
    never wrote its own: it hung, was killed, or failed before it trained), replace it with
    `failed`, `reason` and `extra` (None values dropped). A summary rank 0 wrote in this run is
    the truth about its own outcome and stays, except when the job failed because another rank
    did (`extra["failed_rank"]` not 0) while rank 0's says `failed`: rank 0's error is then the
    consequence (a broken collective), so the summary names the rank that failed first, with
    `reason`, `failed_rank` and `signal`, and keeps rank 0's reason under `collateral`. An empty
    `run` (this process wrote no marker) changes nothing. True when it wrote."""
    if not run:
        return False
    current = read_summary(output_dir)
    if current is None or current.get("run") != run:
        return False
    extra = {k: v for k, v in extra.items() if v is not None and v != []}
    if current.get("status") == RUNNING:
        return write_summary(output_dir, {"status": "failed", "reason": reason, "run": run, **extra}) is not None
    failed_rank = extra.get("failed_rank")
    if current.get("status") != "failed" or failed_rank in (None, 0):
        return False
    collateral = [f"rank 0: {current.get('reason')}", *extra.pop("collateral", [])]
    return write_summary(output_dir, {**current, "status": "failed", "reason": reason, **extra,
                                      "collateral": collateral}) is not None


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
        planned_host_bytes: float | None = None,
    ):
        """`run`: the RunSpec, whose plan the trackers attach (none without it).
        `planned_bytes`: the GPU plan's peak per GPU; `planned_host_bytes`: on a CPU run, the
        planned peak RSS of one rank (shardwise.plan.host_cpu), which the host peak RSS is
        measured against."""
        self.cfg, self.planned_bytes, self.run = cfg, planned_bytes, run
        self.planned_host_bytes = planned_host_bytes
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.records: list[Any] = []
        self.summary: dict[str, Any] = {}
        self.progress: Any = None  # shardwise.console.TrainProgress, on rank 0 once started
        self._on = False

    def start(self, cfg: TrainConfig, env: DistEnv, num_params: int, start_step: int = 0,
              build_s: float | None = None) -> None:
        """Open the logs; a run resumed at `start_step` keeps the earlier run's lines up to that
        step and drops any it logged after its last checkpoint (they are trained again).
        `build_s`: how long the model and engine took to build (and load), for the start line."""
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
        record_own(self.dir, path.name)
        self._write("".join(line + "\n" for line in kept))
        from shardwise.console import TrainProgress, resolve_mode
        from shardwise.train.observe.trackers import Trackers

        self.trackers = Trackers()

        self.progress = TrainProgress(resolve_mode(cfg.logging.progress), cfg.run.steps, start_step)
        self.t0 = time.perf_counter()
        if self.progress.mode != "off":
            m, st = cfg.model, cfg.strategy
            layout = (f" tp {st.tp}" if st.tp > 1 else "") + (
                f" pp {st.pp} ({st.pp_schedule}" + (f", {st.pp_virtual_stages} stages per rank" if st.pp_virtual_stages > 1
                                                    else "") + ")" if st.pp > 1 else "")
            self.progress.note(
                f"train {cfg.name} | {m.path or m.name} ({num_params:,} parameters) | {st.name}{layout} on "
                f"{env.world_size} rank(s), {env.device} | steps {start_step + 1}-{cfg.run.steps}"
                + (f" (resumed after {start_step})" if start_step else "")
                + (f" | model and engine ready in {build_s:.1f} s" if build_s is not None else "")
                + f" | output {self.dir}")
        self.trackers.start(cfg, self.run)  # last: a tracker that cannot start fails a run that can close

    def _write(self, text: str) -> None:
        """Append to metrics.jsonl; a full disk is the run's OutOfSpaceError (exit 74), not a traceback."""
        import errno

        try:
            self.jsonl.write(text)
            self.jsonl.flush()
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            from shardwise.errors import OutOfSpaceError
            from shardwise.train.checkpoint.save_failure import free_bytes
            from shardwise.train.outputs import size_text

            path, free = self.dir / "metrics.jsonl", free_bytes(self.dir)
            raise OutOfSpaceError(f"{path}: the disk is full ({size_text(free)} free; a log line needs "
                                  f"{len(text.encode())} bytes); the previous checkpoints are intact. Free space and "
                                  "--resume latest.", path=str(path), need_bytes=len(text.encode()),
                                  free_bytes=free) from None

    def memory_bytes(self) -> tuple[float, str]:
        if self.env.device == "cuda":
            import torch

            return float(torch.cuda.max_memory_allocated()), "GPU max allocated"
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "host peak RSS"

    def _row(self, rec: Any) -> dict[str, Any]:
        tps = rec.tokens / rec.step_time_s
        row = asdict(rec) | {"tokens_per_s": tps, "memory_bytes": self.memory_bytes()[0]}
        if self.flops_per_token:
            row["tflops"] = tps * self.flops_per_token / 1e12
            if self.peak_flops:
                row["mfu"] = tps * self.flops_per_token / (self.peak_flops * self.env.world_size)
        return row

    def log_step(self, rec: Any) -> None:
        self.records.append(rec)
        if not self._on:
            return
        row = self._row(rec)
        self._write(strict_json.dumps(row) + "\n")
        self.trackers.log(row)

    def show(self, rec: Any) -> None:
        """The progress bar or line for `rec`, the newest step of a logging flush
        (shardwise.train.observe.step_log: every `logging.every` steps or `logging.every_seconds`)."""
        if not self._on:
            return
        from shardwise.console import StepLine

        row, last = self._row(rec), getattr(self, "evals", [None])[-1]
        self.progress.update(StepLine(
            step=rec.step, total=self.cfg.run.steps, loss=rec.loss, lr=rec.lr, grad_norm=rec.grad_norm,
            tokens_per_s=row["tokens_per_s"], memory_bytes=row["memory_bytes"], memory_kind=self.memory_bytes()[1],
            mfu=row.get("mfu"), eval_loss=last.eval_loss if last else None, eval_step=last.step if last else None,
            elapsed_s=time.perf_counter() - self.t0, eta_s=self.progress.eta(rec.step, rec.step_time_s)))

    def log_checkpoint(self, step: int, path: Any, seconds: float) -> None:
        """A line (or a note above the bar) for a published checkpoint."""
        if self._on and self.progress.mode != "off":
            self.progress.note(f"checkpoint step {step} | {path} | {seconds:.1f} s")

    def log_eval(self, rec: Any) -> None:
        """An evaluation (shardwise.train.loop.EvalRecord): a `"kind": "eval"` line in
        metrics.jsonl, `eval/loss`, `eval/ppl`, ... in the trackers, the progress line, and the best
        and last eval loss for summary.json. Every rank keeps the numbers (they are all-reduced)."""
        self.evals = [*getattr(self, "evals", []), rec]
        if not self._on:
            return
        row = {"kind": "eval", **asdict(rec)}
        self._write(strict_json.dumps(row) + "\n")
        self.trackers.log(row)
        # its own line (above the bar); the progress updates after it carry the latest eval loss
        self.progress.note(f"eval step {rec.step}/{self.cfg.run.steps} | loss {rec.eval_loss:.4f} | ppl "
                           f"{rec.eval_ppl:.3f} | {rec.eval_tokens:,} target tokens | {rec.eval_time_s:.1f} s")

    def close(self, status: str = "completed", reason: str | None = None, **extra: Any) -> dict[str, Any]:
        """Write `summary.json` (atomically) with the run's final `status`: completed,
        interrupted (a checkpoint to resume from) or failed (with the reason)."""
        if not getattr(self, "_on", False):
            return {}
        self._on = False
        mode = None
        if self.progress is not None:
            self.progress.close()
            mode = None if self.progress.mode == "off" else self.progress.mode
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
            "planned_host_bytes": self.planned_host_bytes,
            "wall_s": time.perf_counter() - self.t0,
            "params": self.num_params,
            # what ran it (the checkpoint manifest records the same; `shardwise version --full`)
            "versions": run_versions(),
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
        try:
            self.jsonl.close()
        except OSError:  # a line a full disk refused is still buffered: it was reported (OutOfSpaceError)
            pass
        self.trackers.close(status, self.summary)
        print_summary(self.summary, mode)
        return self.summary


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """summary.json as the end-of-run block's rows (shardwise.console.summary_block)."""
    gib = GIB
    rows = [("status", s["status"] + (f" ({s['reason']})" if s.get("reason") else "")),
            ("steps", str(s["steps"]) + (f" (resumed after step {s['start_step']})" if s.get("start_step") else ""))]
    if not s["steps"]:
        return rows
    rows.append(("loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"))
    if s.get("final_eval_loss") is not None:
        rows.append(("eval loss", f"{s['final_eval_loss']:.4f} final, {s['best_eval_loss']:.4f} best "
                     f"(step {s['best_eval_step']})"))
    rows.append(("step time (median)", f"{s['median_step_s'] * 1e3:.1f} ms"))
    rows.append(("throughput", f"{rate(s['tokens_per_s'])} tokens/s"
                 + (f" ({s['tflops']:.3f} TFLOP/s)" if "tflops" in s else "")))
    measured = f"{s['measured_memory_bytes'] / gib:.2f} GiB measured ({s['measured_memory_kind']})"
    on_gpu = s["measured_memory_kind"].startswith("GPU")
    planned = s.get("planned_gpu_bytes") if on_gpu else s.get("planned_host_bytes")
    if not planned:
        memory = f"{measured}; no plan"
    else:
        off = s["measured_memory_bytes"] / planned - 1
        memory = (f"{measured} vs {planned / gib:.2f} GiB planned per {'GPU' if on_gpu else 'rank (host RSS)'} "
                  f"({off:+.0%})")
    rows.append(("peak memory", memory))
    rows += [(k, str(s[k])) for k in ("checkpoint", "export") if s.get(k)]
    if s.get("wall_s") is not None:
        from shardwise.console import duration

        rows.append(("wall time", duration(s["wall_s"])))
    return rows


def print_summary(s: dict[str, Any], mode: Any = None) -> None:
    """The end-of-run block: a table on a terminal, `key: value` lines in a log (`mode`: the
    progress mode; None: by stdout)."""
    from shardwise.console import summary_block

    summary_block("shardwise train: summary", summary_rows(s), mode)
