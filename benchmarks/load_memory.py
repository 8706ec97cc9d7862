"""Host memory of the weight load at real size on 2 CPU ranks, against the plan (issue 22 item 1).

Builds (once, cached) random bf16 Llama checkpoints in 500 MB safetensors shards
(tests/train/big_checkpoint.py), runs tests/train/load_rss_worker.py per case in a fresh pair of
ranks (VmHWM: a process's own lifetime peak) and writes benchmarks/results/load_memory.json;
`--table` prints the markdown table docs/training.md quotes from that file
(tests/accuracy/test_load_memory_doc.py keeps the two equal). The same measurement is asserted, within
25% of the plan, by tests/train/test_load_memory.py.

    python benchmarks/load_memory.py [--cache DIR] [--table]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "load_memory.json"
CASES = [("llama-1.36b", "fsdp", "lora"), ("llama-1.36b", "zero3", "lora"), ("llama-134m", "fsdp", "full")]


def measure(cache: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from big_checkpoint import make_checkpoint

    from shardwise.train.launch.spawn import spawn

    rows = []
    for name, strategy, mode in CASES:
        ckpt = make_checkpoint(cache, name)
        with tempfile.TemporaryDirectory() as out:
            rc = spawn([str(ROOT / "tests" / "train" / "load_rss_worker.py"), "--out", out, "--runs",
                        f"{ckpt}:{strategy}:{mode}"], 2, timeout_s=900, threads_per_rank=1,
                       extra_env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"})
            if rc != 0:
                raise SystemExit(f"{name} {strategy} {mode}: the ranks failed (rc {rc})")
            ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
        rows.append({"model": name, "strategy": strategy, "mode": mode, "params": ranks[0]["params"],
                     "fp32_copy_bytes": 4 * ranks[0]["params"], "planned": ranks[0]["plan"],
                     "measured_peak_bytes": [r["loaded_rss"] for r in ranks], "loss": [r["loss"] for r in ranks]})
    return {"script": "benchmarks/load_memory.py", "ranks": 2, "device": "cpu",
            "checkpoint": "random bf16 weights, 500 MB safetensors shards", "cases": rows}


def table(doc: dict) -> str:
    lines = ["| run | measured peak per rank | planned | one fp32 copy |", "|---|---|---|---|"]
    for c in doc["cases"]:
        size = {"llama-1.36b": "1.36B", "llama-134m": "134M"}[c["model"]]
        what = "LoRA" if c["mode"] == "lora" else "full"
        measured = " / ".join(f"{b / 1e9:.2f}" for b in c["measured_peak_bytes"])
        lines.append(f"| {what}, {size} Llama, {c['strategy']} | {measured} GB | {c['planned']['per_rank'] / 1e9:.2f} GB "
                     f"| {c['fp32_copy_bytes'] / 1e9:.2f} GB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/shardwise/checkpoints"))
    ap.add_argument("--table", action="store_true", help="print the docs table of the committed result")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(RESULT.read_text())))
        return
    doc = measure(Path(args.cache))
    RESULT.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))


if __name__ == "__main__":
    main()
