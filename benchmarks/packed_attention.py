"""Packed SFT attention per step at seq 2048 on this machine's CPU: the dense mask vs the default.

    python benchmarks/packed_attention.py [--reps 3] [--threads 1] [--seq 2048] [--no-flex] [--out PATH]

One micro-batch row of `--seq` tokens holding several documents, attended as the trainer attends
it (shardwise.train.model.packed_attention):
- dense: transformers' `sdpa_attention_forward` with the collator's additive [1, 1, S, S] mask
  (the stated fallback; with a mask transformers repeats GQA's k/v for SDPA);
- sdpa_varlen: the CPU default, one causal SDPA call per document (`sdpa_varlen_forward`), the
  boundaries from `cu_seq_lens_q`, no mask;
- causal: one causal SDPA over the whole row, no documents: what the planner prices the
  document-aware kernels at (an upper bound, the Σ n² of the documents below S²);
- flex (forward only, compiled; torch 2.13 has no FlexAttention backward on CPU): transformers'
  `flex_attention_forward` with the document BlockMask built from the position ids.
Timed: forward + backward of the attention op alone (q, k, v of qwen2.5-0.5b's widths: 14 heads,
2 kv heads, head dim 64, fp32), and a whole tiny-llama training step through the trainer's
`forward_loss_sum` (model + chunked loss, forward + backward) on the collator's real batch for
each path. Best and median of --reps after a warm-up, the paths interleaved. Two document mixes:
the bundled sample data packed into a row (many short documents) and four documents of S/4.

Writes benchmarks/results/packed_attention.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parent / "results" / "packed_attention.json"
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64  # qwen2.5-0.5b's attention (catalog: 896 = 14 × 64, GQA 7:1)


class _Module(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    is_causal, training = True, True
    num_key_value_groups = HEADS // KV_HEADS


def _bundled_lengths(seq: int) -> list[int]:
    """Document lengths of the fullest row the bundled sample data packs into `seq` tokens."""
    from shardwise.config.schema import TrainConfig
    from shardwise.data import build_dataset, load_tokenizer
    from shardwise.run import run_spec
    from shardwise.train.sft_data import data_config

    cfg = TrainConfig.model_validate({"data": {"sft": {"max_length": seq}}})
    ds = build_dataset(data_config(run_spec(cfg, 1, "cpu").config), load_tokenizer())
    best = max(range(len(ds)), key=lambda i: (sum(ds[i]["seq_lens"]), len(ds[i]["seq_lens"])))
    return list(ds[best]["seq_lens"])


def _full(lens: list[int], seq: int) -> list[int]:
    return lens + ([seq - sum(lens)] if sum(lens) < seq else [])  # the collator's padding block


def _dense_mask(lens: list[int], seq: int) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    return torch.zeros(seq, seq).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def attention_paths(lens: list[int], seq: int, flex: bool) -> dict[str, Callable[[], None]]:
    """Each path's forward + backward over fresh leaf q, k, v of one row, and with `flex` the
    forward alone of flex, dense and sdpa_varlen (no grad)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from shardwise.train.model.packed_attention import sdpa_varlen_forward

    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, h, seq, HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    mod, mask, scale = _Module(), _dense_mask(lens, seq), HEAD_DIM ** -0.5
    cu = torch.tensor(np.concatenate(([0], np.cumsum(lens))), dtype=torch.int32)
    fns = {
        "dense": lambda q, k, v: sdpa_attention_forward(mod, q, k, v, mask, scaling=scale)[0],
        "sdpa_varlen": lambda q, k, v: sdpa_varlen_forward(mod, q, k, v, None, scaling=scale, cu_seq_lens_q=cu)[0],
        "causal": lambda q, k, v: sdpa_attention_forward(mod, q, k, v, None, scaling=scale)[0],
    }
    if flex:
        from transformers.integrations.flex_attention import flex_attention_forward
        from transformers.masking_utils import find_packed_sequence_indices, flex_attention_mask

        docs = find_packed_sequence_indices(torch.cat([torch.arange(n) for n in lens])[None])
        block = flex_attention_mask(1, seq, seq, mask_function=lambda b, h, qi, ki: (qi >= ki) & (
            docs[b, qi] == docs[b, ki]))
        flex_fn = lambda q, k, v: flex_attention_forward(mod, q, k, v, block, scaling=scale)[0]  # noqa: E731

    def train_step(fn):
        def go():
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            fn(q, k, v).sum().backward()
        return go

    def forward(fn):
        def go():
            with torch.no_grad():
                fn(q0, k0, v0)
        return go

    paths = {name: train_step(fn) for name, fn in fns.items()}
    if flex:
        paths |= {"flex_forward": forward(flex_fn), "dense_forward": forward(fns["dense"]),
                  "sdpa_varlen_forward": forward(fns["sdpa_varlen"])}
    return paths


