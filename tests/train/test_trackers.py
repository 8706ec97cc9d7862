"""Experiment trackers: `logging.trackers: [tensorboard, wandb, mlflow]`.

The end-to-end run: `shardwise train examples/demo.yaml` on 2 CPU ranks (FSDP2), 6 steps, a
validation split evaluated every 3 steps, all three trackers, W&B offline (WANDB_MODE) and
MLflow's default file store under the output dir; nothing reaches the network (W&B's config,
cache and data dirs are in tmp, no API key, no MLFLOW_TRACKING_URI). What each tracker
recorded is read back with that tracker's own reader (W&B's offline run file through
tests/train/wandb_log.py, MLflow through `MlflowClient.get_metric_history`, TensorBoard through
its EventAccumulator) and compared, step for step and value for value, with metrics.jsonl.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardwise.config.load import load_config, validate
from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError

REPO = Path(__file__).resolve().parents[2]
STEPS, EVAL_EVERY = 6, 3


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


# --- the config ---------------------------------------------------------------------------


def test_trackers_default_choices_and_errors(tmp_path):
    assert TrainConfig().logging.trackers == ["tensorboard"]  # as before: TensorBoard on by default
    p = write(tmp_path, "logging:\n  trackers: [tensorboard, WandB, mlflow]\n")
    assert load_config(p).logging.trackers == ["tensorboard", "wandb", "mlflow"]
    assert load_config(p, ["logging.trackers=[]"]).logging.trackers == []
    p = write(tmp_path, "logging:\n  every: 5\n  trackers: [tensorbord]\n")
    with pytest.raises(ShardwiseError, match=r"cfg.yaml:3: field 'logging.trackers' .*unknown tracker 'tensorbord'"
                       r".*Did you mean 'tensorboard'"):
        load_config(p)
    p = write(tmp_path, "logging:\n  trackers: [wandb, wandb]\n")
    with pytest.raises(ShardwiseError, match="wandb listed more than once"):
        load_config(p)
    p = write(tmp_path, "logging:\n  mlflow:\n    tracking_url: http://x\n")
    with pytest.raises(ShardwiseError, match=r"unknown field 'logging.mlflow.tracking_url'.*tracking_uri"):
        load_config(p)


def test_old_keys_are_read_into_trackers_and_named(tmp_path):
    """The keys before `trackers` still work (every checkpoint manifest written so far records
    them, and `shardwise export` validates that config); `deprecation` says what to write."""
    p = write(tmp_path, "logging:\n  tensorboard: false\n  wandb: true\n  wandb_project: mine\n")
    cfg = load_config(p)
    assert cfg.logging.trackers == ["wandb"] and cfg.logging.wandb.project == "mine"
    note = cfg.logging.deprecation(str(p))
    assert "logging.tensorboard, logging.wandb, logging.wandb_project are deprecated" in note
    assert "logging.trackers: [wandb] and logging.wandb.project: mine" in note
    assert load_config(write(tmp_path, "logging:\n  tensorboard: false\n")).logging.trackers == []
    # a manifest's logging as the trainer wrote it before (a checkpoint being exported)
    old = {"every": 10, "progress": True, "tensorboard": True, "wandb": False, "wandb_project": "shardwise"}
    assert validate({"logging": old}).logging.trackers == ["tensorboard"]
    # --set logging.trackers over a file with the old keys: the new key wins (bench's FORCED does this)
    cfg = load_config(write(tmp_path, "logging:\n  tensorboard: true\n"), ["logging.trackers=[mlflow]"])
    assert cfg.logging.trackers == ["mlflow"] and "this run uses logging.trackers: [mlflow]" in \
        cfg.logging.deprecation("x")
    with pytest.raises(ShardwiseError, match=r"cfg.yaml:1: field 'logging' .*logging.tensorboard = 'on': expected "
                       "true or false"):
        load_config(write(tmp_path, "logging:\n  tensorboard: 'on'\n"))
    # the new spelling has no note, and what is written back (manifests, plan --emit) is new
    cfg = TrainConfig.model_validate({"logging": {"trackers": ["mlflow"]}})
    assert cfg.logging.deprecation("x") is None
    assert set(cfg.model_dump()["logging"]) == {"every", "every_seconds", "progress", "trackers", "wandb", "mlflow"}


def test_train_prints_the_deprecation_once_before_anything_runs(tmp_path):
    p = write(tmp_path, f"data:\n  sft:\n    train_files: [{tmp_path / 'missing.jsonl'}]\nlogging:\n"
              f"  tensorboard: false\ncheckpointing:\n  output_dir: {tmp_path / 'out'}\n")
    r = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(p), "--nproc", "2"], capture_output=True,
                       text=True, timeout=180, check=False)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("logging.tensorboard is deprecated; this run uses logging.trackers: []") == 1
    assert "missing.jsonl" in r.stderr  # then the preflight's refusal, before any rank started


def test_missing_tracker_package_refused_by_preflight(monkeypatch):
    import importlib.util

    from shardwise.train.observe import trackers
    from shardwise.train.preflight import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mlflow", "wandb") else real(name, *a))  # fmt: skip
    cfg = TrainConfig.model_validate({"data": {"kind": "synthetic"}, "run": {"device": "cpu"},
                                      "logging": {"trackers": ["tensorboard", "mlflow", "wandb"]}})  # fmt: skip
    with pytest.raises(ShardwiseError) as e:
        preflight(cfg, 2, "cpu")
    msg = str(e.value)
    assert "logging.trackers lists mlflow (needs mlflow-skinny), wandb (needs wandb)" in msg
    assert "pip install 'shardwise[tracking]'" in msg and "tensorboard" not in msg.split("lists")[1].split(",")[0]


def test_wandb_online_without_credentials_refused_by_preflight(tmp_path, monkeypatch):
    from shardwise.train.observe.trackers import check_installed

    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = _cfg(tmp_path, ["wandb"])
    with pytest.raises(ShardwiseError, match=r"lists wandb, online .* no W&B credentials are set up: run `wandb "
                       r"login` or set WANDB_API_KEY, or log offline \(logging.wandb.mode: offline"):
        check_installed(cfg)
    check_installed(_cfg(tmp_path, ["wandb"], wandb={"mode": "offline"}))  # offline needs none
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_installed(cfg)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # found, not verified: no network
    check_installed(cfg)


BLOCKER = """
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):  # as if mlflow were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "mlflow":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NotInstalled())
sys.argv = ["shardwise-train", *sys.argv[1:]]
from shardwise.train.cli import main
main()
"""


def test_train_without_mlflow_installed_stops_before_any_rank(tmp_path):
    out = tmp_path / "out"
    p = write(tmp_path, f"data:\n  kind: synthetic\nrun:\n  device: cpu\nlogging:\n  trackers: [mlflow]\n"
              f"checkpointing:\n  output_dir: {out}\n")
    r = subprocess.run([sys.executable, "-c", BLOCKER, str(p), "--nproc", "2"], capture_output=True, text=True,
                       timeout=180, check=False)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "logging.trackers lists mlflow (needs mlflow-skinny), not installed: pip install 'shardwise[tracking]'" \
        in r.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / ".shardwise" / "heartbeat").exists()
    assert not (out / "summary.json").exists()  # no launcher marker either: the job never started


# --- the Trackers set -----------------------------------------------------------------------


def test_rows_are_named_train_and_eval():
    from shardwise.train.observe.trackers import tracker_metrics

    step, m = tracker_metrics({"step": 4, "loss": 1.5, "lr": 1e-4, "tokens": 96, "mfu": 0.25})
    assert (step, m) == (4, {"train/loss": 1.5, "train/lr": 1e-4, "train/tokens": 96, "train/mfu": 0.25})
    step, m = tracker_metrics({"kind": "eval", "step": 6, "eval_loss": 2.0, "eval_ppl": 7.389, "eval_tokens": 10,
                               "eval_time_s": 0.5})  # fmt: skip
    assert (step, m) == (6, {"eval/loss": 2.0, "eval/ppl": 7.389, "eval/tokens": 10, "eval/time_s": 0.5})


class _Fake:
    def __init__(self, name, fail_at=None):
        self.name, self.fail_at, self.location = name, fail_at, {"where": name}
        self.logged, self.closed = [], None

    def log(self, metrics, step):
        if step == self.fail_at:
            raise ConnectionError("server went away")
        self.logged.append((step, metrics))

    def close(self, status, summary):
        self.closed = status


def test_a_tracker_failing_mid_run_is_dropped_and_the_others_go_on(capsys):
    from shardwise.train.observe.trackers import Trackers

    t = Trackers()
    ok, bad = _Fake("tensorboard"), _Fake("mlflow", fail_at=2)
    t.open = [bad, ok]
    for s in (1, 2, 3):
        t.log({"step": s, "loss": 1.0 / s})
    assert [s for s, _ in ok.logged] == [1, 2, 3] and [s for s, _ in bad.logged] == [1]
    assert t.failed == {"mlflow": "step 2: ConnectionError: server went away"}
    assert "mlflow failed at step 2 and is dropped" in capsys.readouterr().err
    assert t.locations() == {}  # (these were not opened by start)
    t.close("completed", {})
    assert ok.closed == bad.closed == "completed"  # the dropped one is still ended where it can be


# --- a real run -----------------------------------------------------------------------------


def _rows(out: Path) -> tuple[dict, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r for r in rows if r.get("kind") != "eval"},
            {r["step"]: r for r in rows if r.get("kind") == "eval"})  # fmt: skip


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """The run (6 steps, a checkpoint at step 6), then `--resume latest` to step 8: what each
    left (metrics.jsonl's rows and summary.json after the first, and after the resume)."""
    tmp = tmp_path_factory.mktemp("tracked")
    out = tmp / "run"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "MLFLOW_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data"),
            "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}  # fmt: skip
    sets = [f"run.eval_every_steps={EVAL_EVERY}", "data.sft.validation_fraction=0.25",
            "logging.every=2", "logging.progress=false", "logging.trackers=[tensorboard, wandb, mlflow]",
            f"checkpointing.output_dir={out}", "checkpointing.save_final=false",
            "checkpointing.save_every_minutes=null", f"checkpointing.save_every_steps={STEPS}"]  # fmt: skip
    runs = {}
    for name, extra in (("first", [f"run.steps={STEPS}"]), ("resumed", [f"run.steps={STEPS + 2}"])):
        cmd = [sys.executable, "-m", "shardwise.train.cli", str(REPO / "examples/demo.yaml"), "--nproc", "2",
               *[a for s in [*sets, *extra] for a in ("--set", s)]]  # fmt: skip
        cmd += ["--resume", "latest"] if name == "resumed" else []
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[name] = (*_rows(out), json.loads((out / "summary.json").read_text()))
    return out, runs


