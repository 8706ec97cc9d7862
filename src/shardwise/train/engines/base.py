"""The one Engine interface the training loop talks to, and the loss every engine shares.

The loop never asks which engine it drives. Each engine owns: the wrapped model, the
optimizer, gradient synchronisation, clipping and the parameter update. The loop owns:
batches, the learning rate value, loss normalisation and logging.

Loss normalisation (the contract every engine implements identically): the loop passes
`loss_scale = dp_world_size / global_target_tokens`, where `global_target_tokens` counts the
targets of *all* micro-batches of the optimizer step on *all* ranks. Every backend averages
gradients over ranks (divides by dp_world_size), so backpropagating `sum(token losses) *
loss_scale` yields exactly the gradient of the mean loss over the step's target tokens — the
same gradient a single process computes on the whole global batch. A per-micro-batch or
per-rank mean (the 2024 gradient-accumulation bug) weights short sequences too much.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from shardwise.data.labels import IGNORE_INDEX
from shardwise.specs.train import weight_decayed

if TYPE_CHECKING:
    from shardwise.specs.train import TrainSpec


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits. `world_size` ranks all hold a data-parallel replica or shard."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # "cpu" or "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device, self.local_rank) if self.device == "cuda" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def data_parallel(self, tp: int, pp: int = 1) -> DistEnv:
        """The data-parallel view of this rank. The mesh orders ranks (pp, data, tp), tp innermost
        (shardwise.train.engines.mesh): the `tp` consecutive ranks of a TP group, and the same data
        rank of every pipeline stage, read the same batch, as one data rank."""
        if tp == 1 and pp == 1:
            return self
        dp = self.world_size // (tp * pp)
        return replace(self, rank=(self.rank // tp) % dp, world_size=dp)

    def counts_data(self, tp: int, pp: int = 1) -> bool:
        """Whether this rank's batch counts in global sums (targets, tokens, loss): one rank per
        TP group, on the last pipeline stage (it alone computes the loss), so each data-parallel
        batch counts once."""
        last_stage = self.rank // (self.world_size // pp) == pp - 1
        return self.rank % tp == 0 and last_stage


@runtime_checkable
class Engine(Protocol):
    """One optimizer step = `forward_backward_step` (GA × (`sync_grads(last)` + `forward_backward`)
    in a data-parallel engine) then `step`, `zero_grad`."""

    name: str
    module: torch.nn.Module  # the user's (possibly sharded) model, for state and hooks

    def forward_backward_step(self, micro: list[dict[str, torch.Tensor]], loss_scale: float) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches; the detached loss sum over
        them (fp64). Data-parallel engines run them one after another (`accumulate`); a pipeline
        runs them through its schedule."""
        ...

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float) -> torch.Tensor:
        """Forward, backward of `token_loss_sum * loss_scale`; return the detached fp32 loss sum."""
        ...

    def evaluate(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The fp32 token-loss sum of `batch`, no gradient, the model in eval mode (then back in
        train mode): the engine's own forward (its wrapper's hooks and collectives fire as in
        training), no backward, no state change (`evaluate_loss_sum`). Collective: every rank
        calls it the same number of times."""
        ...

    def sync_grads(self, enabled: bool) -> AbstractContextManager[None]:
        """Context for one micro-batch: `enabled` only on the step's last one (the GA boundary)."""
        ...

    def step(self) -> torch.Tensor | float:
        """Clip to `max_grad_norm`, update parameters (none where the norm is not finite); return
        the global pre-clip gradient norm, a 0-dim tensor left on the device (the loop reads it
        once per logging interval) or a float. At most one host sync: the skip decision."""
        ...

    def zero_grad(self) -> None: ...

    @property
    def lr(self) -> float: ...

    def set_lr(self, lr: float) -> None:
        """Every parameter group gets `lr` (the loop's schedule owns the value, not the engine)."""
        ...

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full, unsharded model weights on CPU on rank 0 (None elsewhere): a snapshot, for tests and
        in-process callers (`train(export_weights=True)`); `shardwise train`'s export streams from
        disk instead (shardwise.train.export.final_weights). Collective."""
        ...

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The canonical training state (shardwise.train.checkpoint.sharded): tensors named
        `model.<fqn>`, `optim.exp_avg.<fqn>`, `optim.exp_avg_sq.<fqn>` (master values: fp32,
        bf16 under bf16-pure; DTensors where the engine shards them; a rank may hold a subset),
        plus JSON-safe extras (`optimizer_step`, `scaler`). Collective."""
        ...

    def load_checkpoint_state(self, read: Any, extra: dict[str, Any]) -> None:
        """Fill the engine from a checkpoint: `read(tensors)` loads canonical keys into the
        given tensors in place (any world size or engine wrote them). Collective."""
        ...

    def close(self) -> None:
        """Release engine resources (hooks, buffers) so another engine can start in-process."""
        ...


