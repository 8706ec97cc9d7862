"""One run description from YAML to engine (shardwise.run).

- TrainConfig -> specs -> emitted shardwise.yaml -> TrainConfig is the identity, for every
  strategy and a grid of knobs; specs -> emitted config -> specs too.
- The DeepSpeed JSON the engine hands to `deepspeed.initialize` equals the emitted ds_config.json.
- The knob defaults are DeepSpeed's own (DeepSpeedZeroConfig of the installed version).
- The preflight plan and the running engine (2 gloo ranks) agree on every memory-relevant
  setting: bucket sizes, shard group, precision, reduce dtype, resharding, checkpointing.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from shardwise.catalog import build_hardware, get_model
from shardwise.config.load import load_config
from shardwise.config.schema import TrainConfig
from shardwise.config.strategy import STRATEGY_NAMES, DeepSpeedKnobs
from shardwise.emit import emit_configs
from shardwise.plan.evaluate import evaluate
from shardwise.run import run_spec, to_config
from shardwise.specs import Strategy, TrainSpec

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"

# Knob grid: None = the trainer's default; the others differ from every default.
DS_GRID = [{}, {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 3_000_000},
           {"use_multi_rank_bucket_allreduce": False, "communication_data_type": "bf16", "overlap_comm": False},
           {"param_persistence_threshold": 0, "max_live_parameters": 10_000_000, "max_reuse_distance": 0,
            "prefetch_bucket_size": 7_000_000, "contiguous_gradients": False}]
FSDP_GRID = [{}, {"reduce_dtype": "param"}]
DDP_GRID = [{}, {"bucket_cap_mb": 100.0, "gradient_as_bucket_view": False}]
TRAIN_GRID = [
    {"precision": "bf16-mixed", "run": {"micro_batch": 2, "grad_accum": 4}, "checkpointing": {"activation": "full"}},
    {"precision": "fp16-mixed", "run": {"micro_batch": 1, "grad_accum": 1}, "model": {"attention": "eager"}},
]


def _config(name: str, knobs: dict, train: dict, nodes: int = 1) -> TrainConfig:
    engine = Strategy.from_name(name).engine
    section = {"deepspeed": "deepspeed", "fsdp2": "fsdp", "ddp": "ddp"}[engine]
    raw = {
        "name": f"rt-{name}",
        "model": {"name": "llama-2-7b", "attention": "sdpa"} | train.get("model", {}),
        "data": {"sft": {"max_length": 4096, "packing": False}},
        "strategy": {"name": name, section: knobs} | ({"shard_group": 4} if name == "fsdp-hybrid" else {}),
        "optimizer": {"lr": 3e-5, "weight_decay": 0.1, "max_grad_norm": 0.5},
        "schedule": {"kind": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1},
        "precision": train["precision"],
        "run": {"steps": 500, "nproc": 8, "device": "cuda"} | train["run"],
        "checkpointing": {"output_dir": "runs/rt"} | train.get("checkpointing", {}),
        "hardware": {"gpu": "h100-sxm", "check_memory": True} | ({"gpus_per_node": 8} if nodes > 1 else {}),
    }
    return TrainConfig.model_validate(raw)


def _cases():
    for name in STRATEGY_NAMES:
        engine = Strategy.from_name(name).engine
        grid = {"deepspeed": DS_GRID, "fsdp2": FSDP_GRID, "ddp": DDP_GRID}[engine]
        for knobs, train in itertools.product(grid, TRAIN_GRID):
            yield pytest.param(name, knobs, train, id=f"{name}-{len(knobs)}k-{train['precision']}")


@pytest.mark.parametrize(("name", "knobs", "train"), list(_cases()))
def test_config_specs_emitted_yaml_config_is_identity(name, knobs, train, tmp_path):
    nodes = 2 if name == "fsdp-hybrid" else 1
    cfg = _config(name, knobs, train, nodes)
    run = run_spec(cfg, 8 * nodes, "cuda", environ={})
    emit_configs(run.model, run.hardware, run.train, run.strategy, tmp_path, base=cfg)
    back = load_config(tmp_path / "shardwise.yaml")
    # `checkpointing.activation: auto` is written as what it was decided to be for this run: the
    # emitted file pins what was planned
    decided = cfg.checkpointing.activation if run.recompute is None else run.train.checkpointing
    assert run.recompute is None or cfg.checkpointing.activation == "auto"
    assert back.model_dump() == cfg.model_copy(update={"checkpointing": cfg.checkpointing.model_copy(
        update={"activation": decided})}).model_dump()
    # and the specs it describes are the same specs
    again = run_spec(back, 8 * nodes, "cuda", environ={})
    assert (again.strategy, again.train, again.layout, again.hardware) == (
        run.strategy, run.train, run.layout, run.hardware)
    if run.strategy.engine == "deepspeed":
        assert json.loads((tmp_path / "ds_config.json").read_text())["zero_optimization"]["reduce_bucket_size"] == (
            run.strategy.ds.reduce_bucket_size)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_specs_emitted_config_specs_is_identity(name, tmp_path):
    """From the planner's side (`plan --emit`, no config to start from)."""
    nodes = 2 if name == "fsdp-hybrid" else 1
    hw = build_hardware(gpu="a100-80g", gpus=8 * nodes, gpus_per_node=8)
    train = TrainSpec(seq_len=4096, micro_batch=2, grad_accum=8, checkpointing="full")
    s = Strategy.from_name(name, ds=DeepSpeedKnobs(reduce_bucket_size=123_456_789, communication_data_type="fp32"))
    emit_configs(get_model("llama-2-7b"), hw, train, s, tmp_path)
    # placeholders filled the way a user would (catalog model, some data file)
    filled = ["model.path=", "data.sft.train_files=[train.jsonl]"]
    run = run_spec(load_config(tmp_path / "shardwise.yaml", filled), hw.world_size, "cuda", environ={})
    # A plan without documents (packed_attention none) emits SFT data, whose packed documents the
    # trainer keeps apart in the kernel (flex, or flash-attn's varlen): priced the same as none.
    assert run.train.packed_attention in ("flex", "flash_varlen")
    assert run.strategy == s and run.train == train.model_copy(update={"packed_attention": run.train.packed_attention})
    assert run.hardware == hw
    planned, runs = evaluate(run.model, hw, train, s), evaluate(run.model, hw, run.train, s)
    assert (runs.memory.gpu, runs.time) == (planned.memory.gpu, planned.time)
    assert run.model == get_model("llama-2-7b")