@pytest.fixture(scope="module")
def tracked_run(tracked):
    """The first run: output dir, metrics.jsonl's train and eval rows by step, its summary.json."""
    out, runs = tracked
    train, evals, summary = runs["first"]
    assert sorted(train) == list(range(1, STEPS + 1)) and sorted(evals) == [3, 6]
    return out, train, evals, summary


def expected(train: dict, evals: dict) -> dict[int, dict[str, float]]:
    """metrics.jsonl's rows under the documented tracker names (docs/training.md, Tracking):
    `train/<key>` for a step's record, `eval/<key without eval_>` for an evaluation."""
    want: dict[int, dict[str, float]] = {}
    for step, row in train.items():
        want.setdefault(step, {}).update({f"train/{k}": v for k, v in row.items() if k != "step"})
    for step, row in evals.items():
        want.setdefault(step, {}).update({"eval/loss": row["eval_loss"], "eval/ppl": row["eval_ppl"],
                                          "eval/tokens": row["eval_tokens"], "eval/time_s": row["eval_time_s"]})
    return want


def _manifest(out: Path) -> dict:
    """The manifest of the first run's checkpoint (step 6): its config, run id and lineage."""
    return json.loads((out / "checkpoints" / f"step-{STEPS:08d}" / "manifest.json").read_text())


