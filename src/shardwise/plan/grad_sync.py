"""FSDP2 under gradient accumulation: hold the unsharded gradients between micro-batches
(gradient sync off on all but the last: one reduce-scatter per step) or reduce-scatter every
micro-batch into the sharded gradients (torch's default, what torchtitan, torchtune and
Composer run). `strategy.fsdp.reduce_every_micro_batch` says which: true, false, or "auto".

One decision, here, for the planner and the trainer: `plan_memory` (and through it `plan`'s
table, `--json` and the trainer's preflight) and the FSDP2 engine (`RunSpec.grad_sync`) call
`fsdp_grad_sync` with the same specs and margin, so the held gradients planned are the ones the
trainer holds. Pure, torch-free.

"auto" holds them only where both hold:
- it fits: the plan with the unsharded gradients held fits the GPU's usable memory (what the
  plan's `fits` compares: `required` within the memory less its margin; the held grads are on the
  GPU whatever is offloaded, so the host's peak does not decide it);
- it saves time: holding saves (grad_accum − 1) reduce-scatters per step and adds an upcast and
  an add of every gradient per micro-batch (plan/timing.py `_engine_copy_bytes`): the planned
  step is shorter than with a reduce-scatter per micro-batch.
Else it reduce-scatters every micro-batch (the memory of sharded gradients: 1/N of the held ones).
Under pipeline parallelism torch's schedule turns gradient sync off on all but the last
micro-batch itself (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`): held.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.specs.hardware import GIB, HardwareSpec
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec


@dataclass(frozen=True, slots=True)
class GradSync:
    """How one FSDP2 run reduces its gradients under accumulation, and why."""

    hold: bool  # unsharded grads held between micro-batches: one reduce-scatter per step
    auto: bool  # decided here ("auto"), not set in the config
    reason: str  # why, in words (the plan's line and the trainer's log say it)
    held_bytes: float  # per GPU, the unsharded grads held (planned with them held)
    grad_accum: int
    strategy: Strategy  # the strategy with the knob resolved to a bool: what memory, comm and time read

    @property
    def reduce_every_micro_batch(self) -> bool:
        return not self.hold

    @property
    def reduce_scatters_per_step(self) -> int:
        return 1 if self.hold else self.grad_accum

    def line(self) -> str:
        """One line for `plan`'s output and the trainer's log."""
        what = ("hold the unsharded grads between micro-batches, reduce-scatter once per step" if self.hold
                else "reduce-scatter every micro-batch")
        return f"{self.strategy.name}: {what} ({self.reason})"

    def as_dict(self) -> dict:
        return {"reduce_every_micro_batch": self.reduce_every_micro_batch, "hold_unsharded_grads": self.hold,
                "chosen": "auto" if self.auto else "set", "held_grads_bytes": self.held_bytes,
                "reduce_scatters_per_step": self.reduce_scatters_per_step, "reason": self.reason}


def with_knob(strategy: Strategy, reduce_every: bool) -> Strategy:
    return strategy.model_copy(update={"fsdp": strategy.fsdp.model_copy(
        update={"reduce_every_micro_batch": reduce_every})})


def applies(strategy: Strategy, train: TrainSpec) -> bool:
    """Whether the choice exists: an FSDP2 strategy accumulating over micro-batches."""
    return strategy.engine == "fsdp2" and train.grad_accum > 1


def fsdp_grad_sync(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
                   margin: float | None = None) -> GradSync | None:
    """The gradient reduction `strategy` (as `fully_shard` runs it) uses under `train`'s
    accumulation on `hw`, with `margin` of GPU memory kept free (None: the memory model's
    default, as `plan` and the trainer's preflight take it); None where there is no choice (not
    FSDP2, or one micro-batch per step). The fit is the engines' (the "engine" accounting)."""
    from shardwise.plan.memory import plan_memory

    train = train.for_engine(strategy.engine)
    if not applies(strategy, train):
        return None
    k = train.grad_accum
    if strategy.fsdp.reduce_every_micro_batch != "auto":  # set in the config: the plan records it
        return plan_memory(model, hw, train, strategy, margin=margin).grad_sync
    hold_s = with_knob(strategy, False)
    held = plan_memory(model, hw, train, hold_s, margin=margin)
    held_bytes = held.gpu.held_grads
    size = _size(held_bytes)
    if strategy.pp > 1:
        return GradSync(hold=True, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=hold_s,
                        reason=f"holding {size}: torch's pipeline schedule turns gradient sync off on all "
                               "but the last micro-batch")
    every_s = with_knob(strategy, True)
    if held.gpu.required > held.usable_bytes:  # the GPU's fit (the held grads are on the GPU, offloaded or not)
        return GradSync(hold=False, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=every_s,
                        reason=f"holding {size} would not fit: the plan would need "
                               f"{_apart(held.gpu.required / GIB, held.usable_bytes / GIB)} usable")
    t_hold, t_every = (_step_s(model, hw, train, s, held.layout) for s in (hold_s, every_s))
    if t_hold < t_every:
        return GradSync(hold=True, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=hold_s,
                        reason=f"holding {size} fits and saves {k - 1} reduce-scatter{'s' if k > 2 else ''} "
                               f"per step: planned {t_hold:.4g} s vs {t_every:.4g} s a step")
    return GradSync(hold=False, auto=True, held_bytes=held_bytes, grad_accum=k, strategy=every_s,
                    reason=f"holding {size} would fit but is planned no faster: {t_hold:.4g} s vs "
                           f"{t_every:.4g} s a step")


def _apart(need: float, usable: float) -> str:
    """"A GiB of B": with the decimals that tell them apart (one, up to four)."""
    digits = next((d for d in range(1, 5) if f"{need:.{d}f}" != f"{usable:.{d}f}"), 4)
    return f"{need:.{digits}f} GiB of {usable:.{digits}f}"


def _size(held_bytes: float) -> str:
    return f"{held_bytes / GIB:.3g} GiB of unsharded grads"


def as_set(strategy: Strategy, train: TrainSpec, held_bytes: float) -> GradSync | None:
    """The record of a knob set to true or false (no decision): `held_bytes` the plan's."""
    knob = strategy.fsdp.reduce_every_micro_batch
    if knob == "auto" or not applies(strategy, train):
        return None
    why = ("strategy.fsdp.reduce_every_micro_batch: true" if knob else
           f"strategy.fsdp.reduce_every_micro_batch: false, holding {_size(held_bytes)}")
    return GradSync(hold=not knob, auto=False, reason=why, held_bytes=held_bytes, grad_accum=train.grad_accum,
                    strategy=strategy)


def _step_s(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, layout) -> float:
    from shardwise.plan.comm import plan_comm
    from shardwise.plan.timing import step_time

    comm = plan_comm(model, hw, train, strategy, layout)
    return step_time(model, hw, train, strategy, layout, comm).step_s


def resolved(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy,
             margin: float | None = None) -> Strategy:
    """`strategy` with `reduce_every_micro_batch` a bool (itself where it already is one)."""
    if strategy.fsdp.reduce_every_micro_batch != "auto":
        return strategy
    sync = fsdp_grad_sync(model, hw, train, strategy, margin)
    # no choice (not FSDP2, or no accumulation): every micro-batch is the step's one reduce-scatter
    return sync.strategy if sync else with_knob(strategy, True)
