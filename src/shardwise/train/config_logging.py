"""The training YAML's `logging:` section (shardwise.train.config's TrainConfig.logging): how often
and where a run reports — the console (shardwise.console), metrics.jsonl and the experiment
trackers (shardwise.train.trackers), with the keys `logging.trackers` replaced still read."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from shardwise.config_fields import Finite, Int, NonBlank
from shardwise.errors import did_you_mean
from shardwise.train.config_base import Section as _Section

# The experiment trackers `logging.trackers` may list (shardwise.train.trackers opens them).
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")
# The keys `logging.trackers` replaced, still read (a checkpoint's manifest records them) and
# rewritten into the new ones; `shardwise train` says so (LoggingSection.deprecation).
LEGACY_LOGGING_KEYS = ("tensorboard", "wandb", "wandb_project")


class WandbSection(_Section):
    """`logging.wandb`: Weights & Biases options (used when `wandb` is in logging.trackers)."""

    project: str = Field("shardwise", min_length=1, description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user); null: WANDB_ENTITY, else the "
                               "logged-in user's default")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="online; offline (the run is written under `dir` only, `wandb sync` uploads it "
        "later); disabled; null: WANDB_MODE, else online")
    dir: NonBlank | None = Field(None, description="directory W&B writes its run files under (a wandb/ folder); "
                            "null: WANDB_DIR, else checkpointing.output_dir")
    group: str | None = Field(None, description="W&B group; null: the run's lineage, so a resumed run is "
                              "grouped with the run it continues")
    tags: list[str] = Field(default_factory=list, description="W&B tags of the run")


class MlflowSection(_Section):
    """`logging.mlflow`: MLflow options (used when `mlflow` is in logging.trackers)."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (http://host:5000, databricks, sqlite:///mlflow.db, file:/dir); "
        "null: MLFLOW_TRACKING_URI, else a file store in checkpointing.output_dir/mlruns")
    experiment: str = Field("shardwise", min_length=1, description="MLflow experiment (created when missing)")
    tags: dict[str, str] = Field(default_factory=dict, description="MLflow tags of the run")


class LoggingSection(_Section):
    # 10: torchtitan's metrics.log_freq default
    every: Int = Field(10, gt=0, description="log every N steps: the losses and gradient norms reach the host "
                       "once per N steps (a step does not wait for the device in between) and the progress line "
                       "gets every N-th step; metrics.jsonl and the trackers get every step's record (written "
                       "then)")
    every_seconds: Finite | None = Field(60.0, gt=0, description="also log once this many seconds passed since "
                                        "the last logged step (whichever of every / every_seconds comes first): "
                                        "a batch log shows progress however slow a step is; null: steps only")
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        "auto", description="auto: a rich progress bar on a terminal, plain timestamped lines (never redrawn or "
        "cut) when stdout is not one (sbatch, nohup, a pipe); bar, lines, off force one (true = auto, "
        "false = off)")
    trackers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description=f"experiment trackers that get metrics.jsonl's records (train and eval), the run config "
        f"and the plan: any of {', '.join(TRACKER_NAMES)} ([] for none); wandb and mlflow need "
        "pip install 'shardwise[tracking]'")
    wandb: WandbSection = Field(default_factory=WandbSection, description="Weights & Biases options")
    mlflow: MlflowSection = Field(default_factory=MlflowSection, description="MLflow options")
    # the deprecated keys this section was written with (set by _legacy_keys; not a field)
    _legacy: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("progress", mode="before")
    @classmethod
    def _progress_bool(cls, v: Any) -> Any:
        return {True: "auto", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("trackers")
    @classmethod
    def _known_trackers(cls, v: list[str]) -> list[str]:
        names = [t.strip().lower() for t in v]
        for t in names:
            if t not in TRACKER_NAMES:
                raise ValueError(f"unknown tracker {t!r}. {did_you_mean(t, TRACKER_NAMES)}")
        twice = sorted({t for t in names if names.count(t) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once")
        return names

    @model_validator(mode="wrap")
    @classmethod
    def _legacy_keys(cls, data: Any, handler: Any) -> LoggingSection:
        data, legacy = _translate_legacy(data)
        section = handler(data)
        section._legacy = legacy
        return section

    def deprecation(self, where: str) -> str | None:
        """The note `shardwise train` prints when the config used the old keys: what they were
        read as, in the new spelling to write instead."""
        if not self._legacy:
            return None
        new = f"logging.trackers: [{', '.join(self.trackers)}]"
        if "wandb_project" in self._legacy:
            new += f" and logging.wandb.project: {self.wandb.project}"
        old = ", ".join(f"logging.{k}" for k in self._legacy)
        return (f"{where}: {old} {'is' if len(self._legacy) == 1 else 'are'} deprecated; this run uses {new} "
                "(where both are given, the new keys win); write that instead, the old keys will be removed")


def _translate_legacy(data: Any) -> tuple[Any, tuple[str, ...]]:
    """`logging` as written before `trackers` (tensorboard: bool, wandb: bool, wandb_project)
    rewritten into trackers + logging.wandb.project. The new keys win where both are given (a
    `--set logging.trackers=[...]` over a file with the old keys means what it says)."""
    if not isinstance(data, dict):
        return data, ()
    legacy = tuple(k for k in LEGACY_LOGGING_KEYS
                   if k in data and (k != "wandb" or isinstance(data[k], bool)))
    if not legacy:
        return data, ()
    data = dict(data)
    tensorboard = data.pop("tensorboard", True)
    wandb = data.pop("wandb") if "wandb" in legacy else False
    for key, value in (("tensorboard", tensorboard), ("wandb", wandb)):
        if not isinstance(value, bool):
            raise ValueError(f"logging.{key} = {value!r}: expected true or false (deprecated key: use "
                             "logging.trackers: [tensorboard, wandb, mlflow])")
    data.setdefault("trackers", [name for name, on in (("tensorboard", tensorboard), ("wandb", wandb)) if on])
    if "wandb_project" in data:
        project = data.pop("wandb_project")
        data["wandb"] = {"project": project, **(data.get("wandb") or {})}
    return data, legacy
