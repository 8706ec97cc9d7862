"""What the GPU session kit's scripts share: the process group of one rank (CUDA, or CPU for a dry
run) with the result document's header, and each row recorded as it completes, so what is done
survives a timeout."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def start(cpu: bool):
    """(DistEnv, the result document with its header) for one rank on CUDA, or on CPU (`cpu`)."""
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from shardwise.train.launch.rank import init_distributed

    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu for the dry run")
    env = init_distributed("cpu" if cpu else "cuda")
    doc = {"device": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "runs": []}
    return env, doc


def record(doc: dict, row: dict, out: Path) -> None:
    """Append `row` to the document's runs, print it (without its losses) and rewrite `out`."""
    doc["runs"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


def finish(out: Path) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    print(f"wrote {out}")
