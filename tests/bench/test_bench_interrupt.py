"""`shardwise bench` stopped by SIGTERM writes bench.json and report.md for the points it already
measured (it once wrote nothing), says which were not, and exits 75."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

# tests/bench/test_bench_cli.py's tiny config: the catalog's tiny-llama-bench, fp32, 2 gloo ranks
CONFIG = """\
name: bench-tiny
model: {name: tiny-llama-bench, attention: sdpa}
data: {kind: synthetic, synthetic: {samples: 64, seq_len: 64}}
strategy: {name: ddp}
optimizer: {lr: 1.0e-3, weight_decay: 0.0, max_grad_norm: 0.0}
precision: fp32
run: {micro_batch: 2, grad_accum: 1, device: cpu, seed: 0, nproc: 2}
logging: {progress: false, tensorboard: false}
"""
SWEEP = ("ddp", "zero2", "fsdp")


@pytest.mark.distributed
def test_sigterm_after_the_first_point_reports_the_measured_points(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    out = tmp_path / "bench"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.Popen([sys.executable, "-m", "shardwise.cli.app", "bench", str(cfg), "--steps", "2", "--nproc", "2",
                          "--out", str(out), "--sweep", "strategy.name=" + ",".join(SWEEP)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    first = out / "runs" / "strategy.name_ddp" / "bench"
    deadline = time.monotonic() + 240
    try:
        while not all((first / f"rank{r}.json").is_file() for r in (0, 1)):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the first point was not measured in 240 s"
            time.sleep(0.2)
        assert not (out / "bench.json").exists()
        p.send_signal(signal.SIGTERM)  # the first point is measured; the next one starts (or runs)
        stdout, stderr = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75, stdout[-2000:] + stderr[-3000:]
    msg = " ".join(stderr.split())
    assert "bench interrupted" in msg and "bench.json" in msg and "report.md" in msg, msg[-2000:]
    doc = json.loads((out / "bench.json").read_text())
    measured = [pt["strategy"] for pt in doc["points"]]
    assert 1 <= len(measured) < len(SWEEP) and measured == list(SWEEP[: len(measured)]), measured
    inc = doc["incomplete"]
    assert inc["reason"].startswith("interrupted") and inc["measured"] == len(measured) and inc["points"] == 3
    assert inc["not_measured"] == [f"strategy.name={s}" for s in SWEEP[len(measured):]]
    for pt in doc["points"]:  # each reported point is a whole measurement
        assert pt["model_states"]["model_states"]["measured"] > 0 and pt["time"]["step_s"] > 0
    report = (out / "report.md").read_text()
    assert "**Incomplete:** interrupted" in report and "## strategy.name=ddp" in report
    assert (out / "states_00.png").read_bytes()[:4] == b"\x89PNG"


def test_a_stop_between_points_ends_the_bench_after_the_point_in_flight(tmp_path, monkeypatch):
    """Without ranks: the stop arrives while the parent handles point 1 (outside spawn, whose own
    handler forwards a stop to the ranks); point 2 never starts, point 1 is reported, exit 75."""
    from shardwise.bench import bench_report, compare, points

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)
    launched = []

    def fake_launch(config, p, out):
        launched.append(p.label)
        os.kill(os.getpid(), signal.SIGTERM)  # recorded by the bench's handler, not fatal
        return [{"rank": 0}]

    monkeypatch.setattr(points, "launch", fake_launch)
    monkeypatch.setattr(compare, "compare", lambda p, ranks, steps: {"label": p.label, "ranks": ranks})
    written = []
    monkeypatch.setattr(bench_report, "write_report", lambda out, doc: written.append(doc))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(points.BenchFailed) as e:
        points.bench_points(cfg, [], 1, 2, tmp_path / "out", ["strategy.name=ddp,fsdp"], False, progress=False)
    assert e.value.code == 75 and "interrupted by SIGTERM after 1 of 2 points" in str(e.value)
    assert launched == ["strategy.name=ddp"]
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [p["label"] for p in doc["points"]] == ["strategy.name=ddp"] and written[0]["incomplete"] == {
        "reason": "interrupted by SIGTERM", "measured": 1, "points": 2, "not_measured": ["strategy.name=fsdp"]}
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_a_failed_point_still_reports_the_points_before_it(tmp_path, monkeypatch):
    from shardwise.bench import bench_report, compare, points

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CONFIG)

    def fake_launch(config, p, out):
        if p.label.endswith("fsdp"):
            raise points.BenchFailed(f"bench point {p.label!r}: the trainer exited with code 1", 1)
        return [{"rank": 0}]

    monkeypatch.setattr(points, "launch", fake_launch)
    monkeypatch.setattr(compare, "compare", lambda p, ranks, steps: {"label": p.label})
    monkeypatch.setattr(bench_report, "write_report", lambda out, doc: None)
    with pytest.raises(points.BenchFailed) as e:
        points.bench_points(cfg, [], 1, 2, tmp_path / "out", ["strategy.name=ddp,fsdp,zero2"], False, progress=False)
    assert e.value.code == 1 and "after 1 of 3 points" in str(e.value) and "exited with code 1" in str(e.value)
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [p["label"] for p in doc["points"]] == ["strategy.name=ddp"]
    assert doc["incomplete"]["not_measured"] == ["strategy.name=fsdp", "strategy.name=zero2"]
