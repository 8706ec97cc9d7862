"""Pipeline parallelism through the run bridge: one rule decides what the trainer's stages run
(shardwise.specs.pipeline: `stage_engine_refusal` for the strategy, `trainer_pp_gap` for the model
and the run), and the bridge's check, `Strategy.trainable` and the recommender's gaps all say it;
`to_config` writes a trainable pipeline (pp, pp_schedule, pp_virtual_stages) and `run_spec` reads
the same Strategy and layout back."""

from __future__ import annotations

import os

import pytest
import yaml

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from shardwise.catalog import build_hardware, get_model
from shardwise.config.load import load_config
from shardwise.config.schema import TrainConfig
from shardwise.config.strategy import STRATEGIES
from shardwise.errors import ShardwiseError
from shardwise.plan.recommend import tool_for, trainer_gaps
from shardwise.run import config_dict, run_spec, to_config
from shardwise.run.bridge import model_spec, strategy, train_spec
from shardwise.specs import ParallelLayout, Strategy, TrainSpec
from shardwise.specs.pipeline import stage_engine_refusal, trainer_pp_gap

NODE = {"LOCAL_WORLD_SIZE": "8"}


def _config(name: str, *, tp: int = 1, pp: int = 2, model: str = "tiny-llama", grad_accum: int = 2,
            **extra) -> TrainConfig:
    raw = {"model": {"name": model}, "strategy": {"name": name, "tp": tp, "pp": pp},
           "run": {"grad_accum": grad_accum, "device": "cuda"}, "hardware": {"gpu": "h100-sxm"}}
    for key, value in extra.items():  # "section__field" or a top-level key
        section, _, field = key.partition("__")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw[key] = value
    return TrainConfig.model_validate(raw)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", [n for n, f in STRATEGIES.items() if f.combines_with_pp])
def test_trainable_is_what_the_bridge_accepts(name, tp):
    """For every strategy that can be laid out in stages: `Strategy.trainable` at pp 2 holds
    exactly where `run_spec` (check_tensor_parallel, check_pipeline) accepts the run of a model
    the stages cover: FSDP2 without offload, DTensor's TP inside the stages."""
    s = Strategy.from_name(name, tp=tp, pp=2)
    cfg = _config(name, tp=tp)
    if s.trainable:
        run = run_spec(cfg, 16, "cuda", environ=NODE)
        assert (run.layout.pp, run.layout.tp) == (2, tp) and run.strategy.engine == "fsdp2"
        assert stage_engine_refusal(s) is None and trainer_gaps(s, run.train, run.model) == []
        return
    with pytest.raises(ShardwiseError) as err:
        run_spec(cfg, 16, "cuda", environ=NODE)
    why = stage_engine_refusal(s)  # every strategy the stages do not run is refused for itself
    assert why is not None
    # the pipeline's reason, or (DDP, ZeRO-0 × TP) the tensor-parallel check that runs first
    assert f"strategy.pp 2 with strategy {name!r}: {why}" in str(err.value) or (
        tp > 1 and f"strategy.tp {tp}" in str(err.value))
    gaps = trainer_gaps(s, TrainSpec(grad_accum=2), get_model("tiny-llama"))
    assert f"pipeline parallelism (pp 2) with {name}" in gaps


CASES = {  # what the model or the run decides on top of a trainable strategy
    "tied embeddings": ({"model": "tiny-qwen"}, "ties lm_head to the input embedding"),
    "a family the stages do not cover": ({"model": "tiny-mixtral"}, "not 'mixtral'"),
    "fp16": ({"precision": "fp16-mixed"}, "fp16-mixed under pipeline stages"),
    "activation offloading": ({"checkpointing__offload": True}, "activation offloading (checkpointing.offload)"),
    "a low-bit AdamW": ({"optimizer__name": "adamw8bit"}, "optimizer 'adamw8bit' under pipeline stages"),
    "too few micro-batches for 1F1B": ({"grad_accum": 1}, "grad_accum 1 < pp 2"),
}


