"""`shardwise plan --from` a torchtitan job config TOML: each file plans what the same run given as
flags plans, the flags written here from torchtitan's source (job_config.py defaults, apply_fsdp's
units), and a published torchtitan row is planned from its own config as
benchmarks/published/torchtitan-llama3-h100-202412.yaml (curated from torchtitan's benchmark
page, not from this reader) plans it.

The files in tests/data/from/ are verbatim pytorch/torchtitan configs in the TOML layout's final
form (before 9810191 moved configs to Python): titan_llama3_70b.toml and titan_llama3_405b.toml are
torchtitan/models/llama3/train_configs/ as last changed at 8a2686c, titan_deepseek_v3_671b.toml
torchtitan/models/deepseek_v3/train_configs/ at 5fb7cc2;
titan_llama3_8b_2024.toml is train_configs/llama3_8b.toml at b19456a, the file torchtitan's
Dec 2024 H100 benchmark (at 9dec370) ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.ingest.test_plan_from import DATA, ROOT, foreign, plan, same
from typer.testing import CliRunner

from shardwise.cli.app import app

LLAMA_70B = DATA / "titan_llama3_70b.toml"
LLAMA_405B = DATA / "titan_llama3_405b.toml"
DSV3 = DATA / "titan_deepseek_v3_671b.toml"
LLAMA_8B_2024 = DATA / "titan_llama3_8b_2024.toml"

# job_config.py defaults of every config here: AdamW fused with weight decay 0.1, max_norm
# clipping, MixedPrecisionPolicy(param bf16, reduce fp32), a reduce-scatter every micro-batch
TITAN = ["--precision", "bf16-mixed", "--optimizer", "adamw", "--optimizer-impl", "fused", "--weight-decay", "0.1",
         "--grad-pass", "clip", "--no-activation-offload", "--fsdp-reduce-dtype", "fp32",
         "--fsdp-reduce-every-micro-batch", "true"]
# apply_fsdp (models/llama3/infra/parallelize.py): the token embedding and every block resharded
# after forward, norm + output one unit kept gathered ("default" policy): the head as the root
FINAL_FSDP = ["-s", "fsdp", "--fsdp-wrap-embeddings", "--fsdp-reshard-after-forward", "layers",
              "--fsdp-reshard-root", "false"]


def refused(*args: str) -> str:
    r = CliRunner().invoke(app, ["plan", *args])
    assert r.exit_code == 2, r.output
    return " ".join(r.output.split())


def _written(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def test_70b_tp8_config():
    src = same(["--from", str(LLAMA_70B), "--gpu", "h100-sxm", "--gpus", "64"],
               ["-m", "llama-3.1-70b", *FINAL_FSDP, "--gpu", "h100-sxm", "--gpus", "64", "--tp", "8",
                "--seq-len", "8192", "--micro-batch", "8", "--grad-accum", "1", *TITAN, "--checkpointing", "full",
                "--no-fused-kernels"])
    assert src["format"] == "torchtitan" and src["ignored"] == []
    assert any("data_parallel_shard_degree" in r["key"] and "-1" in r["as"] for r in src["read"])


def test_a_converter_torchtitan_cannot_build_is_refused():
    # the 405B file names converters = ["float8"] beside [quantize.linear.float8]: that layout's
    # registry knows quantize.linear.float8 only, and torchtitan stops at startup
    out = refused("--from", str(LLAMA_405B), "--gpu", "h100-sxm", "--gpus", "128")
    assert "titan_llama3_405b.toml:21: model.converters = ['float8']: not plannable" in out
    assert "name it quantize.linear.float8" in out


def _nothing_fits(*args: str) -> dict:
    """plan --json where nothing fits the GPUs (exit 3: the document is printed all the same)."""
    r = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert r.exit_code == 3, r.output
    return json.loads(r.stdout)


def test_deepseek_v3_config():
    # 4 × 4096 tokens of DeepSeek-V3's routed copies a micro-batch fit no GPU without expert
    # parallelism (the file's expert_parallel_degree is 1): planned all the same, the same as flags
    got = _nothing_fits("--from", str(DSV3), "--gpu", "h100-sxm", "--gpus", "256")
    source = got.pop("from")
    want = _nothing_fits(*foreign(["-m", "deepseek-v3", *FINAL_FSDP, "--gpu", "h100-sxm", "--gpus", "256",
                                   "--seq-len", "4096", "--micro-batch", "4", "--grad-accum", "1", *TITAN,
                                   "--checkpointing", "selective", "--fused-kernels"]))
    assert got == want
    assert source["values"]["model"] == "deepseek-v3"


def test_the_2024_config_plans_the_published_row():
    # the Dec 2024 benchmark ran this file with batch 2 on 8 H100s (96 GB, RDMA 400 Gb/s); its other
    # settings are the page's: torch's SDPA ran FlashAttention-2 then, expandable segments on
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import accuracy

    from shardwise.plan.evaluate import evaluate

    row = next(r for r in accuracy.load_runs() if r["name"] == "llama3.1-8b h100x8 fsdp sel-op-ac b2")
    model, hw, train, strategy = accuracy.build(row)
    want = evaluate(model, hw, train, strategy)
    doc = plan("--from", str(LLAMA_8B_2024), "--gpu", "h100-sxm", "--gpu-memory-gb", "96", "--gpus", "8",
               "--gpus-per-node", "8", "--interconnect", "ib-400", "--micro-batch", "2", "--attention", "flash",
               "--expandable-segments")
    got = doc["strategies"][0]
    assert got["memory"]["total"] == want.memory.gpu.total
    assert got["time"]["tokens_per_s_per_gpu"] == want.time.tokens_per_s_per_gpu
    # that era's sharding: every block but the last resharded, the root freed at pp 1
    assert {"reshard_after_forward": "not-last", "reshard_root": True}.items() <= doc["from"]["knobs"]["fsdp"].items()


def test_pipeline_schedule_microbatches_and_accumulation(tmp_path: Path):
    f = _written(tmp_path, '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\n'
                 'global_batch_size = 32\nseq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = 2\n'
                 'pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"\n'
                 'pipeline_parallel_layers_per_stage = 4\npipeline_parallel_microbatch_size = 2\n'
                 '[activation_checkpoint]\nmode = "none"\n')
    v = plan("--from", str(f), "--gpu", "h100-sxm")["from"]["values"]
    # world = shard 2 × pp 2; accumulation 32 / (8 × 2) = 2 steps of the local batch, each cut into
    # 8 / 2 = 4 micro-batches; 32 layers / 4 a stage = 8 stages, 4 a pipeline rank; under PP the
    # default policy keeps every unit gathered (SHARD_GRAD_OP)
    assert (v["gpus"], v["pp"], v["micro_batch"], v["grad_accum"]) == (4, 2, 2, 8)
    assert (v["pp_schedule"], v["pp_virtual_stages"], v["strategy"]) == ("interleaved-1f1b", 4, ["fsdp-grad-op"])


def test_the_2024_layout_splits_the_batch_into_pp_microbatches(tmp_path: Path):
    # 9dec370: [experimental] pipeline_parallel_microbatches, default the PP degree
    text = LLAMA_8B_2024.read_text().replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 4")
    text = text.replace("batch_size = 1", "batch_size = 8")
    v = plan("--from", str(_written(tmp_path, text)), "--gpu", "h100-sxm", "--gpus", "8")["from"]["values"]
    assert (v["pp"], v["micro_batch"], v["grad_accum"], v["strategy"]) == (4, 2, 4, ["fsdp-grad-op"])


def test_every_second_block_checkpointed_is_said(tmp_path: Path):
    f = _written(tmp_path, '[model]\nname = "qwen3"\nflavor = "32B"\n')  # job_config's defaults: selective "2"
    src = plan("--from", str(f), "--gpu", "h100-sxm", "--gpus", "16")["from"]
    assert src["values"]["checkpointing"] == "full"
    assert any("every 2th block" in w for w in src["warnings"])


def test_bad_files_are_refused_naming_line_and_key(tmp_path: Path):
    base = '[model]\nname = "llama3"\nflavor = "8B"\n'
    out = refused("--from", str(_written(tmp_path, base.replace('"8B"', '"debugmodel"'))))
    assert "job.toml:3: model.flavor = 'llama3 debugmodel'" in out and "pass --model" in out
    out = refused("--from", str(_written(tmp_path, base + '[activation_checkpoint]\nmode = "memory_budget"\n')))
    assert "job.toml:5: activation_checkpoint.mode = 'memory_budget': not plannable" in out
    out = refused("--from", str(_written(tmp_path, base + '[parallelism]\npipeline_parallel_degree = 2\n'
                                          'pipeline_parallel_schedule = "ZBVZeroBubble"\n')))
    assert "job.toml:6: parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble'" in out
    assert "not valid TOML" in refused("--from", str(_written(tmp_path, base + "seq_len = \n")))
    assert "not valid TOML" in refused("--from", str(_written(tmp_path, base + 'name = "llama2"\n')))  # a key twice
    out = refused("--from", str(_written(tmp_path, base + "[training]\nseq_len = inf\n")))
    assert "training.seq_len = inf: expected a finite number" in out


def test_user_command_as_a_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "--from", str(LLAMA_70B), "--gpu",
                        "h100-sxm", "--gpus", "64", "--json"], capture_output=True, text=True, timeout=300,
                       check=False, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    doc = json.loads(r.stdout)
    assert doc["from"]["format_name"] == "torchtitan job config TOML"
    assert (doc["strategies"][0]["name"], doc["strategies"][0]["tp"]) == ("fsdp", 8)
