"""`shardwise plan` plans what `shardwise train` runs: one schema, one default per field.

Which fields of the schema the planner reads is found, not listed: each leaf of TrainConfig is
changed in turn and the bridge (shardwise.run.train_spec) says whether the planned TrainSpec
moves. Every such field is a plan flag (shardwise.config.flags.RUN_FLAGS) or one of the few
read another way (EXCEPT, each with its reason). Then, for every run flag, a bare `shardwise plan
--json` (only the scenario: model, GPUs) reports the schema's default, and so do `plan --from` a
shardwise YAML that sets nothing and the RunSpec `shardwise train` builds from that YAML."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.config.flags import RUN_FLAGS, schema_default
from shardwise.config.load import load_config
from shardwise.config.schema import TrainConfig
from shardwise.run.bridge import run_spec, strategy, train_spec, trainer_knobs

MODEL, GPUS = "qwen2.5-0.5b", 2
# Schema fields the planner reads other than through a run flag of their own.
EXCEPT = {
    "data.kind": "synthetic data: seq_len from data.synthetic.seq_len, no packed documents (the --seq-len "
                 "flag's note; --packed-attention none)",
    "data.synthetic.seq_len": "--seq-len, for synthetic data",
    "lora.quantization": "--qlora",
}


def _leaves(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, annotation) of every leaf field of a section class, nested sections walked."""
    out = []
    for name, f in cls.model_fields.items():
        if f.exclude:
            continue
        ann = f.annotation
        args = [a for a in get_args(ann) if a is not type(None)]
        inner = args[0] if get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1 else ann
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            out += _leaves(inner, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", ann))
    return out


def _other_values(ann: Any, default: Any) -> list[Any]:
    """Values other than the default that a field of this type takes."""
    union = get_origin(ann) in (typing.Union, types.UnionType)
    out: list[Any] = []
    for k in get_args(ann) if union else (ann,):
        base = get_args(k)[0] if get_origin(k) is typing.Annotated else k
        if get_origin(base) is Literal:
            out += list(get_args(base))
        elif base is bool:
            out += [True, False]
        elif base is type(None):
            out.append(None)
        elif base is int and not isinstance(default, str):
            out.append((default or 1) + 1)
        elif base is float and not isinstance(default, str):
            out += [(default or 0.5) * 0.5, 0.1]
        elif get_origin(base) is list:
            out.append(["q_proj"])
    return [v for v in out if v != default]


def _set(raw: dict, key: str, value: Any) -> dict:
    node = raw
    *path, last = key.split(".")
    for p in path:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[last] = value
    return raw


def _planned(cfg: TrainConfig) -> tuple:
    return train_spec(cfg, "cuda", family="qwen2"), strategy(cfg, "cuda")


def test_every_field_the_planner_reads_is_a_plan_flag():
    flags = {f.key for f in RUN_FLAGS}
    found = set()
    for key, ann in _leaves(TrainConfig):
        base_raw = {"lora": {}} if key.startswith("lora.") else {}
        base = _planned(TrainConfig.model_validate(base_raw))
        default = schema_default(key)
        for value in _other_values(ann, default):
            try:
                cfg = TrainConfig.model_validate(_set(json.loads(json.dumps(base_raw)), key, value))
                moved = _planned(cfg)
            except Exception:  # a value the schema refuses, or a combination the bridge refuses
                continue
            if moved[0] != base[0]:
                found.add(key)
    assert {"run.micro_batch", "loss.implementation", "lora.target_modules"} <= found  # the walk sees the bridge
    unflagged = sorted(found - flags - set(EXCEPT))
    assert not unflagged, f"schema fields the planner reads with no plan flag: {unflagged}"
    # a key with one value in the schema (optimizer.name: adamw) cannot move the plan; the planner
    # prices the values it names beyond the trainer's (--optimizer sgd, adamw8bit, ...)
    single = {k for k, ann in _leaves(TrainConfig) if not _other_values(ann, schema_default(k))}
    stale = sorted(flags - found - single)
    assert not stale, f"plan flags whose YAML key the planner does not read: {stale}"


def _plan(*args: str) -> dict:
    r = CliRunner().invoke(app, ["plan", "--model", MODEL, "--gpus", str(GPUS), "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def yaml_run(tmp_path_factory) -> tuple[dict, Any]:
    """A shardwise YAML that sets only the model and the rank count: its plan and its RunSpec."""
    f = tmp_path_factory.mktemp("one-schema") / "run.yaml"
    f.write_text(f"model: {{name: {MODEL}}}\nrun: {{nproc: {GPUS}, device: cuda}}\n")
    r = CliRunner().invoke(app, ["plan", str(f), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), run_spec(load_config(f), GPUS, "cuda", environ={})


# The planned value of a field whose schema default is one value (not resolved for the device,
# the model or the strategy), as the planner spells it.
def _spelled(param: str, default: Any) -> Any:
    if param == "lora_rank":
        return 0 if TrainConfig().lora is None else default  # no lora section: full fine-tuning
    if param in ("lora_targets", "lora_modules_to_save"):
        return [default] if isinstance(default, str) else list(default)
    return default


RESOLVED = {"packed_attention", "optimizer_impl", "fused_kernels"}  # the trainer resolves them for the run


@pytest.mark.parametrize("flag", RUN_FLAGS, ids=[f.param for f in RUN_FLAGS])
def test_bare_plan_from_yaml_and_train_agree_on_each_run_flag(flag, yaml_run):
    lora = flag.key.startswith("lora.") and flag.param != "lora_rank"
    bare = _plan(*(("--lora-rank", "8") if lora else ()))["train"][flag.param]
    from_yaml, run = yaml_run
    if not lora:
        assert from_yaml["train"][flag.param] == bare  # plan --from the YAML
        trained = getattr(run.train, flag.param)  # shardwise train's RunSpec
        planned = bare
        if flag.param == "checkpointing":  # "auto": decided per row, as the trainer decides it for its run
            [row] = [r for r in from_yaml["strategies"] if r["name"] == run.strategy.name]
            planned = row["checkpointing"]
            assert row["checkpointing_choice"]["reason"] == run.recompute.reason
        assert (list(trained) if isinstance(trained, tuple) else trained) == planned
    if flag.param not in RESOLVED:
        assert bare == _spelled(flag.param, schema_default(flag.key))


def test_the_resolved_defaults_are_the_trainers_on_cuda(yaml_run):
    """run.compile, optimizer.fused and data.sft.packed_attention are unset or `auto` in the schema:
    on CUDA the trainer compiles the fsdp/ddp layers, runs fused AdamW and keeps packed documents
    apart in the attention kernel; the bare plan says so per strategy."""
    bare = _plan()
    assert schema_default("run.compile") is None and schema_default("optimizer.fused") is None
    assert bare["train"]["optimizer_impl"] == "fused" and bare["train"]["packed_attention"] != "none"
    assert bare["train"]["compiled_engines"] == ["fsdp2", "ddp"]


def test_bare_plan_runs_the_trainers_engine_knobs():
    rows = {r["name"]: r["knobs"] for r in _plan("-s", "zero2", "-s", "fsdp", "-s", "ddp")["strategies"]}
    ds, fsdp, ddp = trainer_knobs("cuda")
    # the plan reports the overlap DeepSpeed resolves for the stage (None: on for ZeRO-3 only)
    assert rows["zero2"] == json.loads(ds.model_dump_json()) | {"overlap_comm": ds.overlap(2)}
    assert rows["zero2"]["communication_data_type"] == "fp32"  # the trainer's reduce dtype, not DeepSpeed's auto
    assert rows["fsdp"] == json.loads(fsdp.model_dump_json())
    assert rows["ddp"] == json.loads(ddp.model_dump_json())
