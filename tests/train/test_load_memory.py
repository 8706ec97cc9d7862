"""Host memory of the weight load at real size, on 2 gloo CPU ranks (tests/train/load_rss_worker.py):
each rank's peak RSS once the weights are in, against the planner's load phase
(shardwise.plan.load via shardwise.train.model.weights.planned_load) and one fp32 copy of the model.

- LoRA of a 1.36B-parameter Llama (random bf16 weights, 6 safetensors shards of 500 MB, made by
  tests/train/big_checkpoint.py and cached in pytest's cache) under ZeRO-3: within 25% of the plan
  and below 45% of one fp32 copy per rank (the whole-model path this replaced held more than one
  fp32 copy per rank: 5.5 GB);
- full fine-tuning of a 134M Llama under FSDP2 (the sharded path): within 25% of the plan.
Each run also trains one step (a finite loss): the loaded model is the one that trains. The same
1.36B LoRA under FSDP2 runs through `shardwise train` itself, its whole peak against the plan under
a memory cap (tests/train/test_real_size_cli.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from big_checkpoint import make_checkpoint  # noqa: E402
from conftest import run_once  # noqa: E402

CASES = [("llama-1.36b", "zero3", "lora"), ("llama-134m", "fsdp", "full")]


@pytest.fixture(scope="module")
def checkpoints(request) -> Path:
    return Path(request.config.cache.mkdir("shardwise-checkpoints"))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_peak_host_memory_of_the_load(checkpoints, tmp_path, case):
    name, strategy, mode = case
    ckpt = make_checkpoint(checkpoints, name)  # once per cache, whichever xdist worker comes first
    out = run_once(tmp_path / "run", HERE / "load_rss_worker.py", [([f"{ckpt}:{strategy}:{mode}"], 2, 600)])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        planned, measured = r["plan"]["per_rank"], r["loaded_rss"]
        assert r["plan"]["path"] == ("zero3" if strategy == "zero3" else "sharded")
        assert abs(measured / planned - 1) <= 0.25, (measured, r["plan"])
        if mode == "lora":
            fp32_copy = 4 * r["params"]
            assert measured < 0.45 * fp32_copy, (measured, fp32_copy)
        assert r["finite"], r["loss"]


def test_chunk_constant_is_the_planners():
    from shardwise.plan.load import ZERO3_CHUNK_BYTES
    from shardwise.train.model.weights import ZERO3_CHUNK_BYTES as TRAINER

    assert ZERO3_CHUNK_BYTES == TRAINER
