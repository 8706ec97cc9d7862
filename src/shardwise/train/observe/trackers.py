"""Experiment trackers (`logging.trackers`): TensorBoard, Weights & Biases and MLflow behind one
protocol, fed by `shardwise.train.observe.metrics.Metrics` on rank 0.

Every tracker gets what `metrics.jsonl` gets, record for record, at the same step: a train
record as `train/<key>` (loss, grad_norm, lr, tokens, tokens_per_s, memory_bytes, mfu, ...), an
evaluation as `eval/<key>` (eval/loss, eval/ppl, eval/tokens, eval/time_s). At open each also
gets the run: its config (W&B config, MLflow params, TensorBoard text) and the plan of this run
(the planner's JSON for its strategy, docs/plan-json.md: W&B config `plan` and an artifact with
config.yaml + plan.json; MLflow params `plan.*` and the same two files as run artifacts).

The protocol is three calls: `open_tracker(name, ...)` returns a `Tracker` whose `log(metrics,
step)` and `close(status, summary)` the `Trackers` set calls. A tracker that fails to open fails
the run at its start (before step 1: nothing is lost); one that fails later is dropped with one
message on stderr and the run goes on (metrics.jsonl keeps every record).

Offline by default where it can be: MLflow writes a file store under the output directory
unless a tracking URI is given; W&B honours `logging.wandb.mode: offline` / WANDB_MODE=offline
(the run stays under `dir` until `wandb sync`). Which packages a listed tracker needs, and W&B's
credentials when it logs online, are checked before any rank starts (`check_installed`, called by
preflight).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shardwise import strict_json
from shardwise.errors import ShardwiseError

# tracker -> (module it imports, the distribution that provides it, the extra that installs it)
REQUIRES = {"tensorboard": ("tensorboard", "tensorboard", "train"), "wandb": ("wandb", "wandb", "tracking"),
            "mlflow": ("mlflow", "mlflow-skinny", "tracking")}  # fmt: skip
MLFLOW_STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


def check_installed(cfg: Any) -> None:
    """Every tracker `logging.trackers` lists can be imported: refused here, before any rank
    starts, naming the install command (not one traceback per rank after the model is built)."""
    missing = [t for t in cfg.logging.trackers if not _found(REQUIRES[t][0])]
    if missing:
        names = ", ".join(f"{t} (needs {REQUIRES[t][1]})" for t in missing)
        extras = ",".join(sorted({REQUIRES[t][2] for t in missing}))
        raise ShardwiseError(f"{cfg.source}: logging.trackers lists {names}, not installed: pip install "
                             f"'shardwise[{extras}]' (or pip install {' '.join(REQUIRES[t][1] for t in missing)}), "
                             "or remove it from logging.trackers")
    if "wandb" in cfg.logging.trackers:
        check_wandb_credentials(cfg)


def check_wandb_credentials(cfg: Any) -> None:
    """W&B online needs credentials before the ranks start: without them wandb.init asks on
    rank 0's terminal (while the other ranks wait in their first collective) or fails there.
    `wandb.login(prompt=False, verify=False)` looks (environment, .netrc, settings) without
    asking and without the network."""
    mode = cfg.logging.wandb.mode or os.environ.get("WANDB_MODE") or "online"
    if mode not in ("online", "run"):
        return
    import contextlib
    import io

    import wandb

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its "API key is configured" lines
            found = wandb.login(prompt=False, verify=False)
    except Exception as e:  # e.g. a malformed WANDB_API_KEY
        raise ShardwiseError(f"{cfg.source}: logging.trackers lists wandb: its credentials were refused "
                             f"({type(e).__name__}: {e})") from None
    if not found:
        raise ShardwiseError(f"{cfg.source}: logging.trackers lists wandb, online (logging.wandb.mode "
                             f"{cfg.logging.wandb.mode!r}, WANDB_MODE {os.environ.get('WANDB_MODE')!r}), but no W&B "
                             "credentials are set up: run `wandb login` or set WANDB_API_KEY, or log offline "
                             "(logging.wandb.mode: offline; `wandb sync` uploads the run later)")


def _found(module: str) -> bool:
    """Whether `module` can be found (not imported: wandb and mlflow take a second or more)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a module without a spec
        return False


