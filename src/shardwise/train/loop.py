"""The one training loop. It never asks which engine it drives.

`train()`: `setup()` once, then `train_step()` and `after_step()` for each optimizer step, then
the final weights and `teardown()`.

`train_step(s, step)`, in order:
1. the step's micro-batches (read, collated and counted ahead by the prefetch thread,
   shardwise.train.data.Prefetcher) and its GLOBAL target count (all micro-batches, all
   ranks), all-reduced while the previous step ran;
2. `forward_backward_step(micro, dp_world / targets)`: each micro-batch's forward and backward
   (`sync_grads(last)` + `forward_backward`, or a pipeline's schedule);
   the loss sums stay on the device;
3. the next step's micro-batches are taken and one host-side all-reduce of [their counts, a stop
   vote, a timed-save vote, a timed-log vote] starts;
4. `step()` (the engine clips, skips the update where the grad norm is not finite, updates; the
   global grad norm stays on the device) and `zero_grad()`, while that all-reduce completes;
5. the step's record, pending until a flush (shardwise.train.observe.step_log).

`after_step(s, step)`, after every step, the last included: wait for that all-reduce, then,
where due and in this order: flush the pending records (loss = all-reduced loss sum / global
targets; the non-finite guard), evaluate, save, stop (raises Interrupted). Why each part is as
it is: docs/training.md, "The loop and the loss".
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardwise.data.labels import count_target_tokens
from shardwise.run import RunSpec
from shardwise.train.data import Prefetcher, PreparedStep
from shardwise.train.engines import build_engine
from shardwise.train.engines.base import DistEnv, Engine
from shardwise.train.launch.host_alloc import large_allocations_returned
from shardwise.train.model.build import build_model
from shardwise.train.observe.step_log import Guard, StepLog, StepRecord
from shardwise.train.schedule import build_schedule

if TYPE_CHECKING:
    from shardwise.train.export.final_weights import FinalWeights


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
        from shardwise.train.launch.signals import describe

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

    def sum(self, values: list[float]) -> list[float]:
        return self.wait(self.start(values))

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
    shardwise.train.export.final_weights) for rank 0's streamed export. `resume`: a verified checkpoint
    directory to continue from. `stop`: a StopRequest (shardwise.train.launch.signals) whose request
    on any rank ends the run at the next step boundary with a checkpoint (raises Interrupted).
    `watchdog` is told each phase (shardwise.train.launch.watchdog). `lineage`: the run's
    (shardwise.train.checkpoint.lineage); by default rank 0 starts one from `resume` and records it in the
    output dir, so pruning and `--resume latest` never cross runs. The caller closes `metrics`
    (with the run's final status, after any export).

    Host memory: the run holds glibc's mmap threshold at 1 MiB (shardwise.train.launch.host_alloc),
    so tensors freed and gathered again per layer or step return to the system and never leave
    holes in the heap.
    """
    s = setup(run, env, steps=steps, metrics=metrics, resume=resume, stop=stop, watchdog=watchdog,
              lineage=lineage)
    try:
        for step in range(s.start + 1, s.total + 1):
            train_step(s, step)
            after_step(s, step)
        _final_weights(s, export_weights, final_export)
    except Interrupted:
        s.result.status = "interrupted"
        raise
    finally:
        teardown(s)
    return s.result


@dataclass(eq=False)
class LoopState:
    """One rank's training loop: what `setup` builds, `train_step` and `after_step` read and update."""

    run: RunSpec
    engine: Engine
    denv: DistEnv  # the data-parallel view of this rank (a TP group reads one batch)
    w: float  # 1.0 where this rank's counts and loss sums add to the global ones (one rank per TP group)
    global_batch: int  # sequences per optimizer step, all ranks
    phase: Callable[[str, int], None]  # tells the watchdog where this rank is
    is_main: bool
    start: int  # optimizer steps done before this run (resume)
    train_time: float  # the steps' time, over resumes
    lineage: Any
    eval_batches: list[dict[str, torch.Tensor]]  # this rank's slice of the validation split
    eval_targets: int  # their target tokens
    best_loss: float
    best_step: int | None
    lr_at: Callable[[int], float]
    result: TrainResult
    metrics: Any
    stop: Any
    guard: Guard
    meta: _MetaReduce
    last_save: float  # time.monotonic() of the last checkpoint (or the start): timed saves
    records: StepLog = field(init=False)
    source: Prefetcher = field(init=False)
    ahead: PreparedStep | None = None  # the next step's micro-batches, taken from the prefetch thread
    reduce: tuple[torch.Tensor, Any] | None = None  # the all-reduce in flight: [next counts, votes]
    counts: tuple[int, int] = (0, 0)  # the next step's global (target, input) token counts
    clock: tuple[float, float] = (0.0, 0.0)  # (perf_counter, thread_time) when the next step's time began

    @property
    def total(self) -> int:
        return self.run.config.run.steps

    def log(self, rec: StepRecord) -> None:
        self.result.records.append(rec)
        if self.metrics is not None:
            self.metrics.log_step(rec)