def accumulate(engine: Engine, micro: list[dict[str, torch.Tensor]], loss_scale: float) -> torch.Tensor:
    """A step's micro-batches one after another, gradients synchronised on the last one only
    (`Engine.forward_backward_step` of the data-parallel engines); the loss sums stay on the device."""
    sums = []
    for i, batch in enumerate(micro):
        with engine.sync_grads(i == len(micro) - 1):
            sums.append(engine.forward_backward(batch, loss_scale))
    return torch.stack(sums).double().sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over target positions, in fp32: the standard
    implementation (`loss.implementation: standard`; the chunked default is shardwise.train.model.loss,
    same contract, held to this one by tests/train/test_chunked_ce.py).

    `labels` are not pre-shifted (the collator's contract): position t predicts labels[t+1].
    fp32 upcast of the logits: bf16 log-softmax over a large vocabulary loses ~3 digits.
    """
    vocab = logits.size(-1)
    # Shift the labels, not the logits: slicing [B, S, V] logits would copy them (and their
    # gradient) once more; the padded last position is ignored, so the sum is the same.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(
        logits.float().reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def forward_loss_sum(forward: Callable[..., Any], model: torch.nn.Module, batch: dict[str, torch.Tensor],
                     device: torch.device, train: TrainSpec,
                     amp: AbstractContextManager[Any] | None = None) -> torch.Tensor:
    """The forward of one micro-batch through the loss: the fp32 sum of its token losses.

    `forward` is what the engine calls (its wrapper: DDP, DeepSpeedEngine, the FSDP2 root), so
    the engine's hooks fire as for any forward; `model` is the unwrapped HF CausalLM. By
    `train.cross_entropy` (the run's `loss.implementation`, as planned):
    - chunked: the model's LossHead (in lm_head's place, shardwise.train.model.loss) computes the loss
      chunk by chunk from the hidden states inside the model call: no [tokens, vocab] fp32 logits;
    - standard: the model returns the logits, `token_loss_sum` upcasts them whole.
    `amp` (DDP's autocast) wraps the model call only, as before; so does activation offloading
    (`train.activation_offload`, shardwise.train.model.activation_offload: its hooks stay with the
    saved tensors, so the engine's backward brings them back). One function per engine call:
    `shardwise bench` wraps it to mark the end of the forward."""
    labels = batch["labels"].to(device)
    inputs = model_inputs(batch, device)
    from shardwise.train.model.activation_offload import offloaded

    with amp if amp is not None else contextlib.nullcontext():
        if train.cross_entropy == "chunked":
            from shardwise.train.model.loss import computing

            with computing(model, labels, train.ce_chunk), offloaded(model, device, train):
                return forward(**inputs).logits
        if train.cross_entropy != "standard":
            raise ValueError(f"cross_entropy {train.cross_entropy!r} is plan-only; the trainer runs chunked or standard")
        with offloaded(model, device, train):
            logits = forward(**inputs).logits
    return token_loss_sum(logits, labels)


def evaluate_loss_sum(forward: Callable[..., Any], model: torch.nn.Module, batch: dict[str, torch.Tensor],
                      device: torch.device, train: TrainSpec,
                      amp: AbstractContextManager[Any] | None = None) -> torch.Tensor:
    """`forward_loss_sum` for an evaluation: under `torch.no_grad()`, with `forward` (the engine's
    wrapper, a Module) in eval mode and restored to its previous mode afterwards. Returns the
    detached fp32 sum of the batch's token losses."""
    was_training = getattr(forward, "training", True)
    set_mode = getattr(forward, "train", None)
    if callable(set_mode):
        set_mode(False)
    try:
        with torch.no_grad():
            return forward_loss_sum(forward, model, batch, device, train, amp=amp).detach()
    finally:
        if callable(set_mode):
            set_mode(was_training)


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The keyword arguments of the HF forward. A 2-D all-ones mask is dropped (causal is implied,
    and dropping it keeps the fast SDPA path); a 4-D packing mask is passed through. Positions
    that are 0..S-1 in every row are dropped too: HF then computes RoPE once for [1, S] instead
    of per row ([B, S]); packed rows (positions restarting per document) keep theirs, and a
    padding-free packed batch its `cu_seq_lens_q/k` and `max_length_q/k` (`VARLEN_KEYS`)."""
    out = {"input_ids": batch["input_ids"].to(device, non_blocking=True)}
    pos = batch.get("position_ids")
    if pos is not None and not _default_positions(pos):
        out["position_ids"] = pos.to(device, non_blocking=True)
    mask = batch.get("attention_mask")
    if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
        out["attention_mask"] = mask.to(device, non_blocking=True)
    for key in VARLEN_KEYS:  # a padding-free packed batch's document boundaries (data.collate, varlen)
        if key in batch:
            v = batch[key]
            out[key] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
    return out


# transformers' variable-length kwargs (TransformersKwargs), passed down to the attention function:
# flash_attention_2 and shardwise's per-document SDPA read the boundaries from them.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _default_positions(pos: torch.Tensor) -> bool:
    arange = torch.arange(pos.size(-1), dtype=pos.dtype, device=pos.device)
    return bool((pos == arange).all())


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no decay on norms, biases and embeddings (1-D or embedding tensors).

    Built by name so every engine (and a DTensor-sharded model) gets the same split.
    """
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if weight_decayed(name, p.ndim) else no_decay).append(p)
    if weight_decay == 0:  # one group: the split changes nothing, and each group costs a loop
        return [{"params": decay + no_decay, "weight_decay": 0.0}]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