def tracker_metrics(row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A metrics.jsonl row as the trackers log it: its step, and its numbers named `train/<key>`,
    or `eval/<key>` without the `eval_` prefix for an evaluation (`"kind": "eval"`)."""
    evaluation = row.get("kind") == "eval"
    out = {}
    for k, v in row.items():
        if k in ("step", "kind") or isinstance(v, bool) or not isinstance(v, int | float):
            continue
        out[f"eval/{k.removeprefix('eval_')}" if evaluation else f"train/{k}"] = v
    return int(row["step"]), out


@dataclass(frozen=True)
class RunInfo:
    """What a tracker attaches to its run when it opens."""

    name: str
    output_dir: Path
    config: dict[str, Any]  # the TrainConfig as JSON (what the checkpoint manifests record)
    plan: dict[str, Any] | None  # the planner's JSON for this run's strategy (docs/plan-json.md)
    tags: dict[str, str]  # shardwise.run_id, shardwise.lineage, shardwise.version, ...

    def config_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.config, sort_keys=False)

    def plan_summary(self) -> dict[str, Any]:
        """The plan's headline numbers (flat): strategy, engine, fits, GPU, planned bytes and time."""
        if not self.plan or not self.plan.get("strategies"):
            return {}
        s = self.plan["strategies"][0]
        return {"strategy": s["name"], "engine": s["engine"], "runs_as": s["runs_as"], "fits": s["fits"],
                "gpu": self.plan["hardware"]["gpu"], "gpus": self.plan["hardware"]["gpus"],
                "gpu_bytes": s["memory"]["total"], "usable_bytes": s["usable_bytes"],
                "step_s": s["time"]["step_s"], "tokens_per_s_per_gpu": s["time"]["tokens_per_s_per_gpu"],
                "mfu": s["time"]["mfu"]}  # fmt: skip


def run_plan(run: Any) -> dict[str, Any]:
    """The planner's JSON (docs/plan-json.md) for the run's RunSpec: the same specs and strategy
    preflight checked, memory, communication and time."""
    from shardwise.plan.evaluate import evaluate
    from shardwise.plan.report import plan_json

    e = evaluate(run.model, run.hardware, run.train, run.strategy)
    return plan_json(run.model, run.hardware, run.train, [e], profile=run.config.hardware.profile)


def run_info(cfg: Any, run: Any = None) -> RunInfo:
    """The RunInfo of this run: its config, the plan of its RunSpec (when given) and its tags."""
    from shardwise.train.checkpoint.lineage import read_lineage
    from shardwise.versions import package_versions

    out = Path(cfg.checkpointing.output_dir)
    tags = {"shardwise.version": package_versions(("shardwise",)).get("shardwise") or "unknown"}
    lineage = read_lineage(out)
    if lineage is not None:
        tags["shardwise.run_id"] = lineage.run_id
        tags["shardwise.lineage"] = lineage.lineage or "legacy"
    if run is not None:
        tags |= {"shardwise.strategy": run.strategy.name, "shardwise.world_size": str(run.world_size)}
    return RunInfo(name=cfg.name, output_dir=out, config=cfg.model_dump(mode="json"),
                   plan=run_plan(run) if run is not None else None, tags=tags)  # fmt: skip


class Tracker(Protocol):
    name: str
    location: dict[str, str]  # where its run is (summary.json `trackers`)

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, status: str, summary: dict[str, Any]) -> None: ...


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (MLflow params are flat)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, logging: Any, info: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        from shardwise.train.outputs import files_under, record_own

        self.out = info.output_dir
        self.before = files_under(self.out, "tensorboard")
        self.writer = SummaryWriter(str(info.output_dir / "tensorboard"))
        self.location = {"logdir": str(info.output_dir / "tensorboard")}
        self.writer.add_text("config", "```yaml\n" + info.config_yaml() + "```", 0)
        if info.plan is not None:
            self.writer.add_text("plan", "```json\n" + strict_json.dumps(info.plan, indent=1) + "\n```", 0)
        self.writer.flush()
        # its event file is shardwise's: a later fresh run may replace it (shardwise.train.outputs)
        record_own(self.out, "tensorboard", sorted(files_under(self.out, "tensorboard") - self.before))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self, status: str, summary: dict[str, Any]) -> None:
        from shardwise.train.outputs import files_under, record_own

        self.writer.close()
        record_own(self.out, "tensorboard", sorted(files_under(self.out, "tensorboard") - self.before))


class WandbTracker:
    """One W&B run per training invocation (a resumed run is a new W&B run in the same group,
    the lineage, unless WANDB_RUN_ID/WANDB_RESUME say otherwise: wandb reads them itself)."""

    name = "wandb"

    def __init__(self, logging: Any, info: RunInfo):
        import wandb

        o = logging.wandb
        d = Path(o.dir or os.environ.get("WANDB_DIR") or info.output_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=o.project, entity=o.entity, mode=o.mode, dir=str(d), name=info.name,
            group=o.group or info.tags.get("shardwise.lineage"), tags=o.tags or None, job_type="train",
            config={**info.config, "plan": info.plan_summary(), "shardwise": info.tags})  # fmt: skip
        if self.run.settings.mode == "disabled":  # a stand-in run: nothing is recorded, nor are files
            self.location = {"mode": "disabled"}
            return
        self.location = {"id": self.run.id, "dir": str(Path(self.run.dir).parent), "mode": self.run.settings.mode}
        # The files sit in the run's own directory (synced with it, not in wandb's staging cache);
        # the artifact references them in place.
        files = {"config.yaml": info.config_yaml()}
        if info.plan is not None:
            files["plan.json"] = strict_json.dumps(info.plan, indent=1) + "\n"
        art = wandb.Artifact(re.sub(r"[^\w.-]", "_", f"{info.name}-run"), type="shardwise-run",
                             metadata={"plan": info.plan_summary(), **info.tags})  # fmt: skip
        for name, text in files.items():
            path = Path(self.run.dir) / name
            path.write_text(text)
            art.add_file(str(path), name=name, policy="immutable")
        self.run.log_artifact(art)
        if self.run.settings.mode == "online":  # (offline, wandb warns that there is none)
            self.location["url"] = str(self.run.url)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str, summary: dict[str, Any]) -> None:
        self.run.summary.update({f"shardwise/{k}": v for k, v in summary.items()
                                 if isinstance(v, str | int | float | type(None))})  # fmt: skip
        if status == "interrupted":  # stopped by a signal after a checkpoint: W&B shows it preempted
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "completed" else 1)