def model_paths(lens_rows: list[list[int]], seq: int) -> dict[str, Callable[[], None]]:
    """A whole tiny-llama training micro-batch (forward_loss_sum + backward) on the collator's
    batch of each path: the default (padding-free [1, T], sdpa_varlen) and the dense fallback."""
    from shardwise.config.schema import TrainConfig
    from shardwise.data.labels import IGNORE_INDEX
    from shardwise.run import run_spec
    from shardwise.train.engines.base import forward_loss_sum
    from shardwise.train.model.build import build_model
    from shardwise.train.sft_data import build_sft_split

    rng = np.random.default_rng(0)
    items = []
    for lens in lens_rows:
        ids = rng.integers(3, 2000, size=sum(lens)).astype(np.int64)
        labels = ids.copy()
        for start in np.concatenate(([0], np.cumsum(lens)[:-1])):
            labels[start] = IGNORE_INDEX
        items.append({"input_ids": ids, "labels": labels, "seq_lens": lens})
    paths, weights = {}, None
    for name, packed in (("dense", "dense"), ("sdpa_varlen", "auto")):
        cfg = TrainConfig.model_validate({"model": {"name": "tiny-llama"}, "precision": "fp32",
                                          "data": {"sft": {"max_length": seq, "packed_attention": packed}}})
        run = run_spec(cfg, 1, "cpu")
        model = build_model(run)
        weights = weights or model.state_dict()
        model.load_state_dict(weights)
        batch = build_sft_split(run, "train")[1](items)

        def go(model=model, batch=batch, run=run):
            model.zero_grad(set_to_none=True)
            forward_loss_sum(model, model, batch, torch.device("cpu"), run.train).backward()
        paths[name] = go
    return paths


def timed(paths: dict[str, Callable[[], None]], reps: int) -> dict[str, dict[str, float]]:
    """Best and median wall seconds of each path over `reps`, after a warm-up (a compile), the
    paths interleaved so a busy neighbour slows them alike."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()
    for _ in range(reps):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: {"best_s": min(t), "median_s": statistics.median(t)} for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared box)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per row")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its CPU compile takes ~30 s)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mixes = {"bundled sample data": _bundled_lengths(a.seq), "4 documents of S/4": [a.seq // 4] * 4}
    cases = []
    for label, lens in mixes.items():
        lens = _full(lens, a.seq)
        row = {"documents": label, "seq": a.seq, "lengths": lens,
               "sum_n2_over_s2": sum(n * n for n in lens) / a.seq ** 2,
               "dense_mask_bytes": a.seq ** 2 * 4,
               "attention": timed(attention_paths(lens, a.seq, not a.no_flex), a.reps),
               "model_step": timed(model_paths([lens], a.seq), a.reps)}
        att, step = row["attention"], row["model_step"]
        row["speedup_attention"] = att["dense"]["median_s"] / att["sdpa_varlen"]["median_s"]
        row["speedup_step"] = step["dense"]["median_s"] / step["sdpa_varlen"]["median_s"]
        row["dense_over_causal"] = att["dense"]["median_s"] / att["causal"]["median_s"]
        for part in ("attention", "model_step"):
            for name, t in row[part].items():
                print(f"{label:22s} {part:10s} {name:20s} best {t['best_s'] * 1e3:9.1f} ms  median "
                      f"{t['median_s'] * 1e3:9.1f} ms", flush=True)
        print(f"{label:22s} {len(lens)} documents, Σn²/S² {row['sum_n2_over_s2']:.3f}: dense/sdpa_varlen "
              f"{row['speedup_attention']:.1f}× (attention), {row['speedup_step']:.1f}× (tiny-llama step)", flush=True)
        cases.append(row)
    doc = {
        "what": "one row of `seq` tokens holding several documents; attention = forward + backward of the attention "
                f"op (q, k, v of {HEADS} heads, {KV_HEADS} kv heads, head dim {HEAD_DIM}, fp32; flex_forward and "
                "the *_forward rows: forward only, no grad, as torch 2.13 has no FlexAttention backward on CPU); "
                "model_step = tiny-llama forward_loss_sum + backward on the collator's batch of each path; best and "
                "median wall seconds over reps after a warm-up, the paths interleaved. dense: the additive [1, 1, S, S] "
                "mask; sdpa_varlen: the CPU default (one causal SDPA call per document); causal: one causal SDPA over "
                "the row (what the planner prices the document-aware kernels at)",
        "script": "benchmarks/packed_attention.py",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "config": {"seq": a.seq, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "reps": a.reps,
                   "flex": not a.no_flex},
        "cases": cases,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