def setup(run: RunSpec, env: DistEnv, *, steps: Iterator[list[dict[str, torch.Tensor]]] | None = None,
          metrics: Any = None, resume: Path | None = None, stop: Any = None, watchdog: Any = None,
          lineage: Any = None) -> LoopState:
    """What runs once on each rank before the first step (`train`'s arguments): the seed, the model
    and its engine, the checkpoint to resume loaded into it, the data, the validation batches, the
    lr schedule, the metrics' start, the non-finite guard, the host-side group, the step log and
    the prefetch thread. Collective (the engine, the checkpoint load, the group)."""
    from shardwise.train.checkpoint import sharded as ckpt

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
    # Data parallelism is over the TP groups and pipeline stages: they read one batch, and only one
    # rank of them adds its counts and loss sums to the global ones (`w`), so each batch counts once.
    denv = env.data_parallel(run.layout.tp, run.layout.pp)
    global_batch = cfg.run.micro_batch * cfg.run.grad_accum * denv.world_size
    phase = watchdog.phase if watchdog is not None else (lambda name, step: None)
    start, train_time = 0, 0.0
    if lineage is None and env.is_main:  # only rank 0 writes manifests and prunes
        from shardwise.train.checkpoint.lineage import start_lineage, write_lineage

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
    eval_batches: list[dict[str, torch.Tensor]] = []
    if cfg.run.eval_every_steps is not None:
        from shardwise.train.data import build_eval_batches

        eval_batches = build_eval_batches(run, denv)
    best_loss, best_step = math.inf, None
    if cp.save_best and resume is not None and env.is_main:  # rank 0 prunes: it alone needs the best
        record = ckpt.read_best(cp.output_dir, lineage.lineage if lineage is not None else None)
        if record is not None and int(record["step"]) <= start:
            best_loss, best_step = float(record["eval_loss"]), int(record["step"])
    result = TrainResult(num_params=num_params, start_step=start)
    if metrics is not None:
        metrics.start(cfg, env, num_params, start_step=start, build_s=build_s)
    guard = Guard(cfg.run.nonfinite_patience, run.train.compute_dtype == "fp16",
                  say=(lambda msg: print(msg, flush=True)) if env.is_main else (lambda msg: None))
    guard.bad = streak
    last_save = time.monotonic()
    # One host-side reduce per step carries the NEXT step's target/token counts (they must be
    # global before its first forward) and the votes (each rank's clock differs: any rank's vote
    # makes every rank act, so they always act together).
    meta = _MetaReduce()
    s = LoopState(run=run, engine=engine, denv=denv, w=1.0 if env.counts_data(run.layout.tp, run.layout.pp) else 0.0,
             global_batch=global_batch, phase=phase, is_main=env.is_main, start=start, train_time=train_time,
             lineage=lineage, eval_batches=eval_batches,
             eval_targets=sum(count_target_tokens(b) for b in eval_batches), best_loss=best_loss,
             best_step=best_step, lr_at=build_schedule(cfg.schedule, cfg.optimizer.lr, cfg.run.steps),
             result=result, metrics=metrics, stop=stop, guard=guard, meta=meta, last_save=last_save)
    s.records = StepLog(cfg.logging.every, guard, s.meta.sum, s.log, every_seconds=cfg.logging.every_seconds,
                        show=getattr(metrics, "show", None))
    # The next steps' batches are read, collated and counted on a background thread.
    s.source = Prefetcher(steps, first=start + 1, count=cfg.run.steps - start)
    return s