def _manifest_config(out: Path) -> dict:
    return _manifest(out)["config"]


@pytest.mark.distributed
def test_wandb_offline_run_has_metrics_jsonl_config_and_plan(tracked_run):
    import wandb_log

    out, train, evals, summary = tracked_run
    run_dir = Path(summary["trackers"]["wandb"]["dir"])
    assert run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")  # in the output dir
    (log,) = run_dir.glob("run-*.wandb")
    want = expected(train, evals)
    got = wandb_log.history(log)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == want[step], step  # every key, every value, exactly (JSON floats round-trip)
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/memory_bytes"} <= set(got[1])
    assert set(got[3]) - set(got[2]) == {"eval/loss", "eval/ppl", "eval/tokens", "eval/time_s"}
    (exit_rec,) = wandb_log.of_type(log, "exit")
    assert exit_rec.exit_code == 0
    # the run config and the plan
    config = wandb_log.config(log)
    manifest = _manifest_config(out)
    assert {k: config[k] for k in manifest} == manifest  # the config the checkpoint recorded, every section
    assert config["logging"]["trackers"] == ["tensorboard", "wandb", "mlflow"]
    assert config["plan"]["strategy"] == "fsdp" and config["plan"]["gpus"] == 2
    assert config["plan"]["gpu_bytes"] == summary["planned_gpu_bytes"]  # preflight's number, through the plan
    assert config["shardwise"]["shardwise.run_id"] == _manifest(out)["run_id"]
    assert config["shardwise"]["shardwise.lineage"] == _manifest(out)["lineage"]
    (art,) = wandb_log.of_type(log, "artifact")
    assert art.type == "shardwise-run"
    files = {e.path: e for e in art.manifest.contents}
    assert set(files) == {"config.yaml", "plan.json"}
    for name, entry in files.items():
        path = Path(entry.local_path)
        assert path == run_dir / "files" / name  # in the run's directory: synced with it
        assert entry.digest == base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()
    assert yaml.safe_load((run_dir / "files/config.yaml").read_text()) == manifest
    plan = json.loads((run_dir / "files/plan.json").read_text())
    (strategy,) = plan["strategies"]
    assert strategy["name"] == "fsdp" and strategy["memory"]["total"] == summary["planned_gpu_bytes"]


