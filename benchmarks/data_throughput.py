"""Data pipeline throughput vs. training throughput on this machine.

    python benchmarks/data_throughput.py [--tokens 10000000] [--max-length 2048] [--out PATH]

1. Replicates the bundled sample dataset to >= --tokens tokens (JSONL in a temp dir).
2. Times build_dataset end to end: read + validate + chat template + tokenise + truncate + pack.
3. Times the collator (4-D isolation mask) over packed micro-batches: the per-step data cost.
4. Times a training step (forward, backward, AdamW; fp32, SDPA, this machine's CPU threads) of
   tiny random Llamas on the same packed batches, with the loss contract (summed token loss /
   target-token count). This is a *proxy* for the trainer: the smallest models train fastest,
   so the reported ratio pipeline/trainer is a lower bound for real models.

Writes benchmarks/results/data_throughput.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.config.data import DataConfig
from shardwise.data import SFTCollator, build_dataset, count_target_tokens, load_tokenizer, sample_data_path

OUT = Path(__file__).resolve().parent / "results" / "data_throughput.json"
MODELS = {  # proxies for the trainer: the test-size Llama and a slightly larger one
    "llama-h64-l2": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2},
    "llama-h256-l4": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                      "num_attention_heads": 8, "num_key_value_heads": 4},
}


def replicate(tokens_wanted: int, tok, workdir: Path, max_length: int) -> tuple[Path, int]:
    lines = sample_data_path().read_text(encoding="utf-8").splitlines()
    one = build_dataset(DataConfig(train_files=[str(sample_data_path())], max_length=max_length), tok)
    copies = math.ceil(tokens_wanted / one.stats.encode.tokens)
    path = workdir / "replicated.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(copies):
            fh.write("\n".join(lines) + "\n")
    return path, copies


def time_pipeline(path: Path, tok, max_length: int) -> tuple[dict, object]:
    t0 = time.perf_counter()
    ds = build_dataset(DataConfig(train_files=[str(path)], max_length=max_length), tok)
    dt = time.perf_counter() - t0
    e = ds.stats.encode
    return {"records": ds.stats.records, "samples": e.samples, "tokens": e.tokens, "target_tokens": e.target_tokens,
            "rows": ds.stats.rows, "packing_efficiency": round(ds.stats.packing_efficiency, 4),
            "seconds": round(dt, 2), "tokens_per_s": round(e.tokens / dt)}, ds  # fmt: skip


def time_collate(ds, tok, max_length: int, micro_batch: int, batches: int) -> dict:
    collate = SFTCollator(tok.pad_token_id, pad_to=max_length)
    n = min(batches, len(ds) // micro_batch)
    times = []
    for b in range(n):
        t0 = time.perf_counter()
        collate([ds[b * micro_batch + k] for k in range(micro_batch)])
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"micro_batch": micro_batch, "batches": n, "median_batch_s": round(med, 4),
            "tokens_per_s": round(micro_batch * max_length / med)}


def time_train(ds, tok, max_length: int, model_kw: dict, steps: int, micro_batch: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=max_length, **model_kw)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    collate = SFTCollator(tok.pad_token_id, pad_to=max_length)
    batches = [collate([ds[(s * micro_batch + k) % len(ds)] for k in range(micro_batch)]) for s in range(steps + 1)]

    def step(batch) -> None:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               ignore_index=-100, reduction="sum") / count_target_tokens(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(batches[0])  # warm-up: allocator, kernels
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)  # the box is shared: the median resists other jobs' bursts
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "steps": steps, "micro_batch": micro_batch, "median_step_s": round(med, 4),
            "tokens_per_s": round(micro_batch * max_length / med)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    load_before = os.getloadavg()[0]  # other jobs on a shared box slow every figure below
    with tempfile.TemporaryDirectory() as tmp:
        path, copies = replicate(args.tokens, tok, Path(tmp), args.max_length)
        pipeline, ds = time_pipeline(path, tok, args.max_length)
    pipeline["copies_of_sample_data"] = copies
    collate = time_collate(ds, tok, args.max_length, micro_batch=8, batches=50)
    trainers = {name: time_train(ds, tok, args.max_length, kw, args.train_steps, micro_batch=1)
                for name, kw in MODELS.items()}  # fmt: skip
    fastest = max(t["tokens_per_s"] for t in trainers.values())
    result = {
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "max_length": args.max_length,
        "pipeline_build": pipeline,
        "collate": collate,
        "trainer_proxy": trainers,
        # Preprocessing runs once per run; collation runs every step, so both must outpace training.
        "ratio_build_to_fastest_trainer": round(pipeline["tokens_per_s"] / fastest, 2),
        "ratio_collate_to_fastest_trainer": round(collate["tokens_per_s"] / fastest, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"pipeline: {pipeline['tokens']:,} tokens ({pipeline['samples']:,} samples, {pipeline['rows']:,} rows, "
          f"packing {pipeline['packing_efficiency']:.1%}) in {pipeline['seconds']} s = "
          f"{pipeline['tokens_per_s']:,} tokens/s (read+template+tokenise+pack)")
    print(f"collate:  {collate['tokens_per_s']:,} tokens/s (4-D isolation mask, micro-batch 8 x {args.max_length})")
    for name, t in trainers.items():
        print(f"trainer proxy {name} ({t['params']:,} params, fp32 CPU): {t['tokens_per_s']:,} tokens/s")
    print(f"ratio pipeline/trainer (fastest proxy): build {result['ratio_build_to_fastest_trainer']}x, "
          f"collate {result['ratio_collate_to_fastest_trainer']}x  -> the data path is "
          f"{'not ' if min(result['ratio_build_to_fastest_trainer'], result['ratio_collate_to_fastest_trainer']) > 1 else ''}"
          "the bottleneck")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