def train_step(s: LoopState, step: int) -> None:
    """Optimizer step `step` (1-based) on this rank, in the order of the module docstring."""
    # 1. this step's micro-batches and global counts: read ahead and all-reduced during the
    #    previous step (`after_step` waited for them); the run's first step takes its own here
    if step == s.start + 1:
        s.ahead = s.source.next()
        s.reduce = s.meta.start([s.ahead.targets * s.w, s.ahead.tokens * s.w, 0.0, 0.0, 0.0])
        s.clock = _clock()
        _receive(s, s.start)
    targets, tokens = s.counts
    if targets == 0:
        raise RuntimeError(f"step {step}: the global batch has no target tokens")
    loss_scale = s.denv.world_size / targets  # engines average over data ranks
    lr = s.lr_at(step - 1)
    s.engine.set_lr(lr)
    assert s.ahead is not None and s.ahead.step == step, (s.ahead, step)
    micro = s.ahead.micro

    # 2. forward and backward of each micro-batch; gradients sync on the last one only
    s.phase("forward_backward", step)
    loss_sum = s.engine.forward_backward_step(micro, loss_scale)  # kept on the device until the next flush

    # 3. the next step's micro-batches, and the all-reduce of [their counts, this rank's votes]
    if step < s.total:
        s.phase("next batches", step)
        s.ahead = s.source.next()
    else:
        s.ahead = None
    counts = (s.ahead.targets * s.w, s.ahead.tokens * s.w) if s.ahead is not None else (0.0, 0.0)
    s.reduce = s.meta.start([*counts, *_votes(s)])

    # 4. clip, skip a non-finite update, update (the engine), while that all-reduce completes
    s.phase("optimizer step", step)
    grad_norm = s.engine.step()
    s.engine.zero_grad()

    # 5. the record; its loss and grad norm reach the host at the next flush (after_step)
    t0, c0 = s.clock
    rec = StepRecord(step=step, loss=float("nan"), grad_norm=float("nan"), lr=lr, target_tokens=targets,
                     tokens=tokens, step_time_s=time.perf_counter() - t0, cpu_time_s=time.thread_time() - c0)
    s.records.add(rec, loss_sum * s.w, grad_norm)
    s.train_time += rec.step_time_s


def after_step(s: LoopState, step: int) -> None:
    """What follows optimizer step `step` (the last one included), in this order: the next step's
    counts and the votes, then where due the flush of the pending records, an evaluation, a
    checkpoint and a stop (raises Interrupted). The votes are sums over ranks, and so are the
    records' numbers: every rank takes every decision alike."""
    cfg = s.run.config
    cp = cfg.checkpointing
    s.clock = _clock()  # the next step's time starts here: it counts the waits and work below
    stop_vote, time_vote, log_vote = _receive(s, step)
    last = step == s.total
    # a stop voted during the last step changes nothing: the run ends there anyway
    stopping = bool(stop_vote) and not last
    every = cfg.run.eval_every_steps
    eval_due = every is not None and (step % every == 0 or last)
    save_due = bool(cp.save_every_steps and step % cp.save_every_steps == 0)
    periodic = cp.save_every_steps is not None or cp.save_every_minutes is not None

    # The records reach the host at a logging step (every N steps, or once any rank's clock says
    # logging.every_seconds passed), after the last step, and before any decision that needs
    # them; nothing below is due at any other boundary.
    finite = True
    if last or stopping or time_vote or log_vote or eval_due or save_due or s.records.due(step):
        s.phase("host sync (losses, grad norms)", step)
        finite = s.records.flush()  # raises NonFiniteError past run.nonfinite_patience
    if last:
        s.guard.at_end(s.records.last)  # raises when the last step was skipped

    # a stop skips a due evaluation: the stop must be prompt
    evaluated = finite and not stopping and eval_due
    if evaluated:
        _evaluate(s, step)

    # every N steps, a timed save any rank voted for, each evaluation's with save_best, the last step's
    saved = finite and (save_due or bool(time_vote) or (evaluated and cp.save_best) or (last and periodic))
    if saved:
        _save(s, step)

    if stopping:
        note = ""
        if cp.save_on_interrupt and not saved:
            # A skipped (non-finite) step left the weights and optimizer state as the last finite
            # step made them: that state is saved (save_checkpoint refuses it if it is not finite
            # after all), its skipped steps counted for the resumed run.
            _save(s, step)
            if not finite and s.records.last is not None:
                rec = s.records.last
                note = (f" (step {step}'s update was skipped: loss {rec.loss}, grad norm "
                        f"{rec.grad_norm}; the checkpoint holds the state of the last finite step, "
                        f"and a resumed run counts its {s.guard.bad} skipped step(s) against "
                        f"run.nonfinite_patience={s.guard.patience})")
        signum = s.stop.signum if s.stop is not None and s.stop.signum else signal.SIGTERM
        raise Interrupted(signum, step, s.result.checkpoint, note)


