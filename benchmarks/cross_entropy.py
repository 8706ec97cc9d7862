"""The trainer's two cross-entropy implementations, forward + backward, on this machine's CPU.

    python benchmarks/cross_entropy.py [--reps 5] [--threads 1] [--out PATH]

For each shape (tokens, hidden, vocab) and dtype: the loss from the lm_head input h through
backward, as the engines run it (shardwise.train.engines.base.forward_loss_sum):
- standard: logits = h·Wᵀ in the compute dtype, `token_loss_sum` (fp32 upcast of all logits);
- chunked: `shardwise.train.model.loss.linear_cross_entropy_sum` (lm_head + loss per chunk).
Wall time of forward + backward (best and median of --reps, the two interleaved), and the peak of
live tensor bytes (torch's MemTracker, a separate untimed run) minus the inputs h and W, beside
the planner's logits term for the same shape (plan/loss.py `logits_bytes`; the chunked term's
held grad_W and the per-chunk working set; the standard term also counts the c-byte logits
held by an HF-style caller, which the trainer's engines no longer hold through backward).

Shapes: the test-size tiny-llama head (V 2048, H 64) and qwen2.5-0.5b's (V 151936, H 896),
the issue's case. A GPU runs the same kernels; the argument for its speed is in the docstring of
shardwise/train/model/loss.py and the planner's time model (plan/timing.py).

Writes benchmarks/results/cross_entropy.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.catalog import get_model
from shardwise.plan.loss import logits_bytes
from shardwise.specs import TrainSpec
from shardwise.train.engines.base import token_loss_sum
from shardwise.train.model.loss import linear_cross_entropy_sum, shifted_targets

OUT = Path(__file__).resolve().parent / "results" / "cross_entropy.json"
# (label, catalog model whose head it is, micro_batch, seq_len)
SHAPES = [("tiny-llama head", "tiny-llama", 4, 512), ("qwen2.5-0.5b head", "qwen2.5-0.5b", 1, 2048)]
DTYPES = {"fp32": (torch.float32, "fp32"), "bf16": (torch.bfloat16, "bf16-mixed")}
CHUNK = 1024


def inputs(model_name: str, batch: int, seq: int, dtype: torch.dtype, seed: int = 0):
    m = get_model(model_name)
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(batch, seq, m.hidden_size, generator=g) * 0.5).to(dtype).requires_grad_()
    w = torch.nn.Parameter((torch.randn(m.vocab_size, m.hidden_size, generator=g) * 0.02).to(dtype))
    labels = torch.randint(0, m.vocab_size, (batch, seq), generator=g)
    labels[:, : seq // 4] = -100  # a prompt mask
    return h, w, labels


def step(impl: str, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> float:
    h.grad = w.grad = None
    if impl == "standard":
        loss = token_loss_sum(F.linear(h, w), labels)  # the logits are not held through backward
    else:
        loss = linear_cross_entropy_sum(h.reshape(-1, h.size(-1)), w, None, shifted_targets(labels), CHUNK)
    (loss * (1.0 / labels.numel())).backward()
    return float(loss.detach())


def peak_bytes(impl: str, h, w, labels) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    h.grad = w.grad = None
    mt = MemTracker()
    mt.track_external(h, w)
    with mt:
        step(impl, h, w, labels)
    snap = mt.get_tracker_snapshot("peak")
    inputs_ = (h.numel() + w.numel()) * h.element_size()
    return int(sum(v["Total"] for v in snap.values())) - inputs_


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared box)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cases = []
    for label, model_name, batch, seq in SHAPES:
        m = get_model(model_name)
        for dname, (dtype, precision) in DTYPES.items():
            h, w, labels = inputs(model_name, batch, seq, dtype)
            row = {"shape": label, "tokens": batch * seq, "hidden": m.hidden_size, "vocab": m.vocab_size,
                   "dtype": dname, "chunk_tokens": CHUNK}
            grads, times = {}, {"standard": [], "chunked": []}
            for impl in times:  # warm-up
                loss = step(impl, h, w, labels)
                grads[impl] = (loss, h.grad.float().clone(), w.grad.float().clone())
            for _ in range(a.reps):  # interleaved, so a busy neighbour slows both alike
                for impl in times:
                    t0 = time.perf_counter()
                    step(impl, h, w, labels)
                    times[impl].append(time.perf_counter() - t0)
            for impl in times:
                train = TrainSpec(seq_len=seq, micro_batch=batch, precision=precision, cross_entropy=impl,
                                  ce_chunk=CHUNK)
                row[impl] = {"best_s": min(times[impl]), "median_s": statistics.median(times[impl]),
                             "peak_bytes": peak_bytes(impl, h, w, labels),
                             "planned_logits_bytes": logits_bytes(m, train)}
                print(f"{label:18s} {dname:4s} {impl:8s} best {row[impl]['best_s']:8.3f} s  median "
                      f"{row[impl]['median_s']:8.3f} s  peak {row[impl]['peak_bytes'] / 2**20:9.1f} MiB  "
                      f"planned {row[impl]['planned_logits_bytes'] / 2**20:9.1f} MiB", flush=True)
            (ls, hs, ws), (lc, hc, wc) = grads["standard"], grads["chunked"]
            row["speedup_best"] = row["standard"]["best_s"] / row["chunked"]["best_s"]
            row["speedup_median"] = row["standard"]["median_s"] / row["chunked"]["median_s"]
            row["peak_ratio"] = row["chunked"]["peak_bytes"] / row["standard"]["peak_bytes"]
            row["agreement"] = {"loss_rel": abs(lc - ls) / abs(ls),
                                "grad_h_rel": float((hc - hs).abs().max() / hs.abs().max()),
                                "grad_w_rel": float((wc - ws).abs().max() / ws.abs().max())}
            cases.append(row)
            del h, w, labels, grads
    doc = {
        "what": "forward + backward of the loss from the lm_head input (best and median wall seconds over reps, "
                "the two implementations interleaved after a warm-up; peak live tensor bytes minus the inputs h "
                "and W, torch MemTracker) for the trainer's "
                "standard and chunked cross-entropy; planned_logits_bytes = plan/loss.py logits_bytes for the "
                "same shape; agreement = chunked vs standard (max |diff| / max |standard| for the grads)",
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "reps": a.reps, "cases": cases,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