@pytest.mark.parametrize("case", CASES)
def test_model_and_run_refusals_are_one_rule(case):
    """The bridge refuses, naming strategy.pp (or the schedule's fields), with the reason
    `trainer_pp_gap` gives; the recommender marks the same row plan-only with that reason and
    names the tool that runs it."""
    extra, says = CASES[case]
    cfg = _config("fsdp", **extra)
    with pytest.raises(ShardwiseError) as err:
        run_spec(cfg, 8, "cuda", environ={})
    model, s = model_spec(cfg), strategy(cfg, "cuda")
    train = train_spec(cfg, "cuda", family=model.family)
    why = trainer_pp_gap(model, s, train)
    assert why and says in why and why in str(err.value)
    assert "strategy.pp" in str(err.value)
    assert s.trainable  # the strategy itself is one the stages run
    assert f"pipeline parallelism (pp 2) for this run: {why}" in trainer_gaps(s, train, model)
    assert tool_for(s, train, model) == "torchtitan"


@pytest.mark.parametrize(("name", "tp", "schedule", "virtual"), [
    ("fsdp", 1, "1f1b", 1), ("fsdp-grad-op", 2, "gpipe", 1), ("fsdp", 2, "interleaved-1f1b", 2),
    ("fsdp-hybrid", 1, "interleaved-1f1b", 4),
])  # fmt: skip
def test_to_config_writes_the_pipeline_and_run_spec_reads_it_back(name, tp, schedule, virtual, tmp_path):
    """The one inverse: a trainable PP Strategy → TrainConfig → shardwise.yaml (config_dict, the
    emitted form) → load_config → run_spec gives the same Strategy and ParallelLayout, and the
    YAML states the pipeline's degree, schedule and stages a rank."""
    m, hw = get_model("llama-2-7b"), build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8)
    s = Strategy.from_name(name, tp=tp, pp=2, pp_schedule=schedule, pp_virtual_stages=virtual)
    cfg, notes = to_config(m, hw, TrainSpec(micro_batch=1, grad_accum=8, checkpointing="full"), s)
    assert not notes
    raw = config_dict(cfg)
    assert {k: raw["strategy"].get(k) for k in ("pp", "pp_schedule", "pp_virtual_stages")} == {
        "pp": 2, "pp_schedule": schedule, "pp_virtual_stages": virtual}
    path = tmp_path / "shardwise.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = run_spec(load_config(path), hw.world_size, "cuda", environ={})
    assert run.strategy == s
    assert run.layout == ParallelLayout.for_strategy(s, hw.world_size, hw.gpus_per_node)
    assert (run.layout.tp, run.layout.pp) == (tp, 2)


def test_a_pipeline_at_its_default_schedule_is_still_written_out():
    """config_dict leaves tp/pp 1 and, at pp 1, the schedule's defaults out; a pipeline keeps its
    schedule even at the default (1f1b, one stage a rank): it says what its stages run."""
    flat_cfg = TrainConfig.model_validate({"strategy": {"name": "fsdp"}})
    assert not {"tp", "pp", "pp_schedule", "pp_virtual_stages"} & set(config_dict(flat_cfg)["strategy"])
    piped = TrainConfig.model_validate({"strategy": {"name": "fsdp", "pp": 2}})
    written = config_dict(piped)["strategy"]
    assert {k: written.get(k) for k in ("pp", "pp_schedule", "pp_virtual_stages")} == {
        "pp": 2, "pp_schedule": "1f1b", "pp_virtual_stages": 1}


def test_to_config_still_refuses_what_the_stages_do_not_run():
    hw = build_hardware(gpus=8)
    for s in (Strategy.from_name("zero1", pp=2), Strategy.from_name("fsdp+offload", pp=2),
              Strategy.from_name("ddp", pp=2)):
        with pytest.raises(ShardwiseError, match=r"pipeline parallelism with FSDP2 \(no offload\)"):
            to_config(get_model("llama-2-7b"), hw, TrainSpec(grad_accum=4), s)
