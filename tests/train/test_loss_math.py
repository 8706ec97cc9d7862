"""Loss normalisation in-process: the loop's `world / global_targets` scaling reproduces the
single-batch gradient, and the per-rank mean (the accumulation bug) measurably does not —
so the parity test's unequal masks can catch it."""

from __future__ import annotations

import torch

from shardwise.config.schema import SyntheticData, TrainConfig
from shardwise.data.labels import count_target_tokens
from shardwise.run import run_spec
from shardwise.train.data import SyntheticSource, stack
from shardwise.train.engines.base import model_inputs, token_loss_sum
from shardwise.train.model.build import build_model


def _grads(model, batches, scales):
    model.zero_grad(set_to_none=True)
    for b, s in zip(batches, scales, strict=True):
        logits = model(**model_inputs(b, torch.device("cpu"))).logits
        (token_loss_sum(logits, b["labels"]) * s).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_global_token_normalisation_matches_full_batch():
    torch.set_num_threads(1)
    cfg = TrainConfig.model_validate({"model": {"name": "tiny-llama", "attention": "eager"}, "run": {"seed": 0}})
    model = build_model(run_spec(cfg, 1, "cpu"))
    src = SyntheticSource(SyntheticData(samples=4, seq_len=32, seed=7), vocab_size=2048)
    full = stack([src[i] for i in range(4)])
    halves = [stack([src[0], src[1]]), stack([src[2], src[3]])]
    counts = [count_target_tokens(h) for h in halves]
    assert counts[0] != counts[1], "the check needs unequal target counts per 'rank'"
    n = sum(counts)
    reference = _grads(model, [full], [1.0 / n])
    # Two ranks: each scales by world / global count, the backend averages (÷ world).
    ours = _grads(model, halves, [2 / n, 2 / n]) / 2
    per_rank_mean = _grads(model, halves, [1 / counts[0], 1 / counts[1]]) / 2
    def rel(g):
        return float((g - reference).norm() / reference.norm())
    assert rel(ours) < 1e-6
    assert rel(per_rank_mean) > 1e-3  # what a per-micro-batch/per-rank mean would train on
