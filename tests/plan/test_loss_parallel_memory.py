"""The standard loss over vocabulary shards under DTensor TP is torch's `loss_parallel`, whose
backward holds more than the plain cross-entropy's (plan/loss.py `logits_bytes`): measured here
on CPU under torch's MemTracker, as torchtitan's train loop runs it (the model's logits held by
the caller, `cross_entropy(pred.flatten(0, 1).float(), labels)` and backward inside the context),
on a one-rank gloo mesh: the same DTensor ops a rank runs on its shard of any TP group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.plan.loss import logits_bytes
from shardwise.plan.stage import loss_parallel
from shardwise.specs import ModelSpec, Strategy, TrainSpec

BATCH, SEQ, VOCAB = 2, 256, 4096

MEASURE = f"""
import json, sys, tempfile
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

torch.set_num_threads(1)
dtype, parallel = getattr(torch, sys.argv[1]), sys.argv[2] == "parallel"
store = tempfile.NamedTemporaryFile(delete=False).name
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + store)
mesh = init_device_mesh("cpu", (1,))
g = torch.Generator().manual_seed(0)
out = torch.randn({BATCH}, {SEQ}, {VOCAB}, generator=g).to(dtype).requires_grad_(True)
labels = torch.randint(0, {VOCAB}, ({BATCH}, {SEQ}), generator=g)
mt = MemTracker()
mt.track_external(out)
with mt:
    pred = out * 1.0  # the lm_head output the train loop holds
    if parallel:
        with loss_parallel():
            loss = F.cross_entropy(DTensor.from_local(pred, mesh, [Shard(-1)]).flatten(0, 1).float(),
                                   labels.flatten(0, 1))
            loss.backward()
    else:
        F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1)).backward()
peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
print(json.dumps(peak - out.numel() * out.element_size()))
dist.destroy_process_group()
"""


def _measured(dtype: str, parallel: bool) -> int:
    """Peak live bytes of the loss's forward and backward beyond the lm_head output's producer."""
    done = subprocess.run([sys.executable, "-c", MEASURE, dtype, "parallel" if parallel else "plain"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("parallel", [False, True], ids=["plain", "loss-parallel"])
def test_measured_loss_peak_is_the_planned_logits_term(dtype, parallel):
    model = ModelSpec.from_hf_dict({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2}, name="head")
    train = TrainSpec(micro_batch=BATCH, seq_len=SEQ, cross_entropy="standard",
                      precision="bf16-pure" if dtype == "bfloat16" else "fp32")
    planned = logits_bytes(model, train, 1, loss_parallel=parallel)
    assert _measured(dtype, parallel) == pytest.approx(planned, rel=0.01)


def test_loss_parallel_is_planned_where_torch_runs_it():
    assert loss_parallel(Strategy.from_name("fsdp", tp=8), 8)  # DTensor TP: the trainer's, torchtitan's
    assert not loss_parallel(Strategy.from_name("fsdp"), 1)  # no TP: the plain loss
    # Megatron's vocab-parallel cross-entropy is its own; AutoTP keeps the vocabulary whole
    assert not loss_parallel(Strategy.from_name("zero3", tp=8), 8)
    assert not loss_parallel(Strategy.from_name("zero2", tp=8), 8)
