"""The trainer's chunked cross-entropy (`loss.implementation: chunked`, the default): lm_head and
the loss fused over chunks of `loss.chunk_tokens` tokens, every gradient computed in forward, so
the [tokens, vocab] logits never exist in fp32 (nor whole in any dtype).

Same contract as `engines.base.token_loss_sum`: labels are not pre-shifted (position t predicts
labels[t + 1]), IGNORE_INDEX targets and each row's last position carry no loss, and the result
is the fp32 *sum* of the token losses (the loop scales it by `loss_scale`, engines/base.py).
The model computes it in its own forward: `install_loss_heads` replaces lm_head with a
`LossHead` (same parameters) when the model is built, and `computing(model, labels, chunk)`
hands it the targets of one call, so every engine's hooks fire on the same modules as for
logits; a DTensor lm_head (TP) gets the vocab-parallel version. The math
per chunk, its memory and time, and why it is the default: docs/training.md "The cross-entropy".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from shardwise.data.labels import IGNORE_INDEX
from shardwise.errors import ShardwiseError
from shardwise.train.model.loss_support import STANDARD_HINT, head_support

DEFAULT_CHUNK_TOKENS = 1024


# --------------------------------------------------------------------------- the math
def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] unshifted labels -> [B·S] targets: position t's target is labels[t + 1]; each
    row's last position is ignored (the same padding `token_loss_sum` uses)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)


def _vocab_log_softmax(z: torch.Tensor, group: Any, keep: bool) -> torch.Tensor:
    """log_softmax over a vocabulary split across `group` (z: this rank's [c, V/tp] columns): the
    row max and the sum of exponentials all-reduced (MAX, SUM), as torch's loss_parallel does.
    In place on z unless `keep` (the soft-cap's slope still needs the capped logits)."""
    import torch.distributed as dist

    m = z.amax(dim=-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    ls = z.sub(m) if keep else z.sub_(m)
    se = torch.exp(ls).sum(dim=-1, keepdim=True)
    dist.all_reduce(se, group=group)
    return ls.sub_(se.log_())


def _chunks(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
            chunk: int, softcap: float | None, need: tuple[bool, bool, bool], group: Any = None,
            vocab_start: int = 0):
    """The loop of the module docstring. Returns (loss sum fp32, grad_h, grad_W, grad_b).

    Vocab-parallel (`group`, tensor parallelism): `weight`/`bias` are this rank's rows
    [vocab_start, vocab_start + V/tp) of lm_head; the log-softmax is reduced over the group, a
    target outside the shard contributes nothing here (its rank adds it: the loss sum is
    all-reduced once at the end), and grad_h is this rank's partial sum (g_shard · W_shard), which
    the caller's DTensor (Partial) reduces over the group."""
    need_h, need_w, need_b = need
    n = h.size(0)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    if group is not None:  # this shard's column of each target; rows whose target lives elsewhere masked
        local = safe - vocab_start
        mine = (local >= 0) & (local < weight.size(0))
        safe = torch.where(mine, local, torch.zeros_like(local))
        here = valid & mine
    else:
        here = valid
    rows_idx = torch.arange(min(chunk, n), device=h.device)
    rows = valid.to(h.dtype).unsqueeze(1)  # [n, 1]: masks ignored rows of h-sized tensors only
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = None
    grad_b = torch.zeros(weight.size(0), dtype=torch.float32, device=h.device) if need_b else None
    gdtype = weight.dtype
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        hc, tc = h[s:e], safe[s:e]
        at = (rows_idx[: e - s], tc)  # each row's target entry (index_put_: bf16 scatter_ is slow on CPU)
        z = F.linear(hc, weight, bias)
        if softcap is not None:  # cap·tanh(z / cap) in place, in the compute dtype as HF does it
            z.div_(softcap).tanh_().mul_(softcap)
        z = z.float()  # fp32 compute: the GEMM output itself; kept with a soft-cap (its slope)
        ls = torch.log_softmax(z, dim=-1) if group is None else _vocab_log_softmax(z, group, softcap is not None)
        if softcap is None:
            del z
        picked = ls[at]  # [c] log-probability of each row's target
        hr = here[s:e]
        total += torch.where(hr, picked, torch.zeros_like(total)).sum().neg()
        if not (need_h or need_w or need_b):
            continue
        # g = softmax − onehot, rounded once to the compute dtype (as the standard backward);
        # vocab-parallel: a row whose target is on another rank keeps its softmax entry here
        target_grad = picked.exp() - 1.0 if group is None else picked.exp() - hr.to(picked.dtype)
        if softcap is not None:  # d(cap·tanh(x/cap))/dx = 1 − tanh² = 1 − (z/cap)²: g = p − p·z²/cap²
            p = ls.exp_().index_put_(at, target_grad)
            z.square_()
            g = torch.addcmul(p, p, z, value=-1.0 / softcap**2,
                              out=p if gdtype == torch.float32 else torch.empty_like(p, dtype=gdtype))
            del p, z
        elif gdtype == torch.float32:
            g = ls.exp_().index_put_(at, target_grad)
        else:
            g = torch.exp(ls, out=torch.empty_like(ls, dtype=gdtype))
            g.index_put_(at, target_grad.to(gdtype))
        del ls
        vrow = rows[s:e]
        if grad_h is not None:
            out = grad_h[s:e]
            torch.mm(g, weight, out=out)
            out.mul_(vrow)
        if need_w:
            hm = hc * vrow  # ignored rows of g are not zeroed: their h rows are
            if grad_w is None:
                grad_w = torch.mm(g.t(), hm)
            else:
                grad_w.addmm_(g.t(), hm)
        if grad_b is not None:
            grad_b += torch.mv(g.t(), vrow.squeeze(1)).float()
        del g
    if need_w and grad_w is None:  # no tokens: still a gradient, so every rank's hooks fire alike
        grad_w = torch.zeros_like(weight)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=group)  # each target's term lives on one rank
    return total, grad_h, grad_w, grad_b


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and every gradient; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk, softcap, group=None, vocab_start=0):  # type: ignore[override]
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        total, gh, gw, gb = _chunks(h, weight, bias, targets, chunk, softcap, need, group, vocab_start)
        ctx.grads = (gh, gw, None if gb is None else gb.to(bias.dtype))
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None  # handed over: autograd may steal them as .grad
        out = [None if g is None else g.mul_(grad_out) for g in grads]
        return (*out, None, None, None, None, None)


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                             softcap: float | None = None, *, group: Any = None,
                             vocab_start: int = 0) -> torch.Tensor:
    """Σ over targets != IGNORE_INDEX of cross_entropy(h · Wᵀ + b, target), fp32, chunked.

    With `group` (tensor parallelism), W and b are this rank's vocabulary rows starting at
    `vocab_start` and the loss is the whole one on every rank (`_chunks`).

    h: [N, H] hidden states (the lm_head input), targets: [N] already shifted. Under
    torch.autocast, h, W and b are cast to the autocast dtype (as autocast casts F.linear's
    inputs); without grad mode, or with nothing requiring grad, only the loss is computed."""
    if h.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"h [N, H] and targets [N] expected, got {tuple(h.shape)} and {tuple(targets.shape)}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        h, weight = h.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if h.dtype != weight.dtype:
        raise TypeError(f"lm_head input {h.dtype} and weight {weight.dtype} differ (F.linear would refuse too)")
    with torch.autocast(device, enabled=False):
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (h, weight, bias))
        if not grads:
            return _chunks(h, weight, bias, targets, chunk_tokens, softcap, (False, False, False), group,
                           vocab_start)[0]
        return _FusedLinearCrossEntropy.apply(h, weight, bias, targets, chunk_tokens, softcap, group, vocab_start)