@pytest.mark.parametrize("name", [n for n in STRATEGY_NAMES if Strategy.from_name(n).engine == "deepspeed"])
def test_engine_receives_the_emitted_deepspeed_json(name, tmp_path, monkeypatch):
    """Capture what DeepSpeedEngine hands to `deepspeed.initialize` for a run, and compare it
    with the ds_config.json `plan --emit` writes for the same run."""
    import deepspeed
    import torch

    from shardwise.train.engines.base import DistEnv
    from shardwise.train.engines.deepspeed import DeepSpeedEngine

    cfg = _config(name, DS_GRID[1], TRAIN_GRID[0])
    run = run_spec(cfg, 8, "cuda", environ={})
    seen = {}

    class Captured(Exception):
        pass

    def fake_initialize(**kw):
        seen.update(kw)
        raise Captured

    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    with pytest.raises(Captured):
        DeepSpeedEngine(torch.nn.Linear(2, 2), run, DistEnv(device="cuda", world_size=8))
    emit_configs(run.model, run.hardware, run.train, run.strategy, tmp_path, base=cfg)
    assert seen["config"] == json.loads((tmp_path / "ds_config.json").read_text())


def test_knob_defaults_are_the_installed_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ours = DeepSpeedKnobs()
    for stage in (0, 1, 2, 3):
        theirs = DeepSpeedZeroConfig(stage=stage)
        assert ours.overlap(stage) == theirs.overlap_comm, stage
    theirs = DeepSpeedZeroConfig()
    for field in ("reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients", "reduce_scatter",
                  "use_multi_rank_bucket_allreduce", "prefetch_bucket_size", "max_live_parameters",
                  "max_reuse_distance", "param_persistence_threshold"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_unset_knobs_take_the_trainers_device_defaults():
    cfg = TrainConfig.model_validate({"strategy": {"name": "zero2", "deepspeed": {"allgather_bucket_size": 7}}})
    cpu, gpu = run_spec(cfg, 2, "cpu", environ={}).strategy.ds, run_spec(cfg, 2, "cuda", environ={}).strategy.ds
    # CPU: small buckets (DeepSpeed's 5e8 allocate GBs per rank there); GPU: DeepSpeed's own.
    assert (cpu.reduce_bucket_size, gpu.reduce_bucket_size) == (1_000_000, DeepSpeedKnobs().reduce_bucket_size)
    assert cpu.allgather_bucket_size == gpu.allgather_bucket_size == 7  # set: kept on both
    assert cpu.communication_data_type == gpu.communication_data_type == "fp32"


def test_preflight_plans_the_configured_buckets(tmp_path, monkeypatch, disk_free, host_memory):
    """The bug that motivated the bridge: llama-2-7b zero2 with 5e7-element buckets was planned
    with 5e8 (0.93 GiB of gradient buffers instead of 0.09)."""
    from shardwise.train.preflight import preflight

    monkeypatch.chdir(tmp_path)  # preflight creates the default output_dir (runs/shardwise) and its data cache
    disk_free(1 << 50)  # a 7B checkpoint needs ~75 GiB: not what this test is about (tests/conftest.py)
    host_memory(1 << 50)  # 8 ranks building a random 7B in fp32 need 213 GiB of host: nor is that

    # unpacked, the bundled sample (400 records) fills the global batch of 32 (packed: 9 rows, refused)
    cfg = TrainConfig.model_validate({"model": {"name": "llama-2-7b"}, "strategy": {"name": "zero2", "deepspeed": {
        "reduce_bucket_size": 50_000_000}}, "hardware": {"check_memory": False}, "data": {"sft": {"packing": False}}})
    run, _ = preflight(cfg, 8, "cuda")
    from shardwise.plan.evaluate import memory_as_run

    g = memory_as_run(run.model, run.hardware, run.train, run.strategy).gpu
    # bf16 buckets, doubled by overlap_comm only when it is on (DeepSpeed: stage 3 by default)
    assert g.grad_buffers == 50_000_000 * 2


def test_hybrid_shard_group_defaults_to_a_node():
    cfg = TrainConfig.model_validate({"strategy": {"name": "fsdp-hybrid"}})
    assert run_spec(cfg, 16, "cuda", environ={"LOCAL_WORLD_SIZE": "8"}).layout.dp_shard == 8
    assert run_spec(cfg, 4, "cpu", environ={}).layout.dp_shard == 4  # --nproc: one node


def test_to_config_refuses_tp_and_notes_what_the_trainer_cannot_run():
    hw = build_hardware(gpus=8)
    from shardwise.errors import ShardwiseError

    with pytest.raises(ShardwiseError, match=r"with ZeRO-1/2 through DeepSpeed's AutoTP; zero3 has tp 2, pp 1, "
                                             r"TP scheme megatron"):
        to_config(get_model("llama-2-7b"), hw, TrainSpec(), Strategy.from_name("zero3", tp=2))
    for name in ("fsdp", "zero2"):  # FSDP2 x TP and ZeRO-2 x AutoTP: the trainer runs them
        cfg, _ = to_config(get_model("llama-2-7b"), hw, TrainSpec(), Strategy.from_name(name, tp=2))
        assert (cfg.strategy.name, cfg.strategy.tp) == (name, 2)
    cfg, notes = to_config(get_model("llama-2-7b"), hw, TrainSpec(precision="bf16-pure", lora_rank=8),
                           Strategy.from_name("zero3"))
    assert cfg.precision == "bf16-mixed" and len(notes) == 1
    # LoRA is trained now: carried into the config's lora section, not noted as a difference
    assert cfg.lora is not None and cfg.lora.rank == 8
    assert list(cfg.lora.target_modules) == list(TrainSpec().lora_targets)


@pytest.mark.parametrize("lora", [
    {"rank": 8, "target_modules": "all-linear", "modules_to_save": ["lm_head"]},
    {"rank": 16, "target_modules": ["q_proj", "v_proj"], "quantization": "nf4"},
])
def test_lora_section_round_trips(lora):
    """lora: → TrainSpec (rank, targets, modules_to_save, base quantisation) → lora: again."""
    cfg = TrainConfig.model_validate({"lora": lora, "strategy": {"name": "ddp"}})
    run = run_spec(cfg, 2, "cuda", environ={})
    t = run.train
    assert t.lora_rank == lora["rank"] and t.lora_modules_to_save == tuple(lora.get("modules_to_save", ()))
    assert t.base_quant == lora.get("quantization", "none")
    back, notes = to_config(run.model, run.hardware, t, run.strategy, base=cfg)
    assert back.lora == cfg.lora and not notes
    assert run_spec(back, 2, "cuda", environ={}).train == t


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_plan_is_the_pure_cost_model():
    """No module in plan/ imports the trainer, the emitters or the bridge."""
    for path in (SRC / "plan").glob("*.py"):
        bad = {m for m in _imports(path) if m.startswith(("shardwise.train", "shardwise.emit", "shardwise.run"))}
        assert not bad, f"{path.name} imports {bad}"


# ---------------------------------------------------------------- plan vs running engine (2 ranks)
SETTINGS_CASES = ["ddp", "ddp:bf16:ckpt", "zero0:bf16", "zero1", "zero2:bf16", "zero3", "zero3:bf16:ckpt", "zero3:module",
                  "fsdp", "fsdp:bf16:ckpt", "fsdp:stock", "fsdp-grad-op:bf16", "fsdp-hybrid:sg1:bf16",
                  "fsdp-hybrid:sg1:bf16:fully_shard"]


@pytest.fixture(scope="module")
def settings():
    from shardwise.bench.settings import measure_settings

    return measure_settings(SETTINGS_CASES, timeout_s=420)


@pytest.mark.distributed
def test_running_fsdp_reshards_the_layers_the_knob_names(settings):
    """Read from the live fully_shard groups: the trainer's default keeps the last decoder layer
    gathered after forward, stock's (reshard_after_forward all) frees it and the root too (stock
    users pass True to the root, and torch honours an explicit True there), grad-op none."""
    keys = ("reshard_after_forward", "last_layer_reshard_after_forward", "root_reshard_after_forward")
    want = {"fsdp": (True, False, False), "fsdp:stock": (True, True, True), "fsdp-grad-op:bf16": (False, False, False)}
    for case, flags in want.items():
        for rank in settings[case]:
            assert tuple(rank["running"][k] for k in keys) == flags, case


# One rank: DDP runs the bare module unless told to wrap; FSDP2 runs as that DDP unless pinned
ONE_RANK_CASES = ["ddp", "ddp:wrap", "fsdp:bf16", "fsdp:bf16:fully_shard"]


@pytest.fixture(scope="module")
def one_rank_settings():
    from shardwise.bench.settings import measure_settings

    return measure_settings(ONE_RANK_CASES, timeout_s=240, world=1)


def _same(case: str, results: dict) -> None:
    assert case in results, f"no result for {case}"
    for rank in results[case]:
        assert "error" not in rank, rank
        planned, running = rank["planned"], rank["running"]
        assert planned.keys() == running.keys()
        diff = {k: (planned[k], running[k]) for k in planned if planned[k] != running[k]}
        assert not diff, f"{case}: planned vs running {diff}"


@pytest.mark.distributed
@pytest.mark.parametrize("case", SETTINGS_CASES)
def test_running_engine_uses_what_preflight_planned(case, settings):
    _same(case, settings)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_one_rank_engine_uses_what_preflight_planned(case, one_rank_settings):
    _same(case, one_rank_settings)
    running = one_rank_settings[case][0]["running"]
    want = {"ddp": ("ddp", False), "ddp:wrap": ("ddp", True), "fsdp:bf16": ("ddp", False),
            "fsdp:bf16:fully_shard": ("fsdp2", None)}[case]
    assert (running["engine"], running.get("ddp_wrapper")) == want


def test_plan_flags_set_the_engine_knobs_and_emit_carries_them(tmp_path):
    """Any measured configuration can be planned: the --ds-*/--fsdp-*/--ddp-* flags reach the
    plan (bucket bytes follow them) and the emitted files run exactly those knobs."""
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    def grad_buffers(*flags: str) -> float:
        r = CliRunner().invoke(app, ["plan", "-s", "zero2", "--gpus", "8", "--json", *flags])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["strategies"][0]["memory"]["grad_buffers"]

    # llama-2-7b bf16 zero2: one reduce bucket of 2-byte elements (overlap_comm off at stage 2)
    assert grad_buffers() == 500_000_000 * 2
    assert grad_buffers("--ds-bucket", "50000000") == 50_000_000 * 2
    assert grad_buffers("--ds-bucket", "50000000", "--ds-overlap-comm") == 50_000_000 * 2 * 2
    out = tmp_path / "emit"
    r = CliRunner().invoke(app, ["plan", "-s", "zero3", "--gpus", "8", "--emit", str(out), "--emit-strategy", "zero3",
                                 "--ds-persistence-threshold", "0", "--ds-prefetch", "12345", "--ds-comm-dtype", "fp32"])
    assert r.exit_code == 0, r.output
    zero = json.loads((out / "ds_config.json").read_text())["zero_optimization"]
    assert (zero["stage3_param_persistence_threshold"], zero["stage3_prefetch_bucket_size"]) == (0, 12345)
    filled = ["model.path=", "data.sft.train_files=[train.jsonl]"]  # its placeholders, as a user fills them
    ds = run_spec(load_config(out / "shardwise.yaml", filled), 8, "cuda", environ={}).strategy.ds
    assert (ds.param_persistence_threshold, ds.prefetch_bucket_size, ds.communication_data_type) == (0, 12345, "fp32")


def test_model_name_may_be_a_hugging_face_id_of_a_catalog_model():
    """model.name as users write it (`Qwen/Qwen3-0.6B`, an id the catalog entry lists): the run is
    that entry's, as its key gives it, preflight's model check passes, and the trainer builds it
    from the entry's config (random init; on the meta device here: no memory)."""
    torch = pytest.importorskip("torch")
    from shardwise.train.model.build import build_model, check_model_source

    by_id = TrainConfig.model_validate({"model": {"name": "Qwen/Qwen3-0.6B"}})
    run = run_spec(by_id, 2, "cpu", environ={})
    assert run.model == run_spec(TrainConfig.model_validate({"model": {"name": "qwen3-0.6b"}}), 2, "cpu",
                                 environ={}).model
    assert run.model.name == "qwen3-0.6b"
    check_model_source(by_id.model)
    with torch.device("meta"):
        model = build_model(run)
    assert sum({id(p): p.numel() for p in model.parameters()}.values()) == run.model.params
