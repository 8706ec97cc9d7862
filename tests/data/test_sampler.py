"""Deterministic distributed sampler: equal shards, seeded epochs, exact resume."""

from __future__ import annotations

import itertools

import pytest

from shardwise.data import ResumableDistributedSampler as Sampler
from shardwise.errors import ShardwiseError


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 10, 13])
@pytest.mark.parametrize("drop_last", [False, True])
def test_equal_shards_cover_the_data(world, n, drop_last):
    if drop_last and n < world:
        with pytest.raises(ShardwiseError, match="cannot feed"):
            Sampler(n, num_replicas=world, drop_last=drop_last)
        return
    shards = [list(Sampler(n, num_replicas=world, rank=r, seed=7, drop_last=drop_last)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank steps the same number of times
    assert len(shards[0]) == len(Sampler(n, num_replicas=world, drop_last=drop_last))
    seen = [i for s in shards for i in s]
    if drop_last:
        assert len(seen) == len(set(seen)) == (n // world) * world  # no repeats, tail dropped
    else:
        assert set(seen) == set(range(n))  # nothing lost
        assert len(seen) - n < world  # padding repeats fewer than `world` samples


def test_epochs_are_seeded_and_differ():
    a, b = Sampler(50, seed=1), Sampler(50, seed=1)
    assert list(a) == list(b)  # same seed, same first epoch
    assert a.epoch == 1  # exhausting an epoch moves to the next
    assert list(a) != Sampler(50, seed=1).indices(0)  # next epoch reshuffles
    assert Sampler(50, seed=2).indices(0) != Sampler(50, seed=1).indices(0)
    assert Sampler(5, shuffle=False).indices(3) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stop", [0, 3, 9])  # 9 < 37 // 4: mid-epoch on every world size
def test_resume_gives_exactly_the_remaining_order(world, stop):
    for rank in range(world):
        ref = Sampler(37, num_replicas=world, rank=rank, seed=5)
        ref.set_epoch(2)
        uninterrupted = list(ref) + list(ref)  # rest of epoch 2 and all of epoch 3

        run = Sampler(37, num_replicas=world, rank=rank, seed=5)
        run.set_epoch(2)
        it = iter(run)
        consumed = list(itertools.islice(it, stop))
        state = run.state_dict()  # "crash" here

        fresh = Sampler(37, num_replicas=world, rank=rank, seed=5)
        fresh.load_state_dict(state)
        fresh.set_epoch(state["epoch"])  # the trainer's usual call must not rewind
        assert consumed + list(fresh) + list(fresh) == uninterrupted


def test_resume_with_read_ahead_uses_consumed_count():
    s = Sampler(20, seed=3)
    it = iter(s)
    taken = [next(it) for _ in range(8)]  # a DataLoader read 8 ahead; training used only 5
    fresh = Sampler(20, seed=3)
    fresh.load_state_dict(s.state_dict(consumed=5))
    assert taken[:5] + list(fresh) == Sampler(20, seed=3).indices(0)


def test_state_at_epoch_end_resumes_into_next_epoch():
    s = Sampler(9, seed=4)
    list(s)
    fresh = Sampler(9, seed=4)
    fresh.load_state_dict(s.state_dict())
    assert list(fresh) == Sampler(9, seed=4).indices(1)


def test_mismatched_state_is_refused():
    state = Sampler(10, seed=1, num_replicas=2).state_dict()
    with pytest.raises(ShardwiseError, match="field 'seed'"):
        Sampler(10, seed=2, num_replicas=2).load_state_dict(state)
    with pytest.raises(ShardwiseError, match="field 'dataset_len'"):
        Sampler(11, seed=1, num_replicas=2).load_state_dict(state)
    with pytest.raises(ShardwiseError, match="field 'rank'"):
        Sampler(10, num_replicas=2, rank=2)


def test_works_as_a_dataloader_sampler(tok):
    import torch

    from shardwise.config.data import DataConfig
    from shardwise.data import SFTCollator, build_dataset, sample_data_path

    ds = build_dataset(DataConfig(train_files=[str(sample_data_path())], max_length=256), tok)
    sampler = Sampler(ds, num_replicas=2, rank=1, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=SFTCollator(
        tok.pad_token_id, pad_to=256))
    batches = list(loader)
    assert len(batches) == -(-len(sampler) // 4)
    assert batches[0]["input_ids"].shape == (4, 256)
