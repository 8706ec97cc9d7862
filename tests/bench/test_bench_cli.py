"""`shardwise bench`: the real trainer on 2 gloo ranks (CPU, tiny model, fp32), measured per rank
and set beside the planner: bench.json (predicted and measured per term), report.md and its PNGs.

One sweep over ddp / zero2 / zero3 / fsdp (one launch per point, ~40 s on 2 cores) feeds the
checks; the config is the one the census tests use (shardwise.bench.worker.bench_config: the
catalog's tiny-llama-bench, fp32, AdamW without weight decay or clipping, DeepSpeed and DDP
buckets of 500k elements), so model-state bytes match the plan within 2%.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from typer.testing import CliRunner

from shardwise.bench.points import parse_sweep
from shardwise.cli.app import app

STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")
PARTS = ("params", "grads", "master_params", "optimizer_states")
TOL_STATES = 0.02
TOL_COMM = 0.05

CONFIG = """\
name: bench-tiny
model: {name: tiny-llama-bench, attention: sdpa}
data: {kind: synthetic, synthetic: {samples: 64, seq_len: 64}}
strategy:
  name: fsdp
  deepspeed: {reduce_bucket_size: 500000, allgather_bucket_size: 500000, prefetch_bucket_size: 500000,
              communication_data_type: auto}
  ddp: {bucket_cap_mb: 1.9073486328125}   # 500k fp32 elements, as DeepSpeed's buckets