class MlflowTracker:
    """One MLflow run per training invocation, through `MlflowClient` (no global active run)."""

    name = "mlflow"

    def __init__(self, logging: Any, info: RunInfo):
        o = logging.mlflow
        uri = o.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (info.output_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses its file store unless asked (it is "in maintenance mode"); a local file
            # store is what works offline with mlflow-skinny, so ask (a user's setting wins).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.client = c = MlflowClient(tracking_uri=uri)
        self.uri = uri
        exp = c.get_experiment_by_name(o.experiment)
        eid = exp.experiment_id if exp is not None else c.create_experiment(o.experiment)
        self.run_id = c.create_run(eid, run_name=info.name, tags={**info.tags, **o.tags}).info.run_id
        self.location = {"tracking_uri": uri, "experiment_id": eid, "run_id": self.run_id}
        params = flatten(info.config) | {f"plan.{k}": v for k, v in info.plan_summary().items()}
        items = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                 for k, v in params.items()]  # fmt: skip
        items = [Param(p.key, p.value[:MAX_PARAM_VAL_LENGTH]) for p in items]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            c.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])
        c.log_text(self.run_id, info.config_yaml(), "config.yaml")
        if info.plan is not None:
            c.log_dict(self.run_id, strict_json.encode(info.plan), "plan.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def close(self, status: str, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, strict_json.encode(summary), "summary.json")
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FAILED"))


OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def open_tracker(name: str, logging: Any, info: RunInfo) -> Tracker:
    return OPENERS[name](logging, info)


class Trackers:
    """The trackers of one run (rank 0): opened together, fed every metrics.jsonl row."""

    def __init__(self) -> None:
        self.open: list[Tracker] = []
        self.where: dict[str, dict[str, str]] = {}  # tracker -> where its run is (kept if it fails later)
        self.failed: dict[str, str] = {}  # tracker -> what made it stop
        self.dropped: list[Tracker] = []  # failed while logging: still closed at the end (best effort)

    def start(self, cfg: Any, run: Any = None) -> None:
        """Open every tracker of `cfg.logging.trackers`; one that cannot start closes the others
        and raises (the run fails at its start, before step 1)."""
        if not cfg.logging.trackers:
            return
        info = run_info(cfg, run)
        for name in cfg.logging.trackers:
            try:
                self.open.append(open_tracker(name, cfg.logging, info))
                self.where[name] = dict(self.open[-1].location)
            except Exception as e:
                self.close("failed", {})
                raise RuntimeError(f"logging.trackers: {name} could not start: {type(e).__name__}: {e}") from e

    def locations(self) -> dict[str, dict[str, str]]:
        return dict(self.where)

    def log(self, row: dict[str, Any]) -> None:
        """One metrics.jsonl row (a train record or an evaluation) to every tracker."""
        if not self.open:
            return
        step, metrics = tracker_metrics(row)
        for t in list(self.open):
            try:
                t.log(metrics, step)
            except Exception as e:  # the run goes on: metrics.jsonl has every record
                self.open.remove(t)
                self.dropped.append(t)
                self.failed[t.name] = f"step {step}: {type(e).__name__}: {e}"
                print(f"shardwise: logging.trackers: {t.name} failed at step {step} and is dropped for the rest "
                      f"of the run ({type(e).__name__}: {e}); metrics.jsonl keeps every record",
                      file=sys.stderr, flush=True)  # fmt: skip

    def close(self, status: str, summary: dict[str, Any]) -> None:
        while self.dropped:  # its run ends with the others' status where its server lets it
            try:
                self.dropped.pop(0).close(status, summary)
            except Exception:
                pass  # said when it was dropped
        while self.open:
            t = self.open.pop(0)
            try:
                t.close(status, summary)
            except Exception as e:
                self.failed[t.name] = f"close: {type(e).__name__}: {e}"
                print(f"shardwise: logging.trackers: {t.name} could not close ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)  # fmt: skip