@pytest.mark.distributed
def test_mlflow_file_store_has_metrics_jsonl_config_and_plan(tracked_run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses to read its file store otherwise
    from mlflow.tracking import MlflowClient

    out, train, evals, summary = tracked_run
    uri = (out / "mlruns").resolve().as_uri()  # the default: a file store in the output dir
    assert summary["trackers"]["mlflow"]["tracking_uri"] == uri
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("shardwise")
    run = client.get_run(summary["trackers"]["mlflow"]["run_id"])
    assert run.info.experiment_id == exp.experiment_id
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"
    want = expected(train, evals)
    keys = {k for m in want.values() for k in m}
    assert set(run.data.metrics) == keys
    for key in sorted(keys):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == sorted((s, float(m[key])) for s, m in want.items() if key in m), key
    params = run.data.params
    manifest = _manifest_config(out)
    assert params["strategy.name"] == "fsdp" and params["run.steps"] == str(STEPS)
    assert params["logging.trackers"] == json.dumps(manifest["logging"]["trackers"])
    assert float(params["plan.gpu_bytes"]) == summary["planned_gpu_bytes"]
    assert run.data.tags["shardwise.run_id"] == _manifest(out)["run_id"]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"config.yaml", "plan.json", "summary.json"}
    local = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(out.parent / "dl")))
    assert yaml.safe_load(local.read_text()) == manifest
    plan = json.loads(Path(client.download_artifacts(run.info.run_id, "plan.json", str(out.parent / "dl"))).read_text())
    assert plan["strategies"][0]["memory"]["total"] == summary["planned_gpu_bytes"]
    mlflow_summary = json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json",
                                                               str(out.parent / "dl"))).read_text())  # fmt: skip
    assert mlflow_summary["final_eval_loss"] == evals[STEPS]["eval_loss"] == summary["final_eval_loss"]


