"""Validation: `run.eval_every_steps` evaluates the validation split.

The runs (tests/train/validation_worker.py): tiny Llama, fp32, the bundled SFT sample with
`validation_fraction` 0.25 (61 packed rows of at most 64 tokens, 1185 target tokens), global
batch 4, 4 steps, an evaluation every 2 steps. The eval loss must be the same within 1e-6
(relative) on ddp, zero2, zero3 and fsdp on 2 ranks and on 1 rank, and equal what one process
computes with the plain HF model on the same weights, document by document.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import run_once

from shardwise.errors import ShardwiseError
from shardwise.train.engines.base import DistEnv

HERE = Path(__file__).parent
WORKER = HERE / "validation_worker.py"
STRATEGIES = ["ddp", "zero2", "zero3", "fsdp"]
RTOL = 1e-6


@pytest.fixture(scope="module")
def runs(shared_dir):
    return run_once(shared_dir / "validation", WORKER,
                    [([*STRATEGIES, "ddp:part", "ddp:best"], 2, 400), (["ddp", "fsdp", "ddp:part"], 1, 300)])


def load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=False)


def validation_rows():
    """The validation split built directly by the data pipeline (no trainer code involved)."""
    from validation_worker import validation_config

    from shardwise.data import build_dataset, load_tokenizer
    from shardwise.train.sft_data import data_config, resolved_tokenizer_path

    cfg = validation_config("ddp", 1, Path("unused"))
    tok = load_tokenizer(resolved_tokenizer_path(cfg))
    ds = build_dataset(data_config(cfg), tok, split="validation")
    return cfg, [ds[i] for i in range(len(ds))]


def reference_eval_loss(weights: dict[str, torch.Tensor], rows: list | None = None) -> tuple[float, int]:
    """One process, the plain HF model with `weights`: every document of every validation row
    alone (batch 1, no mask, positions from 0), token_loss_sum summed, over the target count."""
    from shardwise.run import run_spec
    from shardwise.train.engines.base import token_loss_sum
    from shardwise.train.model.build import build_model

    cfg, all_rows = validation_rows()
    rows = all_rows if rows is None else rows
    model = build_model(run_spec(cfg, 1, "cpu"))
    model.load_state_dict(weights)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            start = 0
            for n in row["seq_lens"]:
                ids = torch.as_tensor(row["input_ids"][start:start + n])[None]
                labels = torch.as_tensor(row["labels"][start:start + n])[None]
                start += n
                logits = model(input_ids=ids).logits
                total += float(token_loss_sum(logits, labels).double())
                count += int((labels != -100).sum())
    return total / count, count


def test_split_sizes_are_what_the_runs_need():
    _, rows = validation_rows()
    assert len(rows) == 61
    assert sum(int((torch.as_tensor(r["labels"]) != -100).sum()) for r in rows) == 1185


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eval_loss_same_on_every_strategy_and_world_size(runs, strategy):
    ref = load(runs, "ddp-w1")["evals"]
    run = load(runs, f"{strategy}-w2")["evals"]
    assert [e["step"] for e in run] == [e["step"] for e in ref] == [2, 4]
    assert [e["eval_tokens"] for e in run] == [1185, 1185]  # the whole split, every target once
    for a, b in zip(run, ref, strict=True):
        assert abs(a["eval_loss"] - b["eval_loss"]) / b["eval_loss"] < RTOL, (a, b)
        assert a["eval_ppl"] == pytest.approx(math.exp(a["eval_loss"]), rel=1e-12)
    assert run[1]["eval_loss"] < run[0]["eval_loss"]  # training moved the model: two different points


def test_fsdp_on_one_rank_and_a_prefix_of_the_split(runs):
    ref = load(runs, "ddp-w1")["evals"]
    for name in ("fsdp-w1",):
        for a, b in zip(load(runs, name)["evals"], ref, strict=True):
            assert abs(a["eval_loss"] - b["eval_loss"]) / b["eval_loss"] < RTOL
    # run.eval_batches 3: the first 3 global batches (12 rows) of the split, on 1 and 2 ranks
    one, two = load(runs, "ddp-part-w1")["evals"], load(runs, "ddp-part-w2")["evals"]
    _, rows = validation_rows()
    want = sum(int((torch.as_tensor(r["labels"]) != -100).sum()) for r in rows[:12])
    assert [e["eval_tokens"] for e in one] == [e["eval_tokens"] for e in two] == [want, want]
    assert want < 1185
    for a, b in zip(two, one, strict=True):
        assert abs(a["eval_loss"] - b["eval_loss"]) / b["eval_loss"] < RTOL


@pytest.mark.parametrize("name", ["ddp-w1", "zero3-w2", "fsdp-w2", "ddp-part-w2"])
def test_final_eval_equals_a_single_process_reference(runs, name):
    """The last evaluation is of the final weights: recompute it by hand from them."""
    run = load(runs, name)
    _, rows = validation_rows()
    loss, count = reference_eval_loss(run["weights"], rows[:12] if "part" in name else None)
    last = run["evals"][-1]
    assert last["step"] == 4 and last["eval_tokens"] == count
    assert abs(last["eval_loss"] - loss) / loss < RTOL, (last["eval_loss"], loss)


def test_eval_records_in_metrics_summary_and_tensorboard(runs):
    out = runs / "ddp-w2"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    steps = [r for r in rows if r.get("kind") != "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [2, 4]
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4, 4]  # each eval right after its step's record
    result = load(runs, "ddp-w2")["evals"]
    for r, e in zip(evals, result, strict=True):
        assert set(r) >= {"step", "eval_loss", "eval_ppl", "eval_tokens"}
        assert r["eval_loss"] == e["eval_loss"] and r["eval_tokens"] == 1185
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert summary["best_eval_loss"] == min(r["eval_loss"] for r in evals)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tb = [(s.step, s.value) for s in acc.Scalars("eval/loss")]
    assert [s for s, _ in tb] == [2, 4]
    assert [v for _, v in tb] == pytest.approx([r["eval_loss"] for r in evals], rel=1e-6)


def test_save_best_keeps_the_best_checkpoint_beside_keep_last(runs):
    """ddp:best: lr 0.5 without clipping overshoots, so the eval loss is lowest after step 1;
    an evaluation every step, each saves; keep_last 1 keeps step 6, save_best keeps step 1."""
    from shardwise.train.checkpoint.sharded import read_manifest

    out = runs / "ddp-best-w2"
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [1, 2, 3, 4, 5, 6]
    best = min(evals, key=lambda r: r["eval_loss"])
    assert best["step"] < 5, "the test needs a best step that keep_last alone would prune"
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == [f"step-{best['step']:08d}", "step-00000006"]
    record = json.loads((ckpts / "best.json").read_text())
    assert record["step"] == best["step"] and record["eval_loss"] == best["eval_loss"]
    assert read_manifest(ckpts / f"step-{best['step']:08d}")["step"] == best["step"]
    assert load(runs, "ddp-best-w2")["best_step"] == best["step"]
    assert json.loads((out / "summary.json").read_text())["best_eval_loss"] == best["eval_loss"]


def test_prune_protects_only_the_named_step(tmp_path):
    """`_publish`'s pruning with `protect`: without it keep_last 1 deletes step 1 too."""
    from shardwise.train.checkpoint.directory import MANIFEST, published

    root = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        d = root / f"step-{s:08d}"
        d.mkdir(parents=True)
        (d / MANIFEST).write_text(json.dumps({"lineage": None}))
    from shardwise.train.checkpoint import sharded as ckpt

    # exercise the real pruning loop through _publish on a fourth checkpoint
    tmp = root / ".tmp-step-00000004"
    tmp.mkdir()
    (tmp / ".metadata").write_bytes(b"x")  # _publish hashes DCP's index
    state = ckpt.TrainerState(step=4, samples_consumed=0, global_batch=1, train_time_s=0.0)
    ckpt._publish(tmp, root / "step-00000004", root, state, gathered=[], config={}, strategy="ddp", world=1,
                  lineage=None, keep_last=1, publish=lambda a, b: a.rename(b), protect=2)
    assert [s for s, _ in published(root)] == [2, 4]


