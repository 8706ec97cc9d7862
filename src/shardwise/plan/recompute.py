"""Activation checkpointing left to the plan (`checkpointing: auto`, the trainer's default): no
recomputation where the run fits without it, else every decoder layer's (full) — the two the
trainer runs. No recomputation is always the faster of the two (full reruns each layer's forward
in backward), so memory alone decides: the plan with `checkpointing: none` fits (the plan's
`fits`: the GPU's required bytes within its usable memory and the host's peak within the node's)
or it does not. Where it does not fit only because of the host's peak and recomputation would
not lower that peak (offloaded states, the load phase: only offloaded activations shrink with
it), recomputing would only slow a run that does not fit either way: none, said so (`moot`).
LLaMA-Factory checkpoints by default; torchtune's and torchtitan's large-model recipes turn it on
in the config.

One decision for the planner and the trainer: plan/evaluate.py `checkpointing_choice` (it plans
memory, so it lives with it), which `evaluate` (and through it `plan`'s table, `--json` and the
recommender's rows) and the trainer's run specs (shardwise.run.bridge: on CUDA the same call; on
CPU the host plan the trainer checks, shardwise.plan.host_cpu) take before anything is planned.
This module holds its record; pure, torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RecomputeChoice:
    """What `checkpointing: auto` became for one strategy, and why, in numbers."""

    checkpointing: str  # "none" | "full"
    strategy: str  # the strategy's name
    need: str  # GiB the plan without recomputation needs: "250.9"
    have: str  # against what: "76.0 usable" (GPU), "1907 per node (host memory)"
    moot: bool = False  # it does not fit, and recomputation would not lower what does not fit

    @property
    def reason(self) -> str:
        if self.moot:
            return f"auto: {self.need} GiB of {self.have} either way: recomputation would not lower it"
        if self.checkpointing == "none":
            return f"auto: fits without recomputation, {self.need} GiB of {self.have}"
        return f"auto: without recomputation it would need {self.need} GiB of {self.have}"

    def line(self) -> str:
        """One line for `plan`'s output and the trainer's log."""
        return f"{self.strategy}: checkpointing {self.checkpointing} ({self.reason})"

    def as_dict(self) -> dict:
        return {"checkpointing": self.checkpointing, "chosen": "auto", "reason": self.reason}


def grouped_lines(choices: list[RecomputeChoice]) -> list[str]:
    """`plan`'s lines for a table's rows: those that fit without recomputation on one, those that
    need it on another, with what each needs without it."""
    out = []
    for what, moot, words in (("none", False, "each fits without recomputation"),
                              ("none", True, "recomputation would not lower what each needs"),
                              ("full", False, "without recomputation each would need")):
        rows = [c for c in choices if c.checkpointing == what and c.moot == moot]
        if not rows:
            continue
        haves = {c.have for c in rows}
        each = ", ".join(f"{c.strategy} {c.need}" + ("" if len(haves) == 1 else f" of {c.have}") for c in rows)
        out.append(f"Activation checkpointing (auto): {what}; {words} (GiB): {each}"
                   + (f" of {next(iter(haves))}" if len(haves) == 1 else ""))
    return out
