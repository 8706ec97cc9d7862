"""Learning-rate schedules (shapes, not copied numbers) and launcher detection."""

from __future__ import annotations

import itertools
import math

import pytest

from shardwise.train.launch import detect_env
from shardwise.train.schedule import lr_at

PEAK, TOTAL, WARM = 1e-3, 100, 10


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "warmup_decay"])
def test_warmup_is_linear_and_reaches_peak(kind):
    lrs = [lr_at(s, peak=PEAK, total=TOTAL, kind=kind, warmup=WARM) for s in range(WARM)]
    assert lrs[0] == pytest.approx(PEAK / WARM) and lrs[-1] == pytest.approx(PEAK)
    assert all(b - a == pytest.approx(PEAK / WARM) for a, b in itertools.pairwise(lrs))


def test_decay_shapes():
    def at(kind, s, **kw):
        return lr_at(s, peak=PEAK, total=TOTAL, kind=kind, warmup=WARM, **kw)
    mid = WARM + (TOTAL - WARM) // 2
    assert at("cosine", mid) == pytest.approx(PEAK / 2)  # cos(pi/2) = 0: half way
    assert at("linear", mid) == pytest.approx(PEAK / 2)
    assert at("cosine", TOTAL, min_ratio=0.1) == pytest.approx(0.1 * PEAK)
    assert at("constant", TOTAL - 1) == PEAK
    # WarmupDecayLR: linear to zero at the last step.
    assert at("warmup_decay", TOTAL) == 0.0
    cos = [at("cosine", s) for s in range(WARM, TOTAL)]
    assert all(b <= a for a, b in itertools.pairwise(cos)) and not math.isnan(sum(cos))


def test_detect_launchers():
    assert detect_env({}) is None
    tr = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"})
    assert tr == {"launcher": "torchrun", "rank": 3, "world_size": 8, "local_rank": 1}
    assert detect_env({"RANK": "0", "WORLD_SIZE": "2", "DEEPSPEED_RANK": "0"})["launcher"] == "deepspeed"
    srun = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"})
    assert srun == {"launcher": "srun", "rank": 5, "world_size": 16, "local_rank": 1}
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # an allocation, not a launch
