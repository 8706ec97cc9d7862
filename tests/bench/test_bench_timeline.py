"""The memory timeline of one step: per-layer samples in forward and backward order, phase
markers, census points, the CUDA snapshot's allocated-bytes curve, and its plot."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from shardwise.bench.bench_plots import plot_timeline  # noqa: E402
from shardwise.bench.timeline import Timeline, snapshot_series  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)

    def forward(self, x):
        return (torch.relu(self.lin(x)) + x,)  # HF decoder layers return a tuple


def test_layer_hooks_sample_forward_then_backward_in_reverse(tmp_path):
    layers = torch.nn.ModuleList([_Block() for _ in range(3)])
    tl = Timeline(cuda=False)
    tl.attach(list(layers))
    x = torch.randn(64, 256, requires_grad=True)
    layers[0](x)[0].sum().backward()  # not active: nothing recorded
    assert tl.samples == []
    tl.start()
    h = x
    for layer in layers:
        h = layer(h)[0]
    tl.mark("forward end")
    tl.phase = "backward"
    tl.pause()
    tl.add_census("forward end", {"params": 3 * 256 * 257 * 4})
    tl.resume()
    h.sum().backward()
    tl.mark("backward end")
    tl.stop(tmp_path, 0)
    labels = [s["label"] for s in tl.samples]
    assert labels == ["step start", "L0 forward start", "L0 forward end", "L1 forward start", "L1 forward end",
                      "L2 forward start", "L2 forward end", "forward end", "L2 backward start",
                      "L1 backward start", "L0 backward start", "backward end", "step end"]
    ts = [s["t_s"] for s in tl.samples]
    assert ts == sorted(ts) and all(s["bytes"] > 0 for s in tl.samples)
    assert [m["label"] for m in tl.markers] == ["forward end", "backward end"]
    tl.detach()
    layers[0](x)
    d = tl.as_dict("host_rss")
    assert d["kind"] == "host_rss" and len(d["samples"]) == len(labels) and d["census"][0]["bytes"]["params"] > 0

    point = {"label": "unit", "memory_timeline": {"step": 3, "kind": "host_rss", "ranks": {"rank0": d, "rank1": d}}}
    plot_timeline(point, tmp_path / "t.png")
    import matplotlib.image as mpimg

    img = mpimg.imread(tmp_path / "t.png")
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_recomputed_forwards_are_labelled_as_such():
    layer = _Block()
    tl = Timeline(cuda=False)
    tl.attach([layer])
    tl.start()
    tl.phase = "backward"  # activation checkpointing replays the forward inside backward
    layer(torch.randn(4, 256))
    assert [s["label"] for s in tl.samples][1:] == ["L0 recompute start", "L0 recompute end"]


def test_snapshot_series_follows_allocs_and_completed_frees():
    snap = {"device_traces": [[
        {"action": "alloc", "size": 100, "time_us": 1_000},
        {"action": "alloc", "size": 50, "time_us": 2_000},
        {"action": "free_requested", "size": 100, "time_us": 2_500},  # not yet free
        {"action": "free_completed", "size": 100, "time_us": 3_000},
        {"action": "segment_alloc", "size": 4096, "time_us": 500},  # reserved, not allocated
    ]]}
    assert snapshot_series(snap) == [(0.0, 100.0), (0.001, 150.0), (0.002, 50.0)]
    assert snapshot_series({}) == []
    many = {"device_traces": [[{"action": "alloc" if i % 2 == 0 else "free_completed", "size": 10 + i,
                                "time_us": i} for i in range(10_000)]]}
    thin = snapshot_series(many, max_points=100)
    assert len(thin) <= 100 and max(v for _, v in thin) == max(v for _, v in snapshot_series(many, 10**6))