def teardown(s: LoopState) -> None:
    """Stop the prefetch thread, destroy the host-side group, release the engine."""
    s.source.close()
    s.meta.close()
    s.engine.close()


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _receive(s: LoopState, step: int) -> list[float]:
    """Wait for the all-reduce started during step `step`: keep the next step's global counts,
    return the votes [stop, timed save, timed log] (sums over ranks)."""
    assert s.reduce is not None
    s.phase("all_reduce(step counts)", step)
    targets, tokens, *votes = s.meta.wait(s.reduce)
    s.counts = int(targets), int(tokens)
    return votes


def _votes(s: LoopState) -> list[float]:
    """This rank's votes, asked during a step: a stop was requested, a timed checkpoint is due,
    a timed log is due."""
    minutes = s.run.config.checkpointing.save_every_minutes
    timed = minutes is not None and time.monotonic() - s.last_save >= minutes * 60
    return [float(s.stop is not None and s.stop.requested), float(timed), float(s.records.time_due())]


def _evaluate(s: LoopState, step: int) -> EvalRecord:
    """One pass over this rank's validation batches (collective: every rank runs the same number
    of forwards), then one reduce of [loss sum, target count]."""
    s.phase("evaluate", step)
    t0 = time.perf_counter()
    sums = [s.engine.evaluate(b) for b in s.eval_batches]
    local = float(torch.stack(sums).double().sum()) if sums else 0.0
    loss_sum, targets = s.meta.sum([local * s.w, float(s.eval_targets) * s.w])
    if targets == 0:
        raise RuntimeError(f"step {step}: the validation split has no target tokens")
    loss = loss_sum / targets
    rec = EvalRecord(step=step, eval_loss=loss, eval_ppl=perplexity(loss), eval_tokens=int(targets),
                     eval_time_s=time.perf_counter() - t0)
    s.result.evals.append(rec)
    if s.metrics is not None:
        s.metrics.log_eval(rec)
    if loss < s.best_loss:  # the same all-reduced value on every rank: the same decision
        s.best_loss, s.best_step = loss, step
        s.result.best_step = step if s.run.config.checkpointing.save_best else None
    return rec


def _save(s: LoopState, step: int) -> Path:
    """A checkpoint of the state after step `step` (collective); with save_best, rank 0 records it
    as the best when its evaluation was."""
    from shardwise.train.checkpoint import sharded as ckpt

    cfg = s.run.config
    cp = cfg.checkpointing
    s.phase("checkpoint save", step)
    t_save = time.perf_counter()
    state = ckpt.TrainerState(step=step, samples_consumed=step * s.global_batch, global_batch=s.global_batch,
                              train_time_s=s.train_time, nonfinite_streak=s.guard.bad)  # fmt: skip
    path = ckpt.save_checkpoint(s.engine, state, cp.output_dir, config=cfg.model_dump(mode="json"),
                                strategy=s.run.strategy.name, keep_last=cp.keep_last, lineage=s.lineage,
                                protect=s.best_step if cp.save_best else None)  # fmt: skip
    s.result.checkpoint, s.last_save = path, time.monotonic()
    if getattr(s.metrics, "log_checkpoint", None) is not None:
        s.metrics.log_checkpoint(step, path, time.perf_counter() - t_save)
    if cp.save_best and s.best_step == step and s.is_main:
        ckpt.write_best(cp.output_dir, step, s.best_loss, s.lineage)
    return path


def _final_weights(s: LoopState, export_weights: bool, final_export: bool) -> None:
    """After the last step: the weights rank 0 holds in memory, and/or the DCP directory that
    holds them for the streamed export (collectives)."""
    if export_weights:
        s.phase("export gather", s.total)
        s.result.final_weights = s.engine.consolidated_state_dict()  # export refuses non-finite ones
    if final_export:
        from shardwise.train.export.final_weights import final_weights

        s.phase("export staging", s.total)
        out = s.run.config.checkpointing.output_dir
        s.result.final = final_weights(s.engine, out, s.total, s.result.checkpoint)
