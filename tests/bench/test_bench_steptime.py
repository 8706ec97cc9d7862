"""The bench's step-time split: interval arithmetic for exposed communication, the wait recorder
on a real (1-rank gloo) collective, and the planner's TimeBreakdown split into the same terms."""

from __future__ import annotations

import threading
import time

import pytest

from shardwise import catalog
from shardwise.bench.steptime import (
    PHASES,
    WaitRecorder,
    exposed_in,
    measured_split,
    predicted_split,
    time_terms,
    union,
)
from shardwise.plan.evaluate import evaluate
from shardwise.plan.timing import forward_share
from shardwise.specs import Strategy, TrainSpec


def test_union_merges_overlaps_and_drops_empty():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]


def test_exposed_is_comm_in_the_window_not_hidden_by_compute():
    comm = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]  # union 0-3 and 5-6
    assert exposed_in(comm, (0.0, 10.0)) == pytest.approx(4.0)
    assert exposed_in(comm, (2.5, 5.5)) == pytest.approx(0.5 + 0.5)
    # compute 1-2.5 and 5-5.25 hides part of it; overlapping compute intervals count once
    compute = [(1.0, 2.5), (2.0, 2.5), (5.0, 5.25)]
    assert exposed_in(comm, (0.0, 10.0), compute) == pytest.approx(4.0 - 1.5 - 0.25)
    assert exposed_in([], (0.0, 1.0), compute) == 0.0


def test_predicted_split_keeps_the_planners_step():
    m = catalog.get_model("llama-2-7b")
    hw = catalog.build_hardware(gpu="a100-80g", gpus=8)
    for ck in ("none", "full"):
        train = TrainSpec(checkpointing=ck)
        t = evaluate(m, hw, train, Strategy.from_name("zero3")).time
        split = predicted_split(t.as_dict(), forward_share(train))
        assert split["step"] == t.step_s and split["exposed_comm"] == t.exposed_comm_s
        assert split["optimizer"] == pytest.approx(t.optimizer_s + t.offload_s)
        # forward + backward + optimizer kernels = the planner's work (GPU compute + host)
        assert split["forward"] + split["backward"] + t.optimizer_s == pytest.approx(t.compute_s + t.host_s)
        assert split["backward"] == pytest.approx(split["forward"] * (3 if ck == "full" else 2))


def test_measured_split_takes_the_exposed_comm_out_of_each_phase():
    phase = {"forward": 0.010, "backward": 0.020, "optimizer": 0.005}
    exposed = {"forward": 0.002, "backward": 0.008, "optimizer": 0.001}
    m = measured_split(phase, exposed, 0.040)
    assert m["forward"] == pytest.approx(0.008) and m["backward"] == pytest.approx(0.012)
    assert m["optimizer"] == pytest.approx(0.004) and m["exposed_comm"] == pytest.approx(0.011)
    pred = {"forward": 0.004, "backward": 0.008, "optimizer": 0.002, "exposed_comm": 0.022, "step": 0.036}
    terms = time_terms(pred, m)
    assert set(terms) == {*PHASES, "exposed_comm", "step", "exposed_comm_share"}
    assert terms["forward"]["rel_error"] == pytest.approx((0.004 - 0.008) / 0.008)
    assert terms["exposed_comm_share"]["measured"] == pytest.approx(0.011 / 0.040)
    assert terms["exposed_comm_share"]["predicted"] == pytest.approx(0.022 / 0.036)


def test_wait_recorder_times_collectives_on_its_own_thread(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    rec = WaitRecorder().install()
    try:
        t0 = time.perf_counter()
        dist.all_reduce(torch.ones(1000))  # synchronous: waits in Work.wait
        work = dist.all_reduce(torch.ones(10), async_op=True)
        work.wait()
        t1 = time.perf_counter()
        other = threading.Thread(target=lambda: dist.all_reduce(torch.ones(10)))
        other.start()
        other.join()
    finally:
        rec.uninstall()
        dist.destroy_process_group()
    assert len(rec.intervals) == 2, rec.intervals  # the other thread's wait is not the step's
    assert all(t0 <= a <= b <= t1 for a, b in rec.intervals)
    blocked = sum(b - a for a, b in rec.intervals)
    assert blocked > 0 and rec.take((t0, t1)) == pytest.approx(blocked)
    assert rec.intervals == []
    assert "wrapper" not in repr(dist.distributed_c10d.Work.wait)  # uninstalled


def test_cuda_profile_reader_runs_on_this_torch():
    """The CUDA path reads kineto events (names, device types, ns times) and the phase
    annotations; on CPU there are no NCCL kernels, so every phase reads 0 exposed."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardwise.bench.steptime import ANNOTATION, _ns, cuda_exposed

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ph in PHASES:
            with record_function(ANNOTATION + ph):
                torch.randn(64, 64) @ torch.randn(64, 64)
    assert cuda_exposed(prof) == {ph: 0.0 for ph in PHASES}
    names = {e.name(): e for e in prof.profiler.kineto_results.events()}
    fwd = names[ANNOTATION + "forward"]
    assert _ns(fwd, "duration") > 0 and fwd.device_type() != torch.autograd.DeviceType.CUDA
