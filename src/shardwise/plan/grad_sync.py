"""FSDP2 under gradient accumulation: hold the unsharded gradients between micro-batches
(gradient sync off on all but the last: one reduce-scatter per step) or reduce-scatter every
micro-batch into the sharded gradients (torch's default, what torchtitan, torchtune and
Composer run). `strategy.fsdp.reduce_every_micro_batch` says which: true, false, or "auto".

One decision for the planner and the trainer: plan/evaluate.py `fsdp_grad_sync` (it plans
memory and time, so it lives with them), which `memory_as_run` (and through it `plan`'s table,
`--json` and the trainer's preflight) and the FSDP2 engine (`RunSpec.grad_sync`) call with the
same specs and margin, so the held gradients planned are the ones the trainer holds. This module
holds its record and the rules memory, comm and time read; pure, torch-free.

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

from shardwise.specs.hardware import GIB
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


def apart_figures(need: float, usable: float) -> tuple[str, str]:
    """Both figures with the decimals that tell them apart (one, up to four)."""
    digits = next((d for d in range(1, 5) if f"{need:.{d}f}" != f"{usable:.{d}f}"), 4)
    return f"{need:.{digits}f}", f"{usable:.{digits}f}"


def apart_words(need: float, usable: float) -> str:
    """"A GiB of B": with the decimals that tell them apart (`apart_figures`)."""
    a, b = apart_figures(need, usable)
    return f"{a} GiB of {b}"


def held_words(held_bytes: float) -> str:
    return f"{held_bytes / GIB:.3g} GiB of unsharded grads"


def as_set(strategy: Strategy, train: TrainSpec, held_bytes: float) -> GradSync | None:
    """The record of a knob set to true or false (no decision): `held_bytes` the plan's."""
    knob = strategy.fsdp.reduce_every_micro_batch
    if knob == "auto" or not applies(strategy, train):
        return None
    why = ("strategy.fsdp.reduce_every_micro_batch: true" if knob else
           f"strategy.fsdp.reduce_every_micro_batch: false, holding {held_words(held_bytes)}")
    return GradSync(hold=not knob, auto=False, reason=why, held_bytes=held_bytes, grad_accum=train.grad_accum,
                    strategy=strategy)
