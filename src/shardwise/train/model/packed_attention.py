"""Packed documents without a dense mask: which attention keeps them apart, and its kernels.

`data.sft.packed_attention` (auto | varlen | flex | dense) says how the documents packed into one
row (and an unpacked row's padding) are kept from attending to each other. Except under `dense`,
the collator hands the micro-batch over padding-free, flattened to [1, T] (shardwise.data.collate,
mask="varlen": `position_ids` restarting at 0 per document, `cu_seq_lens_q/k`, `max_length_q/k`),
and no [B, 1, S, S] tensor is built. What runs (`TrainSpec.packed_attention`, planned as run):

- flash_varlen: flash-attn's varlen kernel (transformers' `flash_attention_2` reads the
  boundaries from `cu_seq_lens_q/k`), where flash-attn is installed, on CUDA, in 16-bit.
- flex: FlexAttention with a document BlockMask (transformers' `flex_attention` builds it from
  the position ids: `masking_utils.find_packed_sequence_indices`), compiled, on CUDA. A compile
  failure falls back to sdpa_varlen with one warning and the plan re-priced (`flex_forward`).
- sdpa_varlen: one causal SDPA call per document (`sdpa_varlen_forward`), any device. Ours:
  no library kernel trains packed documents on CPU (flash-attn is CUDA-only, and torch 2.13's
  FlexAttention refuses backward there: "FlexAttention does not support backward on CPU").
- dense: the additive [B, 1, S, S] mask and `model.attention`'s kernel: the stated fallback for
  eager attention (asked for, or Gemma2 and MPT, which have no SDPA path) or when asked for.
  The kernel computes the full S² and the mask costs B·S²·c bytes (both planned).

`shardwise.run.resolve.packed_attention` (torch-free) decides once, in the run bridge, for the plan and
for the build.
"""

from __future__ import annotations

import os
import sys
import weakref
from itertools import pairwise
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.numfmt import rate
from shardwise.train.model.compile import is_compile_error

SDPA_VARLEN, FLEX = "shardwise_sdpa_varlen", "shardwise_flex"
IMPLEMENTATIONS = {"flash_varlen": "flash_attention_2", "sdpa_varlen": SDPA_VARLEN, "flex": FLEX}


def implementation(run: Any) -> str | None:
    """The `attn_implementation` that runs the run's packed attention (None: `model.attention`'s,
    i.e. no packed documents, or the dense mask). Registers shardwise's functions first."""
    name = IMPLEMENTATIONS.get(run.train.packed_attention)
    if name is not None:
        register(run)
    return name


def note(run: Any) -> str | None:
    """Preflight's word on packed SFT rows: the dense fallback said once with what it costs, and a
    refusal where the model's class cannot take shardwise's attention functions (a meta-path
    architecture without `_supports_attention_backend` / `_supports_flex_attn`)."""
    from shardwise.plan.activations import attention_kind
    from shardwise.train.model.hf import causal_lm_class

    cfg, kind = run.config, run.train.packed_attention
    if kind == "dense":
        mask = run.train.micro_batch * run.train.seq_len ** 2 * run.train.compute_bytes
        why = ("asked for" if cfg.data.sft.packed_attention == "dense"
               else f"the {attention_kind(run.model, run.train)} attention has no document-aware kernel")
        return (f"{cfg.source}: data.sft.packed_attention: packed rows attend through a dense [B, 1, S, S] mask "
                f"({why}): {mask / 2**20:,.0f} MiB per micro-batch and the full S² attention, both planned")
    if kind in ("sdpa_varlen", "flex") and run.model.inventory is not None:
        cls = causal_lm_class(run.model.inventory.model_type)
        need = "_supports_flex_attn" if kind == "flex" else "_supports_attention_backend"
        if cls is not None and not getattr(cls, need, False):
            raise ShardwiseError(
                f"{cfg.source}: data.sft.packed_attention {cfg.data.sft.packed_attention!r} runs {kind}, but "
                f"{cls.__name__} does not take it ({need} is False); set data.sft.packed_attention: dense")
    return None


_STATE: dict[str, Any] = {"fallback": False, "warned": False, "run": None}


