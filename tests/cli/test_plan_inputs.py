"""`shardwise plan`: bad numbers are refused naming the flag; the recommendation is something
`shardwise train` runs; plan-only alternatives name their tool; --emit writes exactly what is
shown as recommended (or refuses, saying why); -s, --tp and --pp restrict the recommender;
the links the plan assumes are printed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app
from shardwise.errors import ShardwiseError
from shardwise.plan.planner import build_specs
from shardwise.plan.recommend import recommend
from shardwise.specs import TrainSpec

runner = CliRunner()
SLOW_NET = ["--gpus", "16", "--gpus-per-node", "8", "--interconnect", "eth-10"]  # DP across 1 GB/s links
TOOLS = {"shardwise train", "Megatron-LM", "Megatron-DeepSpeed", "torchtitan",
         "DeepSpeed's pipeline engine (deepspeed.pipe)", "DeepSpeed AutoTP training (tensor_parallel.autotp_size)"}  # fmt: skip


def plan(*args):
    return runner.invoke(app, ["plan", *args])


def plan_json(*args) -> dict:
    res = plan("--json", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def flat(text: str) -> str:
    return " ".join(text.split())


# --- refusals, each naming its flag -----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--params", "nan"], ["--params", "1e+13"]),
        (["--params", "inf"], ["--params"]),
        (["--params", "1e15"], ["--params 1e+15", "10 trillion"]),
        (["--params", "0"], ["--params", "> 0"]),
        (["--params", "-7e9"], ["--params"]),
        (["--margin", "-0.1"], ["--margin", "below 1"]),
        (["--margin", "1"], ["--margin", "below 1"]),
        (["--margin", "1.5"], ["--margin"]),
        (["--margin", "nan"], ["--margin"]),
        (["--gpu-memory-gb", "0"], ["--gpu-memory-gb", "> 0"]),
        (["--gpu-memory-gb", "-80"], ["--gpu-memory-gb"]),
        (["--gpu-memory-gb", "nan"], ["--gpu-memory-gb"]),
        (["--gpu-memory-gb", "inf"], ["--gpu-memory-gb", "finite"]),
        (["--host-memory-gb", "0"], ["--host-memory-gb"]),
        (["--host-memory-gb", "nan"], ["--host-memory-gb"]),
        (["--host-memory-gb", "inf"], ["--host-memory-gb"]),
        (["--gpus", "0"], ["--gpus 0", "1..131,072"]),
        (["--gpus", "-8"], ["--gpus -8"]),
        (["--gpus", "1000000000"], ["--gpus 1000000000", "131,072"]),
        (["--gpus", "12", "--gpus-per-node", "8"], ["--gpus 12 is not a multiple of --gpus-per-node 8"]),
        (["--gpus-per-node", "0"], ["--gpus-per-node 0"]),
        (["--seq-len", "0"], ["--seq-len 0"]),
        (["--micro-batch", "0"], ["--micro-batch 0"]),
        (["--micro-batch", "-2"], ["--micro-batch -2"]),
        (["--grad-accum", "0"], ["--grad-accum 0"]),
        (["--tp", "0"], ["--tp 0"]),
        (["--pp", "-1"], ["--pp -1"]),
        (["--interconnect", "eth-10"], ["--interconnect eth-10 needs --gpus-per-node"]),
        (["--interconnect", "pcie"], ["--interconnect pcie needs --gpus-per-node"]),
        (["--gpus", "16", "--interconnect", "ib-400"], ["needs --gpus-per-node"]),
        (["-s", "zero3", "--pp", "2"], ["'zero3' cannot run with pipeline parallelism (pp 2)"]),
    ],
)
def test_bad_numbers_are_refused_naming_the_flag(args, needles):
    res = plan(*args)
    assert res.exit_code == 2, res.output
    out = flat(res.output)
    assert out.startswith("error:")
    for needle in needles:
        assert needle in out


def test_non_integer_counts_are_refused_by_the_parser():
    res = plan("--gpus", "1e9")  # typer: not an integer, the flag named
    assert res.exit_code == 2 and "--gpus" in flat(res.output)


def test_absurd_gpu_count_is_refused_before_planning():
    t0 = time.perf_counter()
    res = plan("--gpus", "1000000000", "--gpus-per-node", "8")
    assert res.exit_code == 2 and "--gpus 1000000000" in flat(res.output)
    assert time.perf_counter() - t0 < 2  # no per-GPU list was built
    with pytest.raises(ShardwiseError, match=r"--gpus 131080: expected a whole number 1\.\.131,072"):
        catalog.build_hardware(gpus=131_080, gpus_per_node=8)
    assert catalog.build_hardware(gpus=131_072, gpus_per_node=8).world_size == 131_072


def test_library_entry_points_check_too():
    # build_specs / build_hardware are what every entry point goes through, not only the CLI
    for kw, flag in [({"params": float("nan")}, "--params"), ({"params": 2e13}, "--params"),
                     ({"gpu_memory_gb": float("inf")}, "--gpu-memory-gb"), ({"host_memory_gb": -1}, "--host-memory-gb"),
                     ({"gpus": 0}, "--gpus"), ({"seq_len": 0}, "--seq-len"), ({"grad_accum": -1}, "--grad-accum"),
                     ({"interconnect": "ib-200"}, "--gpus-per-node")]:  # fmt: skip
        with pytest.raises(ShardwiseError, match=flag):
            build_specs(**kw)
    with pytest.raises(ShardwiseError, match="--margin"):
        recommend(catalog.get_model("llama-2-7b"), catalog.build_hardware(gpus=8), TrainSpec(), margin=-0.5)
    # a network link without the node size is a guess: refused in the library as well
    with pytest.raises(ShardwiseError, match="needs --gpus-per-node"):
        catalog.build_hardware(gpus=8, interconnect="eth-10")


def test_explain_refuses_the_same_inputs():
    res = runner.invoke(app, ["explain", "--interconnect", "eth-10"])
    assert res.exit_code == 2 and "--gpus-per-node" in flat(res.output)
    res = runner.invoke(app, ["explain", "--params", "nan"])
    assert res.exit_code == 2 and "--params" in flat(res.output)


# --- the links the plan assumes ---------------------------------------------------------


def test_interconnect_assumed_is_printed():
    doc = plan_json(*SLOW_NET)
    links = doc["hardware"]["links"]
    assert links["inter"]["name"] == "eth-10" and links["inter"]["bus_bytes_per_s"] == pytest.approx(1e9)
    # the default GPU (A100) brings its own NVLink generation
    assert links["inter"]["used"] and links["intra"]["name"] == "nvlink3" and links["intra"]["used"]
    assert (doc["hardware"]["nodes"], doc["hardware"]["gpus_per_node"]) == (2, 8)
    out = flat(plan(*SLOW_NET).output)
    assert ("2 node(s) × 8 GPUs; links: intra-node nvlink3 230 GB/s (NVLink 3 + NVSwitch, A100 SXM; the "
            "a100-80g's own), inter-node eth-10 1 GB/s") in out
    # one node: the network link is named and marked unused; `pcie` is the GPU's generation (A100: 4.0)
    one = plan_json("--gpus", "4", "--gpus-per-node", "4", "--interconnect", "pcie")["hardware"]["links"]
    assert one["intra"]["name"] == "pcie4" and one["inter"]["used"] is False
    assert one["intra"]["gpu_default"] is False and one["intra"]["gpu_link"] == "nvlink3"
    assert "inter-node ib-200 22 GB/s per NIC × 8 per node (unused)" in flat(plan("--gpus", "8").output)
    ib = plan_json("--gpus", "16")["hardware"]["links"]["inter"]  # InfiniBand: a NIC per GPU
    assert ib["used"] and ib["node_bytes_per_s"] == pytest.approx(8 * ib["bus_bytes_per_s"])
    assert links["inter"]["node_bytes_per_s"] == pytest.approx(1e9)  # Ethernet: one NIC per node


# --- the recommendation is runnable; plan-only alternatives name their tool -------------


def expected_tool(a: dict) -> str:
    """The tool for a plan-only configuration, restated from docs/planner.md."""
    if a["strategy"].startswith("fsdp"):
        return "torchtitan"
    if a["strategy"] == "ddp":
        return "Megatron-LM"
    if a["tp"] == 1 and a["pp"] > 1 and a["checkpointing"] != "selective":
        return "DeepSpeed's pipeline engine (deepspeed.pipe)"
    if a["tp"] > 1 and a["pp"] == 1 and not a["strategy"].startswith("zero3") and a["checkpointing"] != "selective":
        return "DeepSpeed AutoTP training (tensor_parallel.autotp_size)"
    return "Megatron-DeepSpeed"


@pytest.mark.parametrize("args", [[], SLOW_NET, ["-m", "llama-2-70b"], ["-m", "llama-2-13b", "--gpus", "16"]])
def test_recommendation_is_runnable(args):
    doc = plan_json(*args)
    r = doc["recommended_setting"]
    assert r["runnable"] is True and r["tool"] == "shardwise train" and r["needs"] == []
    assert r["checkpointing"] in ("none", "full")
    assert r["tp"] == 1 or r["strategy"] in ("fsdp", "fsdp-grad-op", "fsdp-hybrid", "zero1", "zero2")  # FSDP2, AutoTP
    assert r["pp"] == 1 or r["strategy"] in ("fsdp", "fsdp-grad-op", "fsdp-hybrid")  # FSDP2 stages
    row = next(s for s in doc["strategies"] if s["name"] == r["strategy"])
    assert row["engine"] in ("ddp", "deepspeed", "fsdp2")
    for a in doc["plan_only_alternatives"]:
        assert a["tokens_per_s_per_gpu"] > r["tokens_per_s_per_gpu"] * 1.03


def test_a_slow_network_recommends_the_pipeline_the_trainer_runs():
    """Data parallelism over 1 GB/s links loses to pipeline stages, which shardwise train runs
    with FSDP2 inside each stage: the recommendation itself is the PP row."""
    r = plan_json(*SLOW_NET)["recommended_setting"]
    assert r["pp"] > 1 and r["strategy"].startswith("fsdp") and r["runnable"] and r["tool"] == "shardwise train"
    assert r["pp_schedule"] in ("1f1b", "interleaved-1f1b") and r["grad_accum"] >= r["pp"]


# olmo2: a family neither the trainer's TP plan nor its pipeline stages cover, so the faster
# TP/PP layouts of a slow network stay plan-only
SLOW_NET_OTHER_FAMILY = [*SLOW_NET, "-m", "olmo-2-7b"]


def test_plan_only_alternatives_name_their_tool_and_numbers():
    doc = plan_json(*SLOW_NET_OTHER_FAMILY)
    best = doc["recommended_setting"]
    alts = doc["plan_only_alternatives"]
    assert alts, "a 1 GB/s network between two nodes: pipeline/tensor parallelism should be faster"
    assert [a["tokens_per_s_per_gpu"] for a in alts] == sorted((a["tokens_per_s_per_gpu"] for a in alts), reverse=True)
    assert len({a["tool"] for a in alts}) == len(alts)  # one per tool
    for a in alts:
        assert a["tp"] > 1 or a["pp"] > 1 or a["checkpointing"] == "selective"
        assert a["tool"] == expected_tool(a) and a["tool"] in TOOLS - {"shardwise train"}
        # fits is decided on what runs out (allocated + unreclaimable slack + context + NCCL), not the device total
        assert a["needs"] and a["memory_required"] <= a["usable_bytes"] and a["memory_required"] <= a["memory_total"]
        assert a["speedup"] == pytest.approx(a["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"])
        assert f"{a['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU" in a["why"] and "GiB" in a["why"]
        assert a["tool"] in a["why"]
    assert any("not 'olmo2'" in n for a in alts for n in a["needs"])  # the model-dependent gap, said
    out = flat(plan(*SLOW_NET_OTHER_FAMILY).output)
    assert "Plan-only alternatives" in out
    for a in alts:
        assert a["tool"] in out


# --- -s, --tp and --pp restrict the recommender -----------------------------------------


def test_strategy_flag_restricts_the_recommendation():
    doc = plan_json("-s", "zero1", "-s", "zero2")
    assert doc["recommended"] in ("zero1", "zero2") and doc["runner_up"] in ("zero1", "zero2", None)
    assert [s["name"] for s in doc["strategies"]] == ["zero1", "zero2"]
    assert all(a["strategy"] in ("zero1", "zero2") for a in doc["plan_only_alternatives"])


def test_tp_flag_restricts_the_recommendation_and_says_plan_only():
    doc = plan_json("--tp", "2")  # FSDP2 x TP runs in shardwise train
    r = doc["recommended_setting"]
    assert r["tp"] == 2 and r["runnable"] is True and r["tool"] == "shardwise train" and r["needs"] == []
    assert r["strategy"] in ("fsdp", "fsdp-grad-op", "fsdp-hybrid")
    assert all(s["tp"] == 2 for s in doc["strategies"])
    doc = plan_json("--tp", "2", "-s", "zero2")  # ZeRO-2 x TP: DeepSpeed's AutoTP, planned as the trainer runs it
    r = doc["recommended_setting"]
    assert (r["strategy"], r["tp"], r["runnable"], r["tool"], r["needs"]) == ("zero2", 2, True, "shardwise train", [])
    doc = plan_json("--tp", "2", "-s", "zero3")  # ZeRO-3 x TP: AutoTP does not run it; Megatron-DeepSpeed's TP
    r = doc["recommended_setting"]
    assert r["tp"] == 2 and r["runnable"] is False and r["tool"] == "Megatron-DeepSpeed"
    assert r["needs"] == ["Megatron's tensor parallelism (tp 2)"]
    assert "Plan-only" in doc["reason"]
    out = flat(plan("--tp", "2", "-s", "zero3").output)
    assert f"Recommended (plan-only: run it with {r['tool']})" in out
    # an explicit tp 1 keeps the sweep to tp 1: no TP alternatives
    doc = plan_json("--tp", "1", *SLOW_NET_OTHER_FAMILY)
    assert doc["plan_only_alternatives"] and all(a["tp"] == 1 for a in doc["plan_only_alternatives"])
    doc = plan_json("--pp", "2", "-s", "zero1")
    r = doc["recommended_setting"]
    assert (r["strategy"], r["pp"], r["runnable"]) == ("zero1", 2, False)
    assert r["tool"] in ("DeepSpeed's pipeline engine (deepspeed.pipe)", "Megatron-DeepSpeed")


def test_pipeline_table_leaves_out_what_cannot_combine():
    doc = plan_json("--pp", "2")
    names = [s["name"] for s in doc["strategies"]]
    for n in ("zero2", "zero3", "zero2+opt-offload", "zero3+opt-offload", "zero3+full-offload"):
        assert n not in names and "pipeline" in doc["skipped_strategies"][n]
    assert {"ddp", "zero0", "zero1", "fsdp"} <= set(names)
    assert doc["recommended_setting"]["pp"] == 2


def test_library_recommend_honours_pinned_layouts():
    m, hw = catalog.get_model("llama-2-7b"), catalog.build_hardware(gpus=8)
    r = recommend(m, hw, TrainSpec(), tps=(2,))  # FSDP2 x TP runs in shardwise train
    assert r.best.memory.layout.tp == 2 and r.runnable and r.tool == "shardwise train"
    r = recommend(m, hw, TrainSpec(), tps=(2,), strategies=["zero3", "ddp"])
    assert r.best.memory.layout.tp == 2 and not r.runnable and r.tool != "shardwise train"
    r = recommend(m, hw, TrainSpec(), tps=(2,), strategies=["zero2"])  # DeepSpeed's AutoTP runs in shardwise train
    assert r.best.memory.layout.tp == 2 and r.runnable and r.tool == "shardwise train"
    r = recommend(m, hw, TrainSpec(), strategies=["zero2"])
    assert r.best.strategy.name == "zero2" and r.runnable and r.best.strategy.trainable


# --- --emit writes exactly the recommended configuration, or refuses --------------------


@pytest.mark.parametrize("args", [
    [], ["--micro-batch", "4"], ["-m", "qwen2.5-7b", "--gpu", "a100-40g", "--micro-batch", "4", "--grad-accum", "2"],
    ["-m", "llama-2-70b"], SLOW_NET, ["-s", "zero2", "--grad-accum", "4"],
])  # fmt: skip
def test_emit_writes_the_recommended_configuration(args, tmp_path):
    out = tmp_path / "emit"
    doc = plan_json(*args, "--emit", str(out))
    r = doc["recommended_setting"]
    e = doc["emitted_setting"]
    for k in ("strategy", "micro_batch", "grad_accum", "checkpointing", "tp", "pp", "pp_schedule", "pp_virtual_stages"):
        assert e[k] == r[k], k
    cfg = yaml.safe_load((out / "shardwise.yaml").read_text())
    assert cfg["strategy"]["name"] == r["strategy"]
    layout = {k: cfg["strategy"].get(k, d) for k, d in (("tp", 1), ("pp", 1), ("pp_schedule", "1f1b"),
                                                          ("pp_virtual_stages", 1))}
    assert layout == {k: r[k] for k in layout}  # a pipeline (SLOW_NET's) with its schedule
    assert r["pp"] == 1 or {"pp", "pp_schedule", "pp_virtual_stages"} <= set(cfg["strategy"])
    assert (cfg["run"]["micro_batch"], cfg["run"]["grad_accum"]) == (r["micro_batch"], r["grad_accum"])
    assert cfg["checkpointing"]["activation"] == r["checkpointing"]
    assert "# NOTE" not in (out / "shardwise.yaml").read_text()  # nothing written differently
    row = next(s for s in doc["strategies"] if s["name"] == r["strategy"])
    if row["engine"] == "deepspeed":
        ds = json.loads((out / "ds_config.json").read_text())
        assert ds["train_micro_batch_size_per_gpu"] == r["micro_batch"]
        assert ds["gradient_accumulation_steps"] == r["grad_accum"]
        assert ds["train_batch_size"] == r["micro_batch"] * r["grad_accum"] * doc["hardware"]["gpus"]
        assert ds["zero_optimization"]["stage"] == int(r["strategy"][4])
    readme = (out / "README.md").read_text()
    assert f"micro-batch {r['micro_batch']}, gradient accumulation {r['grad_accum']}" in readme
    assert f"activation checkpointing {r['checkpointing']}" in readme
    # every file is one emitted, beside the record of what was (the next emit removes only those)
    from shardwise.emit.safe_write import EMIT_MANIFEST

    assert (out / EMIT_MANIFEST).is_file()
    assert sorted(doc["emitted"]) == sorted(str(p) for p in out.iterdir() if p.name != EMIT_MANIFEST)


def test_emit_strategy_writes_its_row(tmp_path):
    out = tmp_path / "emit"
    doc = plan_json("--micro-batch", "2", "--grad-accum", "2", "--checkpointing", "full", "--emit", str(out),
                    "--emit-strategy", "zero2")
    assert {k: doc["emitted_setting"][k] for k in ("strategy", "micro_batch", "grad_accum", "checkpointing")} == {
        "strategy": "zero2", "micro_batch": 2, "grad_accum": 2, "checkpointing": "full"}
    ds = json.loads((out / "ds_config.json").read_text())
    assert (ds["zero_optimization"]["stage"], ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"]) == (2, 2, 2)  # fmt: skip


@pytest.mark.parametrize(("args", "needles"), [
    (["--emit-strategy", "zero3", "--pp", "2"], ["--emit-strategy zero3 --pp 2", "cannot run with pipeline parallelism"]),
    (["--emit-strategy", "zero3", "--tp", "2"], ["plan-only", "tp 2", "Megatron-DeepSpeed"]),
    (["--emit-strategy", "zero0", "--tp", "2"], ["plan-only", "tp 2", "DeepSpeed AutoTP training"]),
    (["--emit-strategy", "fsdp+offload", "--pp", "2"], ["plan-only", "torchtitan"]),
    (["--emit-strategy", "fsdp", "--pp", "2"], ["plan-only", "1F1B needs at least as many micro-batches as stages",
                                                "grad_accum 1 < pp 2", "torchtitan"]),
    (["--emit-strategy", "fsdp", "--pp", "2", "-m", "qwen2.5-0.5b", "--grad-accum", "2"],
     ["plan-only", "ties lm_head to the input embedding", "torchtitan"]),
    (["--emit-strategy", "zero1", "--pp", "2", "--grad-accum", "2"], ["plan-only", "DeepSpeed's pipeline engine"]),
    (["--tp", "2", "-s", "zero3"], ["--emit: the recommended", "plan-only", "Run it with", "drop --tp/--pp"]),
    (["--emit-strategy", "ddp"], ["--emit-strategy ddp", "does not fit", "GiB per GPU against", "GiB usable"]),
    (["-m", "llama-2-70b", "-s", "zero2", "--gpu", "rtx-4090"], ["--emit: nothing to write", "no configuration"]),
])  # fmt: skip
def test_emit_refuses_with_the_reason(args, needles, tmp_path):
    out = tmp_path / "emit"
    res = plan(*args, "--emit", str(out))
    assert res.exit_code == 2, res.output
    text = flat(res.output)
    for needle in needles:
        assert needle in text
    assert not out.exists()  # nothing half-written


def test_emit_refusal_suggests_a_setting_that_fits(tmp_path):
    # 13B ZeRO-2 at micro-batch 8 without checkpointing does not fit 80 GB; a smaller micro-batch or
    # checkpointing does
    res = plan("-m", "llama-2-13b", "--micro-batch", "8", "--checkpointing", "none", "--emit", str(tmp_path / "x"),
               "--emit-strategy", "zero2")
    assert res.exit_code == 2
    text = flat(res.output)
    assert "does not fit" in text and "It fits with --micro-batch" in text and "--checkpointing" in text


def test_emit_of_auto_checkpointing_pins_what_it_decided(tmp_path):
    # the same row with checkpointing left to the plan (the default): full, which fits, and the
    # emitted shardwise.yaml says full
    from shardwise.config.safe_yaml import read_yaml

    res = plan("-m", "llama-2-13b", "--micro-batch", "8", "--emit", str(tmp_path / "x"), "--emit-strategy", "zero2")
    assert res.exit_code == 0, res.output
    text = flat(res.output)
    full = text.split("Activation checkpointing (auto): full; without recomputation each would need (GiB): ")[1]
    assert " zero2 " in full.split(" of ")[0]
    assert "Emitted zero2 (micro-batch 8 × accum 1, checkpointing full)" in text
    assert read_yaml(tmp_path / "x" / "shardwise.yaml")[1]["checkpointing"]["activation"] == "full"


def test_nothing_fits_lists_plan_only_alternatives_in_json():
    # 70B on 8 × 24 GB with only the non-offload ZeRO stages: nothing shardwise runs fits
    res = plan("--json", "-m", "llama-2-70b", "--gpu", "rtx-4090", "-s", "zero1", "-s", "zero2")
    doc = json.loads(res.output)
    assert doc["recommended"] is None and doc["recommended_setting"] is None
    assert "shardwise can train" in doc["reason"]
    assert isinstance(doc["plan_only_alternatives"], list)


def test_emitted_paths_are_files(tmp_path):
    doc = plan_json("--emit", str(tmp_path / "e"))
    assert all(Path(p).is_file() for p in doc["emitted"])
