"""The prefetch thread (shardwise.train.data.Prefetcher): the next steps' batches are read,
collated and counted off the training thread.

- its error surfaces on the training thread with its own type and message (a note names the
  step), a source that ends early names the step, `close` stops it (or leaves a daemon behind
  when it is stuck inside the source);
- a run resumed while the thread was ahead of the checkpoint continues bit for bit (the bundled
  SFT data through the sampler): the data position is the step count, never how far it read.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from one_rank import loop_config, train_one_rank


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardwise-prefetch" and t.is_alive()]


def _steps_then(n_good: int, error: BaseException | None):
    from shardwise.train.data import SyntheticSource, contiguous_indices, iter_steps
    from shardwise.train.engines.base import DistEnv

    ds = SyntheticSource(loop_config(Path("unused"), 1).data.synthetic, 256)
    good = iter_steps(ds, contiguous_indices(len(ds), DistEnv(), 4), 2, 2)
    for _ in range(n_good):
        yield next(good)
    if error is not None:
        raise error


def test_a_producer_error_surfaces_on_the_training_thread(tmp_path):
    with pytest.raises(ValueError) as info:
        train_one_rank(loop_config(tmp_path, every=1, steps=6), steps=_steps_then(2, ValueError("row 17 of train.jsonl is broken")))
    assert str(info.value) == "row 17 of train.jsonl is broken"  # the message as raised; where, in a note
    assert "raised while preparing the batches of step 3, on the prefetch thread" in "".join(info.value.__notes__)
    time.sleep(0.2)
    assert not _prefetch_threads()


def test_a_source_that_ends_early_names_the_step(tmp_path):
    with pytest.raises(RuntimeError, match=r"the batch source ended before step 3 \(it gave 2 of the 4 steps"):
        train_one_rank(loop_config(tmp_path, every=1, steps=4), steps=_steps_then(2, None))


def test_close_stops_the_thread_blocked_on_a_full_queue_or_inside_the_source():
    from shardwise.train.data import Prefetcher

    p = Prefetcher(_steps_then(100, None), first=1, count=100)
    assert p.next().step == 1
    time.sleep(0.2)  # the thread fills the queue and blocks
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 1.0 and not p._thread.is_alive()

    def slow():
        yield from _steps_then(1, None)
        time.sleep(30)  # a source stuck reading
        yield []

    p = Prefetcher(slow(), first=1, count=5)
    p.next()
    t0 = time.monotonic()
    p.close(timeout_s=0.5)  # gives up waiting: the thread is a daemon, the process can still exit
    assert time.monotonic() - t0 < 2.0 and p._thread.daemon


def test_resume_is_bit_exact_with_the_producer_ahead_of_the_checkpoint(tmp_path, monkeypatch):
    """SFT data (the bundled sample through the sampler): 8 steps straight, and 3 then a resume.
    The step-3 save waits until the prefetch thread has read rows past step 5: the checkpoint's
    position is the step count, never how far the thread read."""
    import shardwise.train.checkpoint.sharded as ckpt
    import shardwise.train.data as data
    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name

    pulled = {"n": 0}
    at_save: dict[int, int] = {}
    real_source, real_save = data.build_source, ckpt.save_checkpoint

    def counting_source(*args, **kwargs):
        for micro in real_source(*args, **kwargs):
            pulled["n"] += 1
            yield micro

    def save_when_ahead(engine, state, *args, **kwargs):
        deadline = time.monotonic() + 10
        while state.step == 3 and pulled["n"] < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        at_save[state.step] = pulled["n"]
        return real_save(engine, state, *args, **kwargs)

    monkeypatch.setattr(data, "build_source", counting_source)
    monkeypatch.setattr(ckpt, "save_checkpoint", save_when_ahead)
    full = train_one_rank(loop_config(tmp_path / "full", every=4, steps=8, data="sft", save_every=3), export_weights=True)
    assert at_save[3] >= 6, at_save  # the loop had taken steps 1-4; the thread had read 5 and 6 too
    pulled["n"] = 0
    resumed = train_one_rank(loop_config(tmp_path / "resumed", every=4, steps=8, data="sft", save_every=3), export_weights=True,
                     resume=checkpoints_dir(tmp_path / "full") / step_dir_name(3))
    assert resumed.start_step == 3
    assert [r.loss for r in resumed.records] == [r.loss for r in full.records][3:]
    assert [r.grad_norm for r in resumed.records] == [r.grad_norm for r in full.records][3:]
    assert full.final_weights.keys() == resumed.final_weights.keys()
    for k, v in full.final_weights.items():
        assert torch.equal(v, resumed.final_weights[k]), k
