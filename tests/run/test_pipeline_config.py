"""strategy.pp in the one schema: what the trainer's pipeline runs is accepted with its layout, and
everything else is refused before any rank starts, naming the field and what to set instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config.load import load_config
from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.run import run_spec
from shardwise.run.bridge import config_dict
from shardwise.specs.pipeline import rank_stages, stage_layers


def _cfg(strategy: dict, **sections) -> TrainConfig:
    raw = {"model": {"name": "tiny-llama"}, "data": {"kind": "synthetic"}, "strategy": {"name": "fsdp", **strategy},
           "run": {"micro_batch": 1, "grad_accum": 4, "device": "cpu"}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainConfig.model_validate(raw)


def test_the_layout_of_a_pipeline_run():
    run = run_spec(_cfg({"pp": 2, "tp": 2}), 8, "cpu")
    assert (run.layout.pp, run.layout.tp, run.layout.dp_shard) == (2, 2, 2)
    assert (run.strategy.pp, run.strategy.pp_schedule, run.strategy.pp_virtual_stages) == (2, "1f1b", 1)


def test_the_yaml_round_trip_keeps_the_pipeline(tmp_path):
    import yaml

    cfg = _cfg({"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}, model={"name": "llama-3.2-1b"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config_dict(cfg)))
    back = load_config(path)
    assert (back.strategy.pp, back.strategy.pp_schedule, back.strategy.pp_virtual_stages) == (2, "interleaved-1f1b", 2)
    plain = config_dict(_cfg({}))
    assert not {"pp", "pp_schedule", "pp_virtual_stages"} & set(plain["strategy"])  # defaults stay unwritten


@pytest.mark.parametrize("strategy, sections, world, needle", [
    ({"pp": 2, "name": "zero1"}, {}, 2, "strategy.pp 2 with strategy 'zero1'"),
    ({"pp": 2, "name": "ddp"}, {}, 2, "DDP replicates the whole model"),
    ({"pp": 2, "name": "fsdp+offload"}, {}, 2, "offloading to the host is not built"),
    ({"pp": 2}, {"model": {"name": "tiny-qwen"}}, 2, "ties lm_head to the input embedding"),
    ({"pp": 2}, {"model": {"name": "tiny-mixtral"}}, 2, "not 'mixtral'"),
    ({"pp": 2}, {"precision": "fp16-mixed"}, 2, "fp16-mixed under pipeline stages"),
    ({"pp": 2}, {"checkpointing": {"offload": True}}, 2, "activation offloading (checkpointing.offload) under pipeline stages"),
    ({"pp": 2}, {"optimizer": {"name": "adamw8bit"}}, 2, "optimizer 'adamw8bit' under pipeline stages"),
    ({"pp": 2}, {"run": {"grad_accum": 1}}, 2, "grad_accum 1 < pp 2"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}, {}, 2, "need a decoder layer each"),
    ({"pp": 2, "pp_virtual_stages": 2}, {}, 2, "pp_virtual_stages 2 with pp_schedule '1f1b'"),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b"}, {}, 2, "runs at least 2 stages per rank"),
    ({"pp_virtual_stages": 2}, {}, 1, "needs pipeline parallelism"),
    ({"pp": 3}, {}, 2, "strategy.pp 3 cannot run on 2 rank(s)"),
])
def test_what_the_pipeline_does_not_run_is_refused_before_ranks_start(strategy, sections, world, needle):
    with pytest.raises(ShardwiseError) as e:
        run_spec(_cfg(strategy, **sections), world, "cpu")
    assert needle in str(e.value)


def test_an_unknown_schedule_is_refused_naming_the_field():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        _cfg({"pp": 2, "pp_schedule": "zb-v"})
    assert "pp_schedule" in str(e.value)


@pytest.mark.parametrize("layers, stages, want", [
    (4, 2, [[0, 1], [2, 3]]),
    (10, 4, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),  # the longer stages first, as numpy.array_split
    (80, 8, [list(range(i, i + 10)) for i in range(0, 80, 10)]),
])
def test_stage_layers_split_consecutively(layers, stages, want):
    assert [list(r) for r in stage_layers(layers, stages)] == want


def test_rank_stages_loop_over_the_pipeline():
    """Interleaved: rank r runs stages r, r + pp, ... (torch's and torchtitan's "loop" order)."""
    assert [rank_stages(r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ShardwiseError, match="at least one decoder layer"):
        stage_layers(2, 4)


def test_the_demo_config_names_no_pipeline():
    """The README's demo stays a pp-1 run; `--set strategy.pp=2` is what tests/train/test_pipeline_cli.py runs."""
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")
    assert cfg.strategy.pp == 1