# --------------------------------------------------------------------------- the model side
class LossHead(torch.nn.Linear):
    """The model's output layer, able to return the loss: lm_head with the same parameters (the
    same Parameter objects: names, tying and sharding unchanged), whose forward returns the
    fp32 loss sum of `targets` while `computing` is open, and the logits otherwise.

    `install_loss_heads` puts it in place of lm_head when the model is built; the model's own
    forward then calls it, under every engine's hooks, as it called lm_head."""

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.request: _Request | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        req = self.request
        if req is None:
            return super().forward(x)
        weight, bias, tp = self.weight, self.bias, {}
        if isinstance(weight, DTensor):  # tensor parallelism: lm_head holds a vocabulary shard
            mesh = weight.device_mesh
            # x arrives all-gathered (Replicate); its gradient here is this rank's partial sum, which
            # DTensor reduce-scatters back over the sequence (Partial → Shard(1))
            x = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
            weight = weight.to_local()
            bias = bias.to_local() if bias is not None else None
            tp = {"group": mesh.get_group(), "vocab_start": mesh.get_local_rank() * weight.size(0)}
        h = x.reshape(-1, x.size(-1))
        if h.size(0) != req.targets.numel():
            raise RuntimeError(f"chunked cross-entropy: lm_head got {h.size(0)} positions for {req.targets.numel()} "
                               "targets (the model sliced its hidden states: logits_to_keep?)")
        return linear_cross_entropy_sum(h, weight, bias, req.targets, req.chunk_tokens, req.softcap, **tp)