def register(run: Any = None) -> None:
    """Make `shardwise_sdpa_varlen` and `shardwise_flex` known to transformers (idempotent).
    No mask function for sdpa_varlen: transformers then builds no mask at all for it."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if "sdpa_varlen" not in _STATE:
        _STATE["sdpa_varlen"] = torch.compiler.disable(sdpa_varlen_forward)
    AttentionInterface.register(SDPA_VARLEN, _STATE["sdpa_varlen"])
    AttentionInterface.register(FLEX, flex_forward)
    AttentionMaskInterface.register(FLEX, flex_mask)
    if run is not None:
        _STATE["run"] = run


_DOCS: dict[str, Any] = {"ref": None, "docs": None}  # the last boundaries, per forward (one read)


def documents(rows: int, width: int, cu_seq_lens: Any, position_ids: Any) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document, in order, covering each row: from the collator's
    `cu_seq_lens_q` for one flattened row, else where `position_ids` restart at 0. Read to the
    host once per forward (every layer gets the same tensor)."""
    src = cu_seq_lens if cu_seq_lens is not None and rows == 1 else position_ids
    if src is None:
        raise ValueError("packed attention: neither cu_seq_lens_q nor position_ids reached the attention; "
                         "the model does not pass the documents' boundaries to its attention function")
    ref = _DOCS["ref"]
    if ref is not None and ref() is src:
        return _DOCS["docs"]
    if src is cu_seq_lens:
        b = [int(x) for x in cu_seq_lens.tolist()]
        docs = [(0, x, y) for x, y in pairwise(b) if y > x]
        if b[0] != 0 or b[-1] != width:
            raise ValueError(f"packed attention: cu_seq_lens_q {b[:4]}... does not cover the {width} tokens")
    else:
        pos = position_ids.expand(rows, -1).tolist()
        docs = []
        for r, p in enumerate(pos):
            starts = [i for i, v in enumerate(p) if v == 0]
            if starts[:1] != [0]:
                raise ValueError(f"packed attention: row {r}'s position_ids do not start at 0")
            docs += [(r, x, y) for x, y in pairwise([*starts, width])]
    _DOCS.update(ref=weakref.ref(src), docs=docs)
    return docs


def _window_mask(n: int, window: int | None, device: Any) -> Any:
    """A sliding-window layer's mask for a document longer than the window (True = attend):
    causal and q − kv < window, as transformers' sliding_window_overlay; None: plain causal."""
    if window is None or n <= window:
        return None
    import torch

    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return ((d >= 0) & (d < window))[None, None]


def sdpa_varlen_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any = None,
                        dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                        **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function signature: one causal SDPA call per document of each row
    (transformers' own `sdpa_attention_forward`: GQA, scaling and dropout as for `sdpa`), the
    outputs concatenated. Registered outside torch.compile (a graph break in a compiled layer):
    the documents' count and lengths change every batch."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"packed attention 'sdpa_varlen' does not apply {name}; set "
                                      "data.sft.packed_attention: dense")
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        raise ValueError("packed attention 'sdpa_varlen' takes the documents' boundaries, not a mask or a cache")
    rows, width = query.shape[0], query.shape[2]
    outs = []
    for r, a, b in documents(rows, width, kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")):
        mask = _window_mask(b - a, sliding_window, query.device)
        out, _ = sdpa_attention_forward(module, query[r:r + 1, :, a:b], key[r:r + 1, :, a:b], value[r:r + 1, :, a:b],
                                        mask, dropout=dropout, scaling=scaling, is_causal=mask is None)
        outs.append(out)  # [1, n, heads, d]: the layout transformers' attention functions return
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out.view(rows, width, *out.shape[2:]), None


def flex_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' FlexAttention mask (a document BlockMask, compiled), or None once FlexAttention
    has fallen back (`flex_forward` then runs sdpa_varlen)."""
    from transformers.masking_utils import flex_attention_mask

    if not _STATE["fallback"]:
        try:
            return flex_attention_mask(*args, **kwargs)
        except Exception as e:
            if not is_compile_error(e):
                raise
            _fall_back(e, "building the document BlockMask")
    return None


def flex_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' compiled FlexAttention; a compile error (dynamo, inductor, the C++/CUDA
    compiler) switches this process to sdpa_varlen from that call on, with one warning."""
    from transformers.integrations.flex_attention import flex_attention_forward

    if not _STATE["fallback"]:
        try:
            return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
        except Exception as e:
            if not is_compile_error(e):
                raise
            _fall_back(e, "compiling flex_attention")
    return _STATE["sdpa_varlen"](module, query, key, value, None, **kwargs)


def _fall_back(e: BaseException, where: str) -> None:
    from shardwise.train.model.compile import compile_error_summary

    _STATE["fallback"] = True
    if _STATE["warned"]:
        return
    _STATE["warned"] = True
    msg = (f"shardwise: rank {os.environ.get('RANK', '0')}: FlexAttention failed while {where} "
           f"({compile_error_summary(e)}); packed documents are attended by one SDPA call per document from here, "
           "still without a dense mask (set data.sft.packed_attention: varlen to skip FlexAttention)")
    if _STATE["run"] is not None:
        msg += f"; {replanned_without_flex(_STATE['run'])}"
    print(msg, file=sys.stderr, flush=True)


def replanned_without_flex(run: Any) -> str:
    """The plan of this run with sdpa_varlen instead of FlexAttention: what the fallback costs."""
    from shardwise.plan.evaluate import evaluate
    from shardwise.specs.hardware import GIB

    was = evaluate(run.model, run.hardware, run.train, run.strategy)
    now = evaluate(run.model, run.hardware, run.train.model_copy(update={"packed_attention": "sdpa_varlen"}),
                   run.strategy)
    return (f"re-planned with one SDPA call per document: {rate(now.time.tokens_per_s_per_gpu)} tokens/s per GPU and "
            f"{now.memory.gpu.total / GIB:.1f} GiB (FlexAttention: {rate(was.time.tokens_per_s_per_gpu)} and "
            f"{was.memory.gpu.total / GIB:.1f} GiB)")
