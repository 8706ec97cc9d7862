"""The one training loop. It never asks which engine it drives.

Per optimizer step:
1. the step's GLOBAL target-token count (all micro-batches, all ranks) is known before any
   forward pass: it was all-reduced, asynchronously, during the previous step;
2. for each micro-batch: `sync_grads(last)` + `forward_backward(batch, world / global_count)`;
   the loss sums stay on the device;
3. take the next step's micro-batches (already read, collated and counted by the prefetch
   thread, shardwise.train.data.Prefetcher) and start one host-side all-reduce of [their counts,
   a stop vote, a timed-save vote, a timed-log vote]; then `step()` (clip + update, returns the
   global grad norm, left on the device) and `zero_grad()` overlap it;
4. at a logging step (`logging.every` steps or `logging.every_seconds`), and before anything that needs the numbers (a save, an
   evaluation, a stop, the end), the pending records are completed at once
   (shardwise.train.step_log): the logged loss of a step is its all-reduced loss sum over its
   global count, the exact mean over the step's targets, equal to what one process computes on
   the whole global batch. In between, a step waits on the device at most once: the engine's
   non-finite skip decision, and not at all where the optimizer skips on the device (fused AdamW).

Evaluation (`run.eval_every_steps`): at every N-th step boundary and after the last step, each
rank runs `engine.evaluate` over its fixed slice of the validation split (the same rows on every
world size, shardwise.train.data.eval_layout); the eval loss is the all-reduced loss sum over
the all-reduced target count: the exact mean over the split's targets.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardwise.data.labels import count_target_tokens
from shardwise.errors import NonFiniteError  # noqa: F401 - re-exported for the CLI
from shardwise.run import RunSpec
from shardwise.train.data import Prefetcher
from shardwise.train.engines import build_engine
from shardwise.train.engines.base import DistEnv
from shardwise.train.host_alloc import large_allocations_returned
from shardwise.train.model import build_model
from shardwise.train.schedule import build_schedule
from shardwise.train.step_log import Guard, StepLog, StepRecord

if TYPE_CHECKING:
    from shardwise.train.final_weights import FinalWeights


@dataclass
class EvalRecord:
    step: int  # optimizer steps done when the validation split was evaluated
    eval_loss: float  # mean token loss over the split's (or run.eval_batches') target tokens, all ranks
    eval_ppl: float  # exp(eval_loss)
    eval_tokens: int  # the target tokens it averages over (global)
    eval_time_s: float = 0.0


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 709 else float("inf")  # exp overflows past ~709.78


@dataclass
class TrainResult:
    records: list[StepRecord] = field(default_factory=list)
    final_weights: dict[str, torch.Tensor] | None = None  # rank 0, when asked
    final: FinalWeights | None = None  # `final_export`: where the export reads the final weights
    num_params: int = 0
    status: str = "completed"  # or "interrupted" (a checkpoint was saved: resume continues)
    start_step: int = 0  # > 0 when resumed
    checkpoint: Path | None = None  # the last checkpoint this run published
    evals: list[EvalRecord] = field(default_factory=list)
    best_step: int | None = None  # checkpointing.save_best: the step of the best eval loss's checkpoint

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


class Interrupted(Exception):
    """A stop was requested (signal); the run saved `checkpoint` (None if saving is off). The
    message names the signal received, on whichever rank it was (signals.describe)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, note: str = ""):
        from shardwise.train.signals import describe

        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpointing.save_on_interrupt off)"
        super().__init__(f"stopped by {describe(signum)} after step {step}: {where}{note}")


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


class _MetaReduce:
    """Sums of a few host-side numbers over ranks, asynchronously, on a dedicated gloo group.

    Target counts and votes live on the CPU: a gloo group sums them without a device sync (on
    CUDA an NCCL reduce of a host value would need a copy and a stream sync) and without
    queueing behind the engine's gradient collectives. Started before `engine.step()`, the
    reduce overlaps the optimizer step. A flush of the step records sums their loss sums here
    too, once they are on the host.
    """

    def __init__(self) -> None:
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if multi else None

    def start(self, values: list[float]) -> tuple[torch.Tensor, Any]:
        t = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(t, group=self.group, async_op=True) if self.group is not None else None
        return t, work

    @staticmethod
    def wait(pending: tuple[torch.Tensor, Any]) -> list[float]:
        t, work = pending
        if work is not None:
            work.wait()
        return t.tolist()

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)