optimizer: {lr: 1.0e-3, weight_decay: 0.0, max_grad_norm: 0.0}
precision: fp32
run: {micro_batch: 2, grad_accum: 1, device: cpu, seed: 0, nproc: 2}
logging: {progress: false, tensorboard: false}
"""


def _invoke(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench_cfg") / "tiny.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def swept(tiny_config, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bench_out")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    r = _invoke(str(tiny_config), "--steps", "3", "--nproc", "2", "--out", str(out),
                "--sweep", "strategy.name=" + ",".join(STRATEGIES))
    assert r.exit_code == 0, r.output
    assert "predicted vs measured" in r.output, r.output
    (out / "cli-output.txt").write_text(r.output)  # not a TTY: the progress is plain lines
    return out, json.loads((out / "bench.json").read_text())


# ---------------------------------------------------------------- no launch
def test_bench_modules_import_no_torch() -> None:
    code = ("import sys, shardwise.cli.app, shardwise.bench.bench_cli, shardwise.bench.run_bench, shardwise.bench.points, "
            "shardwise.bench.bench_report; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")})
    assert out.stdout.strip() == "False"


def test_bench_is_a_cli_verb() -> None:
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0 and "bench" in r.output
    r = _invoke("--help")
    assert r.exit_code == 0 and "--sweep" in r.output and "--steps" in r.output


def test_parse_sweep_is_a_cartesian_product() -> None:
    assert parse_sweep(None) == [("run", [])]
    pts = parse_sweep(["strategy.name=ddp,fsdp", "run.micro_batch=1,2"])
    assert [o for _, o in pts] == [
        ["strategy.name=ddp", "run.micro_batch=1"], ["strategy.name=ddp", "run.micro_batch=2"],
        ["strategy.name=fsdp", "run.micro_batch=1"], ["strategy.name=fsdp", "run.micro_batch=2"]]
    # the short names
    assert parse_sweep(["strategies=zero2,fsdp", "micro_batch=1,2,4"]) == parse_sweep(
        ["strategy.name=zero2,fsdp", "run.micro_batch=1,2,4"])
    assert parse_sweep(["seq_len=64"], {"seq_len": "data.synthetic.seq_len"}) == [
        ("data.synthetic.seq_len=64", ["data.synthetic.seq_len=64"])]


@pytest.mark.parametrize(("args", "needle"), [
    (["--sweep", "strategy.name"], "--sweep"),
    (["--sweep", "strategy.name=ddp,,fsdp"], "--sweep"),
    (["--sweep", "name=ddp"], "section.field"),
    (["--sweep", "strategy.nmae=ddp"], "strategy.nmae"),
    (["--sweep", "strategy.name=zero9"], "zero9"),
    (["--set", "run.micro_batch=0"], "micro_batch"),
    (["--steps", "0"], "--steps"),
    (["--nproc", "0"], "--nproc"),
])
def test_bad_input_exits_2_naming_the_field(tiny_config, tmp_path, args, needle) -> None:
    r = _invoke(str(tiny_config), "--out", str(tmp_path / "o"), *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output, r.output
    assert not (tmp_path / "o" / "bench.json").exists()


def test_missing_config_exits_2(tmp_path) -> None:
    r = _invoke(str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "nope.yaml" in r.output, r.output


# ---------------------------------------------------------------- 2 ranks, 4 strategies
@pytest.mark.distributed
def test_bench_json_has_every_term_side_by_side(swept) -> None:
    _, doc = swept
    assert {"config", "steps", "device", "memory_note", "points", "sweep"} <= doc.keys()
    assert doc["device"] == "cpu" and doc["steps"] == 3
    assert [p["strategy"] for p in doc["points"]] == list(STRATEGIES)
    for p in doc["points"]:
        assert {"model_states", "comm", "memory_by_phase", "memory_kind", "time", "label", "world_size"} <= p.keys()
        for term in (*PARTS, "model_states"):
            assert set(p["model_states"][term]) == {"predicted", "measured", "rel_error"}
        # engine holds params, grads and Adam state everywhere; an fp32 master only under DeepSpeed
        for term in ("params", "grads", "optimizer_states", "model_states"):
            assert p["model_states"][term]["measured"] > 0, (p["label"], term)
        master = p["model_states"]["master_params"]["measured"]
        assert (master > 0) == (p["engine"] == "deepspeed"), (p["label"], master)
        assert p["comm"] and all(v["measured"] > 0 for v in p["comm"].values() if v["predicted"]), p["comm"]
        assert p["comm_steady_state"] is True
        t = p["time"]
        for k in ("forward_s", "backward_s", "optimizer_s", "step_s", "tokens_per_s", "tflops"):
            assert t[k] > 0, (p["label"], k, t)
        assert t["mfu"] is None  # no GPU peak to divide by on CPU
        assert t["predicted"]["step_s"] > 0 and t["predicted"]["tokens_per_s_per_gpu"] > 0
        # the step split, predicted and measured per term: every engine here computes in each
        # phase and, on 2 ranks, waits for collectives (gloo: the training thread blocks)
        for term in ("forward", "backward", "optimizer", "exposed_comm", "step"):
            v = t["terms"][term]
            assert set(v) == {"predicted", "measured", "rel_error"}, (p["label"], term)
            assert v["predicted"] > 0 and v["measured"] > 0, (p["label"], term, v)
            assert v["rel_error"] == pytest.approx((v["predicted"] - v["measured"]) / v["measured"])
        assert 0 < t["terms"]["exposed_comm_share"]["measured"] < 1
        assert t["exposed_comm_s"] == pytest.approx(sum(t["exposed_comm_by_phase"].values()))
        assert "Work.wait" in t["exposed_comm_method"] and t["comparable"] is False  # a GPU plan vs this CPU
        # the memory timeline of one step, per rank: per-layer samples, phase markers, census
        tl = p["memory_timeline"]
        assert tl["kind"] == "host_rss" and sorted(tl["ranks"]) == ["rank0", "rank1"]
        for d in tl["ranks"].values():
            labels = [x["label"] for x in d["samples"]]
            assert "L0 forward start" in labels and "L0 backward start" in labels, labels
            assert [m["label"] for m in d["markers"]][:3] == ["forward end", "backward end", "optimizer step end"]
            assert [c["label"] for c in d["census"]] == ["forward end", "backward end", "optimizer step end"]
            assert all(x["bytes"] > 0 for x in d["samples"])
        cb = p["comm_bound"]
        assert cb["threshold"] == 0.4 and cb["bound"] == (t["terms"]["exposed_comm_share"]["measured"] > 0.4)
        assert ("fix" in cb) == cb["bound"]
        # host memory on CPU, per rank and phase; the GPU plan's phases are not set beside it
        assert p["memory_kind"] == "host_rss" and "memory_plan" not in p
        assert sorted(p["memory_by_phase"]) == ["rank0", "rank1"]
        for phases in p["memory_by_phase"].values():
            for ph in ("forward", "backward", "optimizer"):
                assert phases[ph]["rss"] > 0


@pytest.mark.distributed
def test_bench_progress_in_a_log_is_a_line_per_point_start_and_end(swept) -> None:
    out, _ = swept
    text = (out / "cli-output.txt").read_text()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    for i, s in enumerate(STRATEGIES, 1):
        point = f"bench point {i}/{len(STRATEGIES)} strategy.name={s}"
        assert re.search(rf"^{stamp} {point}: running \(2 rank\(s\), 3 steps\)$", text, re.M), text
        assert re.search(rf"^{stamp} {point}: done in \d+:\d\d:\d\d$", text, re.M), text
    assert "\r" not in text and "\x1b" not in text
    assert not [line for line in text.splitlines() if "bench point" in line and "…" in line]


def test_measured_model_states_match_the_plan(swept) -> None:
    _, doc = swept
    bad = []
    for p in doc["points"]:
        total = p["model_states"]["model_states"]["measured"]
        for term in (*PARTS, "model_states"):
            v = p["model_states"][term]
            if v["measured"] == 0:
                if v["predicted"] > 0.001 * total:
                    bad.append((p["label"], term, v))
            elif abs(v["rel_error"]) > TOL_STATES:
                bad.append((p["label"], term, v))
    assert not bad, bad


@pytest.mark.distributed
def test_measured_collectives_match_the_plan(swept) -> None:
    _, doc = swept
    bad = []
    for p in doc["points"]:
        # Kinds below 0.1% of the step's traffic (DDP's 128-byte broadcast, ZeRO-3's
        # 8-byte all-reduce per step) are compared in absolute terms, as tests/accuracy/test_measured_comm.py does.
        small = 1e-3 * sum(v["measured"] for v in p["comm"].values())
        for k, v in p["comm"].items():
            m, pr = v["measured"], v["predicted"]
            if (abs(pr - m) > TOL_COMM * m) if m >= small else abs(pr - m) > small:
                bad.append((p["label"], k, v))
    assert not bad, bad


@pytest.mark.distributed
def test_report_and_plots(swept) -> None:
    out, doc = swept
    report = (out / "report.md").read_text()
    assert "host" in report and "not comparable with the GPU plan" in report
    pngs = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    # per point: model states, memory by phase, memory timeline; once: step time and the sweep's errors
    assert len(pngs) == 3 * len(doc["points"]) + 2, pngs
    assert "errors.png" in pngs and "time.png" in pngs
    assert sum(n.startswith("timeline_") for n in pngs) == len(doc["points"])
    assert "Memory timeline of one step" in report and "predicted vs measured" in report
    for p in doc["points"]:  # the 40% rule: said where the measured step is over it
        if p["comm_bound"]["bound"]:
            assert p["comm_bound"]["message"] in report
    import matplotlib.image as mpimg

    for name in pngs:
        path = out / name
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert len(data) > 5_000, (name, len(data))
        img = mpimg.imread(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, (name, img.shape)


@pytest.mark.parametrize("columns", [80, 250])
def test_bench_table_is_never_cut_at_the_log_width(swept, columns, monkeypatch, capsys) -> None:
    """Narrower than the table (a batch log at 80 columns): a block per point, every value whole;
    wide enough: the table."""
    from shardwise.bench.bench_report import print_table

    _, doc = swept
    monkeypatch.setenv("COLUMNS", str(columns))
    print_table(doc)
    text = capsys.readouterr().out
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= columns
    for p in doc["points"]:
        assert p["short"] in text
        ms = p["model_states"]["model_states"]
        assert f"{ms['measured'] / 2**20:,.2f}" in text  # the measured MiB, whole
    assert ("model states err:" in text) == (columns == 80)