@pytest.mark.distributed
def test_tensorboard_has_every_step_and_eval(tracked):
    """Both runs wrote into one logdir: together, metrics.jsonl's steps 1..8."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, runs = tracked
    train, evals, _ = runs["resumed"]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    want = expected(train, evals)
    for key in ("train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "eval/loss", "eval/ppl"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        ref = [(s, m[key]) for s, m in sorted(want.items()) if key in m]
        assert [s for s, _ in got] == [s for s, _ in ref], key
        assert all(abs(a - b) <= 1e-6 * abs(b) for (_, a), (_, b) in zip(got, ref, strict=True)), key  # float32
    assert {"config/text_summary", "plan/text_summary"} <= set(acc.Tags()["tensors"])


@pytest.mark.distributed
def test_a_resumed_run_is_a_new_tracker_run_of_the_same_lineage(tracked, monkeypatch):
    """--resume latest at step 6 to step 8: a second W&B run and a second MLflow run, holding
    steps 7 and 8 (and the evaluation after the last step) exactly as metrics.jsonl has them,
    in the first run's lineage (W&B group, MLflow tag); the first runs keep steps 1..6."""
    import wandb_log

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    out, runs = tracked
    first, second = runs["first"][2], runs["resumed"][2]
    train, evals, _ = runs["resumed"]
    assert sorted(train) == list(range(1, STEPS + 3)) and sorted(evals) == [3, 6, STEPS + 2]
    want = {s: m for s, m in expected(train, evals).items() if s > STEPS}
    lineage = json.loads((out / ".shardwise/lineage.json").read_text())
    assert first["trackers"]["wandb"]["id"] != second["trackers"]["wandb"]["id"]
    logs = {k: next(Path(s["trackers"]["wandb"]["dir"]).glob("run-*.wandb")) for k, s in
            (("first", first), ("resumed", second))}  # fmt: skip
    assert wandb_log.history(logs["resumed"]) == want
    assert sorted(wandb_log.history(logs["first"])) == list(range(1, STEPS + 1))
    for log in logs.values():
        (run_rec,) = wandb_log.of_type(log, "run")
        assert run_rec.run_group == lineage["lineage"]
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    a, b = (client.get_run(s["trackers"]["mlflow"]["run_id"]) for s in (first, second))
    assert a.info.run_id != b.info.run_id
    assert a.data.tags["shardwise.lineage"] == b.data.tags["shardwise.lineage"] == lineage["lineage"]
    for key in ("train/loss", "train/lr", "eval/loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(b.info.run_id, key))
        assert history == [(s, float(m[key])) for s, m in sorted(want.items()) if key in m], key
    assert [m.step for m in client.get_metric_history(a.info.run_id, "train/loss")] == list(range(1, STEPS + 1))


def _cfg(tmp_path: Path, trackers: list[str], **logging) -> TrainConfig:
    return TrainConfig.model_validate({"name": "unit", "checkpointing": {"output_dir": str(tmp_path / "out")},
                                       "logging": {"trackers": trackers, **logging}})  # fmt: skip


def test_an_interrupted_run_is_killed_in_mlflow_and_preempted_in_wandb(tmp_path, monkeypatch):
    import wandb_log

    for k in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    from shardwise.train.observe.trackers import Trackers

    t = Trackers()
    t.start(_cfg(tmp_path, ["wandb", "mlflow"], wandb={"mode": "offline"}))  # offline from the config
    t.log({"step": 1, "loss": 2.5})
    where = t.locations()
    t.close("interrupted", {"status": "interrupted"})
    (log,) = Path(where["wandb"]["dir"]).glob("run-*.wandb")
    assert where["wandb"]["mode"] == "offline" and wandb_log.history(log) == {1: {"train/loss": 2.5}}
    assert wandb_log.of_type(log, "preempting") and wandb_log.of_type(log, "exit")[0].exit_code == 1
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=where["mlflow"]["tracking_uri"]).get_run(where["mlflow"]["run_id"])
    assert run.info.status == "KILLED" and run.data.metrics == {"train/loss": 2.5}


def test_a_tracker_that_cannot_start_fails_the_start_and_closes_the_others(tmp_path):
    from shardwise.train.observe.trackers import Trackers

    t = Trackers()
    with pytest.raises(RuntimeError, match=r"logging.trackers: mlflow could not start: .*nosuch"):
        t.start(_cfg(tmp_path, ["tensorboard", "mlflow"], mlflow={"tracking_uri": "nosuch://host"}))
    assert t.open == []  # TensorBoard, opened first, was closed
    assert any((tmp_path / "out" / "tensorboard").iterdir())