def test_eval_layout_covers_every_row_once_on_any_world_size():
    from shardwise.train.data import eval_layout

    for n, micro in ((61, 2), (61, 4), (12, 1), (5, 3)):
        for world in (1, 2, 3):
            per_rank = [eval_layout(n, DistEnv(rank=r, world_size=world), micro) for r in range(world)]
            rounds = {len(p) for p in per_rank}
            assert len(rounds) == 1  # the same number of forwards on every rank (collectives)
            rows = [i for p in per_rank for batch in p for i in batch if i is not None]
            assert sorted(rows) == list(range(n))


def test_preflight_refuses_eval_without_a_validation_split():
    from shardwise.config.schema import TrainConfig
    from shardwise.train.preflight import check_eval, preflight

    base = {"run": {"eval_every_steps": 5, "device": "cpu"}, "model": {"name": "tiny-llama"}}
    with pytest.raises(ShardwiseError, match=r"run.eval_every_steps = 5 needs a validation split.*"
                                              r"data.sft.validation_fraction"):
        preflight(TrainConfig.model_validate(base), 1, "cpu")
    with pytest.raises(ShardwiseError, match=re.escape("data.kind 'synthetic' has none")):
        check_eval(TrainConfig.model_validate(base | {"data": {"kind": "synthetic"}}))
    with pytest.raises(ShardwiseError, match=re.escape("checkpointing.save_best = 'eval_loss' needs evaluations")):
        check_eval(TrainConfig.model_validate({"checkpointing": {"save_best": "eval_loss"},
                                               "data": {"sft": {"validation_fraction": 0.1}}}))
    with pytest.raises(ShardwiseError, match="validation_files"):
        check_eval(TrainConfig.model_validate(base | {"data": {"sft": {"validation_files": ["/nonexistent/v.jsonl"]}}}))
    check_eval(TrainConfig.model_validate(base | {"data": {"sft": {"validation_fraction": 0.1}}}))  # accepted