@large_allocations_returned()  # a context manager as a decorator: entered per call
def train(
    run: RunSpec,
    env: DistEnv,
    *,
    steps: Iterator[list[dict[str, torch.Tensor]]] | None = None,
    metrics: Any = None,
    export_weights: bool = False,
    final_export: bool = False,
    resume: Path | None = None,
    stop: Any = None,
    watchdog: Any = None,
    lineage: Any = None,
) -> TrainResult:
    """Run `run.config.run.steps` optimizer steps on an initialised process group.

    `steps` overrides the configured data (tests feed exact batches); `metrics` receives
    every StepRecord (rank 0 writes it). With `export_weights`, rank 0 gets the final
    consolidated weights in memory (a collective: every rank must ask); with `final_export`, every
    rank gets `result.final`, a DCP directory holding them (the last step's checkpoint, or staged:
    shardwise.train.final_weights) for rank 0's streamed export. `resume`: a verified checkpoint
    directory to continue from. `stop`: a StopRequest (shardwise.train.signals) whose request
    on any rank ends the run at the next step boundary with a checkpoint (raises Interrupted).
    `watchdog` is told each phase (shardwise.train.watchdog). `lineage`: the run's
    (shardwise.train.lineage); by default rank 0 starts one from `resume` and records it in the
    output dir, so pruning and `--resume latest` never cross runs. The caller closes `metrics`
    (with the run's final status, after any export).

    Host memory: the run holds glibc's mmap threshold at 1 MiB (shardwise.train.host_alloc),
    so tensors freed and gathered again per layer or step return to the system and never leave
    holes in the heap.
    """
    from shardwise.train import checkpoint as ckpt

    cfg = run.config
    cp = cfg.checkpointing
    seed_everything(cfg.run.seed)
    t_build = time.perf_counter()
    if env.is_main and cfg.model.path and not cfg.model.random_init:
        from shardwise.console import resolve_mode, say

        if resolve_mode(cfg.logging.progress) != "off":  # one line for the load, not a bar per tensor
            say(f"model: reading {cfg.model.path} ({run.strategy.name} on {env.world_size} rank(s))")
    model = build_model(run, deferred=True)  # a checkpoint is read by the engine, into each rank's part
    num_params = sum(p.numel() for p in model.parameters())
    engine = build_engine(model, run, env)
    build_s = time.perf_counter() - t_build
    # Data parallelism is over the TP groups: a group's ranks read one batch, and only one of
    # them adds its counts and loss sums to the global ones (`w`), so each batch counts once.
    denv = env.data_parallel(run.layout.tp)
    w = 1.0 if env.counts_data(run.layout.tp) else 0.0
    global_batch = cfg.run.micro_batch * cfg.run.grad_accum * denv.world_size
    phase = watchdog.phase if watchdog is not None else (lambda name, step: None)
    start, train_time = 0, 0.0
    if lineage is None and env.is_main:  # only rank 0 writes manifests and prunes
        from shardwise.train.lineage import start_lineage, write_lineage

        lineage = start_lineage(cp.output_dir, resume)
        write_lineage(cp.output_dir, lineage)
    streak = 0  # skipped non-finite steps the resumed checkpoint ended on
    if resume is not None:
        phase("checkpoint load", 0)
        state = ckpt.load_checkpoint(engine, resume)
        start, train_time, streak = state.step, state.train_time_s, state.nonfinite_streak
        if start > cfg.run.steps:
            raise ValueError(f"{resume} is at step {start}, past run.steps={cfg.run.steps}")
    if steps is None:
        from shardwise.train.data import build_source

        steps = build_source(run, denv, model.config.vocab_size, consumed=start * global_batch)
    every = cfg.run.eval_every_steps
    eval_batches: list[dict[str, torch.Tensor]] = []
    if every is not None:
        from shardwise.train.data import build_eval_batches

        eval_batches = build_eval_batches(run, denv)
    eval_targets = sum(count_target_tokens(b) for b in eval_batches)
    best_loss, best_step = math.inf, None
    if cp.save_best and resume is not None and env.is_main:  # rank 0 prunes: it alone needs the best
        record = ckpt.read_best(cp.output_dir, lineage.lineage if lineage is not None else None)
        if record is not None and int(record["step"]) <= start:
            best_loss, best_step = float(record["eval_loss"]), int(record["step"])
    lr_at = build_schedule(cfg.schedule, cfg.optimizer.lr, cfg.run.steps)
    result = TrainResult(num_params=num_params, start_step=start)
    if metrics is not None:
        metrics.start(cfg, env, num_params, start_step=start, build_s=build_s)
    periodic = cp.save_every_steps is not None or cp.save_every_minutes is not None
    guard = Guard(cfg.run.nonfinite_patience, run.train.compute_dtype == "fp16",
                  say=(lambda msg: print(msg, flush=True)) if env.is_main else (lambda msg: None))
    guard.bad = streak
    last_save = time.monotonic()
    # One host-side reduce per step carries the NEXT step's target/token counts (they must be
    # global before its first forward) and two votes: a stop request and "a timed checkpoint is
    # due" (each rank's clock differs; any rank's vote makes every rank save, so they always
    # save together). The loss sums and grad norms wait on the device for the next flush.
    meta = _MetaReduce()

    def log_record(rec: StepRecord) -> None:
        result.records.append(rec)
        if metrics is not None:
            metrics.log_step(rec)

    records = StepLog(cfg.logging.every, guard, lambda sums: meta.wait(meta.start(sums)), log_record,
                      every_seconds=cfg.logging.every_seconds, show=getattr(metrics, "show", None))

    def save(step: int) -> Path:
        nonlocal last_save
        phase("checkpoint save", step)
        t_save = time.perf_counter()
        state = ckpt.TrainerState(step=step, samples_consumed=step * global_batch, global_batch=global_batch,
                                  train_time_s=train_time, nonfinite_streak=guard.bad)  # fmt: skip
        path = ckpt.save_checkpoint(engine, state, cp.output_dir, config=cfg.model_dump(mode="json"),
                                    strategy=run.strategy.name, keep_last=cp.keep_last, lineage=lineage,
                                    protect=best_step if cp.save_best else None)  # fmt: skip
        result.checkpoint, last_save = path, time.monotonic()
        if getattr(metrics, "log_checkpoint", None) is not None:
            metrics.log_checkpoint(step, path, time.perf_counter() - t_save)
        if cp.save_best and best_step == step and env.is_main:
            ckpt.write_best(cp.output_dir, step, best_loss, lineage)
        return path

    def evaluate(step: int) -> EvalRecord:
        """One pass over this rank's validation batches (collective: every rank runs the same
        number of forwards), then one reduce of [loss sum, target count]."""
        nonlocal best_loss, best_step
        phase("evaluate", step)
        t0 = time.perf_counter()
        sums = [engine.evaluate(b) for b in eval_batches]
        local = float(torch.stack(sums).double().sum()) if sums else 0.0
        loss_sum, targets = meta.wait(meta.start([local * w, float(eval_targets) * w]))
        if targets == 0:
            raise RuntimeError(f"step {step}: the validation split has no target tokens")
        loss = loss_sum / targets
        rec = EvalRecord(step=step, eval_loss=loss, eval_ppl=perplexity(loss), eval_tokens=int(targets),
                         eval_time_s=time.perf_counter() - t0)
        result.evals.append(rec)
        if metrics is not None:
            metrics.log_eval(rec)
        if loss < best_loss:  # the same all-reduced value on every rank: the same decision
            best_loss, best_step = loss, step
            result.best_step = step if cp.save_best else None
        return rec

    def eval_due(step: int) -> bool:
        return every is not None and (step % every == 0 or step == cfg.run.steps)

    def save_due(step: int) -> bool:
        return bool(cp.save_every_steps and step % cp.save_every_steps == 0)

    def votes() -> list[float]:
        timed = cp.save_every_minutes is not None and time.monotonic() - last_save >= cp.save_every_minutes * 60
        return [float(stop is not None and stop.requested), float(timed), float(records.time_due())]

    # The next steps' batches are read, collated and counted on a background thread.
    source = Prefetcher(steps, first=start + 1, count=cfg.run.steps - start)
    try:
        nxt = source.next() if start < cfg.run.steps else None
        reduce = meta.start([nxt.targets * w, nxt.tokens * w, 0.0, 0.0, 0.0]) if nxt is not None else None
        for step in range(start, cfg.run.steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            phase("all_reduce(step counts)", step)
            targets, tokens, stop_vote, time_vote, log_vote = meta.wait(reduce)
            if step > start:  # a boundary: `step` optimizer steps are done and applied
                # The records reach the host at a logging step (every N steps, or once any rank's
                # clock says logging.every_seconds passed) and before any decision that needs
                # them; nothing below is due at any other boundary.
                finite = True
                if (stop_vote or time_vote or log_vote or eval_due(step) or save_due(step)
                        or records.due(step)):  # fmt: skip
                    phase("host sync (losses, grad norms)", step)
                    finite = records.flush()
                # a stop request skips a due evaluation: the stop must be prompt
                evaluated = finite and not stop_vote and eval_due(step)
                if evaluated:
                    evaluate(step)
                saved = finite and (save_due(step) or time_vote or (evaluated and cp.save_best))
                if saved:
                    save(step)
                if stop_vote:
                    note = ""
                    if cp.save_on_interrupt and not saved:
                        # A skipped (non-finite) step left the weights and optimizer state as the last
                        # finite step made them: that state is saved (save_checkpoint refuses it if it
                        # is not finite after all), its skipped steps counted for the resumed run.
                        save(step)
                        if not finite and records.last is not None:
                            last = records.last
                            note = (f" (step {step}'s update was skipped: loss {last.loss}, grad norm "
                                    f"{last.grad_norm}; the checkpoint holds the state of the last finite step, "
                                    f"and a resumed run counts its {guard.bad} skipped step(s) against "
                                    f"run.nonfinite_patience={guard.patience})")
                    signum = stop.signum if stop is not None and stop.signum else signal.SIGTERM
                    raise Interrupted(signum, step, result.checkpoint, note)
            global_targets, global_tokens = int(targets), int(tokens)
            if global_targets == 0:
                raise RuntimeError(f"step {step + 1}: the global batch has no target tokens")
            loss_scale = denv.world_size / global_targets  # engines average over data ranks
            engine.set_lr(lr_at(step))
            assert nxt is not None and nxt.step == step + 1, (nxt, step)
            micro = nxt.micro
            phase("forward_backward", step + 1)
            sums = []  # kept on the device until the next flush
            for i, batch in enumerate(micro):
                with engine.sync_grads(i == len(micro) - 1):
                    sums.append(engine.forward_backward(batch, loss_scale))
            loss_sum = torch.stack(sums).double().sum()
            if step + 1 < cfg.run.steps:
                phase("next batches", step + 1)
                nxt = source.next()
            else:
                nxt = None
            reduce = meta.start([*((nxt.targets * w, nxt.tokens * w) if nxt is not None else (0.0, 0.0)), *votes()])
            phase("optimizer step", step + 1)
            grad_norm = engine.step()
            engine.zero_grad()
            rec = StepRecord(
                step=step + 1,
                loss=float("nan"),  # both set at the next flush
                grad_norm=float("nan"),
                lr=lr_at(step),
                target_tokens=global_targets,
                tokens=global_tokens,
                step_time_s=time.perf_counter() - t0,
                cpu_time_s=time.thread_time() - c0,
            )
            records.add(rec, loss_sum * w, grad_norm)
            train_time += rec.step_time_s
        if reduce is not None:
            phase("all_reduce(step counts)", cfg.run.steps)
            meta.wait(reduce)
            phase("host sync (losses, grad norms)", cfg.run.steps)
            finite = records.flush()
            guard.at_end(records.last)
            evaluated = finite and eval_due(cfg.run.steps)
            if evaluated:
                evaluate(cfg.run.steps)
            if (periodic or (evaluated and cp.save_best)) and finite:
                save(cfg.run.steps)
        if export_weights:
            phase("export gather", cfg.run.steps)
            result.final_weights = engine.consolidated_state_dict()  # export refuses non-finite ones
        if final_export:
            from shardwise.train.final_weights import final_weights

            phase("export staging", cfg.run.steps)
            result.final = final_weights(engine, cp.output_dir, cfg.run.steps, result.checkpoint)
    except Interrupted:
        result.status = "interrupted"
        raise
    finally:
        source.close()
        meta.close()
        engine.close()
    return result