@dataclass
class _Request:
    targets: torch.Tensor  # [B·S], shifted
    chunk_tokens: int
    softcap: float | None


def _plain_linear(m: object) -> bool:
    return isinstance(m, torch.nn.Linear) and type(m).forward in (torch.nn.Linear.forward, LossHead.forward)


def output_heads(model: Any) -> list[torch.nn.Linear]:
    """The nn.Linear module(s) that compute the logits: `get_output_embeddings()`, or the
    original and trainable copies inside PEFT's ModulesToSaveWrapper (`modules_to_save:
    [lm_head]`), which returns its active copy's output unchanged. Anything else (a LoRA layer
    on lm_head, a custom head) adds to the linear's output: refused."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and _plain_linear(head):
        return [head]
    original, copies = getattr(head, "original_module", None), getattr(head, "modules_to_save", None)
    if original is not None and copies is not None:
        found = [original, *copies.values()]
        if all(_plain_linear(m) for m in found):
            return found
    raise ShardwiseError(f"chunked cross-entropy: the output layer of {type(model).__name__} is "
                         f"{type(head).__name__}, not a plain nn.Linear (a LoRA adapter on lm_head?); {STANDARD_HINT}")


def _softcap(model: Any) -> float | None:
    """The logit soft-cap the loss applies (Gemma 2/3); raises ShardwiseError where the chunked
    path cannot reproduce the model's logits (loss_support)."""
    # a pipeline stage answers for the CausalLM class it was cut from (shardwise.train.model.pipeline)
    capped, refusal = head_support(getattr(model, "causal_lm_class", type(model)))
    if refusal:
        raise ShardwiseError(f"chunked cross-entropy: {refusal}; {STANDARD_HINT}")
    cap = getattr(model.config, "final_logit_softcapping", None) if capped else None
    return float(cap) if cap else None


def install_loss_heads(model: Any) -> None:
    """Put a LossHead in place of the model's output layer (before adapters, engines and
    tensor parallelism wrap it: PEFT's `modules_to_save` copies it, DTensor shards it). Raises
    ShardwiseError where the chunked loss cannot reproduce the model's logits."""
    _softcap(model)
    (head,) = output_heads(model)
    if not isinstance(head, LossHead):
        model.set_output_embeddings(LossHead(head))


def loss_heads(model: Any) -> list[LossHead]:
    """The installed LossHead(s) of `model` (two under `modules_to_save: [lm_head]`)."""
    heads = output_heads(model)
    if not all(isinstance(h, LossHead) for h in heads):
        raise RuntimeError(f"chunked cross-entropy: {type(model).__name__} was built without its loss head "
                           "(shardwise.train.model.loss.install_loss_heads)")
    return heads  # type: ignore[return-value]


@contextmanager
def computing(model: Any, labels: torch.Tensor, chunk_tokens: int) -> Iterator[None]:
    """While open, calling `model` returns this micro-batch's loss sum as `.logits` (fp32, 0-d):
    its LossHead computes it from the hidden states. `model` is the unwrapped HF CausalLM (the
    engines' `module`); the caller may call it through its wrapper (DDP, DeepSpeedEngine). For
    Gemma 2/3 the model's own soft-capping is off during the call (the head applies it)."""
    heads, cap = loss_heads(model), _softcap(model)
    req = _Request(shifted_targets(labels), chunk_tokens, cap)
    for head in heads:
        head.request = req
    if cap is not None:
        model.config.final_logit_softcapping = None
    try:
        yield
    finally:
        for head in heads:
            head.request = None
        if cap is not None:
            model.config.final_logit_softcapping = cap
