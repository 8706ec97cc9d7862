"""`shardwise plan --from FILE`: each format's example file plans exactly what the same setup
given as flags plans (the --json documents compared, less the "from" section), keys not
understood are listed, bad files are refused naming file, line and key, and `plan --emit` ->
`plan --from` the emitted files gives the plan that was emitted.

The example files in tests/data/from/ come from each tool's own documentation or repository:
hf_ds_zero2.json / hf_ds_zero3.json: the ZeRO-2 and ZeRO-3 example configs of the transformers docs
("DeepSpeed" integration page, "auto" values as given there; written from those docs);
accelerate_fsdp2.yaml: the file `accelerate config` writes for FSDP2 (keys of accelerate 1.15's
commands/config/cluster.py; activation checkpointing answered yes); llama_factory_full_sft.yaml:
hiyouga/LLaMA-Factory examples/train_full/llama3_full_sft.yaml (commit 03da9a7) with its
`deepspeed:` path pointed here, and lf_ds_z3_config.json: its examples/deepspeed/ds_z3_config.json
(commit 1d6e8b2), verbatim; axolotl_qlora.yaml: axolotl-ai-cloud/axolotl examples/llama-2/qlora.yml
(commit 013495e), verbatim. ds_zero1_pipeline_tp.json (JSON has no comments: its sources are
here): 64 GPUs as ZeRO-1 × PP 4 × the file's TP (the issue's example: its title says TP 8, its
file `"tensor_parallel": {"tp_size": 4}`, which is planned), written from DeepSpeed's and
Megatron-DeepSpeed's sources: the `pipeline` block's keys and defaults (stages "auto", partition,
seed_layers, activation_checkpoint_interval, pipe_partitioned, grad_partitioned) are
deepspeedai/DeepSpeed deepspeed/runtime/config.py `get_pipeline_config` (commit edaa722), of which
runtime/pipe/engine.py reads activation_checkpoint_interval, pipe_partitioned and grad_partitioned
and asserts ZeRO stage < 2 and train_batch_size = micro × accumulation × the pipeline grid's
data-parallel size; the stage count itself is PipelineModule(num_stages=...) or
deepspeedai/Megatron-DeepSpeed's --pipeline-model-parallel-size (megatron/model/gpt_model.py
GPTModelPipe, commit 4efb479), which also reads pipeline.pipe_partitioned/grad_partitioned from
the config; `tensor_parallel.autotp_size` (and `tp.tp_size`) are DeepSpeed's training keys
(runtime/tensor_parallel/config.py TPTrainingConfig), `tensor_parallel.tp_size` is
deepspeed.init_inference's, which the training config refuses (extra keys forbidden).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardwise.cli.app import app

DATA = Path(__file__).parents[1] / "data" / "from"
ROOT = Path(__file__).resolve().parents[2]


def plan(*args: str) -> dict:
    r = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# Another tool's file is planned with the planner's defaults where it and its tool say nothing, not
# with shardwise train's (a bare `plan`'s): the flags that state them.
FOREIGN = ["--micro-batch", "1", "--cross-entropy", "standard", "--packed-attention", "none", "--no-fused-kernels",
           "--checkpointing", "none"]


def foreign(flag_args: list[str]) -> list[str]:
    """`flag_args` planned as another tool's run: FOREIGN first (a flag given later wins), and
    DeepSpeed's own reduce dtype where a DeepSpeed strategy is planned."""
    named = [flag_args[i + 1] for i, a in enumerate(flag_args) if a in ("-s", "--strategy")]
    ds = not named or any(n.startswith("zero") for n in named)
    return [*FOREIGN, *flag_args, *(["--ds-comm-dtype", "auto"] if ds and "--ds-comm-dtype" not in flag_args else [])]


def same(from_args: list[str], flag_args: list[str]) -> dict:
    """The file's plan equals the hand-written flags' plan, and the flags it says it equals."""
    flag_args = foreign(flag_args)
    got = plan(*from_args)
    source = got.pop("from")
    want = plan(*flag_args)
    assert got == want
    extra = [a for a in from_args[2:]]  # the flags given beside the file
    assert plan(*source["as_flags"], *extra) == want
    return source


H7 = 4096  # llama-2-7b hidden_size


def test_hf_zero3_example_with_auto_values():
    src = same(["--from", str(DATA / "hf_ds_zero3.json"), "-m", "llama-2-7b", "--micro-batch", "2"],
               ["-m", "llama-2-7b", "--micro-batch", "2", "--precision", "fp32", "-s", "zero3+full-offload",
                "--ds-reduce-bucket", str(H7 * H7), "--ds-prefetch", str(int(0.9 * H7 * H7)),
                "--ds-persistence-threshold", str(10 * H7), "--ds-max-live", "1e9", "--ds-max-reuse", "1e9",
                "--ds-overlap-comm", "--ds-contiguous-gradients", "--ds-fetch-unit", "module"])
    assert src["format"] == "deepspeed"
    assert src["knobs"]["ds"]["reduce_bucket_size"] == 16_777_216  # h², as HF fills "auto"
    assert "zero_optimization.sub_group_size" in {i["key"] for i in src["ignored"]}
    assert "scheduler.type" in {i["key"] for i in src["read"]}  # understood: it changes nothing planned
    assert src["what_to_change"]["faster"]  # dropping the offload is faster here, and it says so


def test_hf_zero2_example():
    """Its "auto" batch and precision read alone: HF Trainer's fill from TrainingArguments' defaults
    (per_device_train_batch_size 8, gradient_accumulation_steps 1, bf16/fp16 False: fp32), said first."""
    src = same(["--from", str(DATA / "hf_ds_zero2.json")],
               ["-s", "zero2+opt-offload", "--micro-batch", "8", "--grad-accum", "1", "--precision", "fp32",
                "--ds-bucket", "2e8", "--ds-overlap-comm", "--ds-reduce-scatter", "--ds-contiguous-gradients"])
    assert any("--micro-batch 8" in w and "--precision fp32" in w for w in src["warnings"])
    # a flag beside the file is the trainer's argument: it wins over the default fill
    got = plan("--from", str(DATA / "hf_ds_zero2.json"), "--precision", "bf16-mixed", "--micro-batch", "2")
    assert (got["train"]["precision"], got["train"]["micro_batch"]) == ("bf16-mixed", 2)
    assert not any("--micro-batch 8" in w for w in got["from"]["warnings"])


def test_accelerate_fsdp2_is_fsdp2_prepare_model_layout():
    src = same(["--from", str(DATA / "accelerate_fsdp2.yaml")],
               ["-s", "fsdp", "--gpus", "8", "--gpus-per-node", "8", "--checkpointing", "full",
                "--fsdp-reshard-after-forward", "layers", "--fsdp-wrap-embeddings", "--fsdp-reduce-dtype", "param", "--fsdp-single-rank", "fsdp",
                "--fsdp-reduce-every-micro-batch", "false"])  # accelerate's no_sync: the grads held
    edits = [e for item in src["what_to_change"]["faster"] for e in item["edits"]]
    assert "fsdp_config.fsdp_activation_checkpointing" in edits


def test_llama_factory_example_and_its_deepspeed_json(monkeypatch):
    monkeypatch.chdir(ROOT)  # LLaMA-Factory resolves `deepspeed:` against the working directory
    # meta-llama/Meta-Llama-3-8B-Instruct: the catalog's llama-3-8b, by the Hugging Face id it lists
    src = same(["--from", str(DATA / "llama_factory_full_sft.yaml")],
               ["-m", "llama-3-8b", "-s", "zero3", "--micro-batch", "1", "--grad-accum", "2", "--seq-len", "2048",
                "--checkpointing", "full", "--ds-reduce-bucket", str(H7 * H7), "--ds-prefetch",
                str(int(0.9 * H7 * H7)), "--ds-persistence-threshold", str(10 * H7), "--ds-max-live", "1e9",
                "--ds-max-reuse", "1e9", "--no-ds-overlap-comm", "--ds-contiguous-gradients",
                "--ds-fetch-unit", "module"])
    read = dict((i["key"], i["as"]) for i in src["read"])
    assert "LLaMA-Factory checkpoints by default" in read["disable_gradient_checkpointing"]
    assert read["model_name_or_path"] == "--model llama-3-8b (the catalog entry listing meta-llama/Meta-Llama-3-8B-Instruct)"
    assert "trust_remote_code" in read  # read: it matters only for a Hub config.json with auto_map
    ignored = {i["key"] for i in src["ignored"]}
    assert {"lf_ds_z3_config.json: comms_config.verbose", "lf_ds_z3_config.json: monitor_config.enabled"} <= ignored


def test_axolotl_qlora_example():
    same(["--from", str(DATA / "axolotl_qlora.yaml")],
         ["-m", "llama-2-7b", "-s", "ddp", "--micro-batch", "2", "--grad-accum", "4", "--seq-len", "4096",
          "--lora-rank", "32", "--lora-targets", "all-linear", "--lora-dropout", "0.05", "--qlora", "--checkpointing",
          "full", "--packed-attention", "flash_varlen", "--attention", "flash", "--weight-decay", "0"])


def test_training_args_json_with_inline_deepspeed(tmp_path):
    f = tmp_path / "args.json"
    f.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                             "bf16": True, "gradient_checkpointing": True, "weight_decay": 0.1,
                             "model_name_or_path": "meta-llama/Llama-2-7b-hf",
                             "deepspeed": {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
                                           "train_micro_batch_size_per_gpu": "auto"}}))
    same(["--from", str(f)], ["-m", "llama-2-7b", "-s", "zero2", "--micro-batch", "4", "--grad-accum", "2",
                              "--checkpointing", "full", "--weight-decay", "0.1", "--ds-reduce-bucket", str(H7 * H7)])


def test_a_deepspeed_json_that_contradicts_the_trainer_arguments_is_refused(tmp_path):
    f = tmp_path / "args.json"
    f.write_text(json.dumps({"output_dir": "o", "per_device_train_batch_size": 2,
                             "deepspeed": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}}))
    r = CliRunner().invoke(app, ["plan", "--from", str(f)])
    assert r.exit_code == 2 and "deepspeed.train_micro_batch_size_per_gpu = 4: expected 2" in r.output, r.output


def test_flags_beside_the_file_override_it():
    got = plan("--from", str(DATA / "accelerate_fsdp2.yaml"), "--checkpointing", "none", "--gpus", "16",
               "--gpus-per-node", "8")
    assert got["train"]["checkpointing"] == "none" and got["hardware"]["gpus"] == 16


def test_keys_not_understood_are_listed(tmp_path):
    f = tmp_path / "acc.yaml"
    f.write_text((DATA / "accelerate_fsdp2.yaml").read_text() + "my_new_key: 3\n")
    src = plan("--from", str(f))["from"]
    assert {"key": "my_new_key", "why": "not a key shardwise plans"} in src["ignored"]
    d = json.loads((DATA / "hf_ds_zero3.json").read_text())
    d["zero_optimization"]["zero_hpz_partition_size"] = 8
    (tmp_path / "ds.json").write_text(json.dumps(d))
    ignored = {i["key"]: i["why"] for i in plan("--from", str(tmp_path / "ds.json"))["from"]["ignored"]}
    assert "ZeRO++" in ignored["zero_optimization.zero_hpz_partition_size"]
    table = CliRunner().invoke(app, ["plan", "--from", str(tmp_path / "ds.json")])
    assert "Ignored (not planned):" in table.output and "What to change in ds.json:" in table.output
    md = CliRunner().invoke(app, ["plan", "--from", str(tmp_path / "ds.json"), "--format", "markdown"])
    assert "zero_optimization.zero_hpz_partition_size" in md.output and "What to change in ds.json:" in md.output


@pytest.mark.parametrize("text, says", [
    ('{"zero_optimization": {"stage": 5}}', ":1: zero_optimization.stage = 5: expected 0, 1, 2 or 3"),
    ('{\n  "zero_optimization": {\n    "stage": 3,\n    "overlap_comm": "maybe"\n  }\n}',
     ":4: zero_optimization.overlap_comm = 'maybe': expected true or false"),
    ('{"zero_optimization": {"stage": 3,}', "not valid JSON"),
    ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 3\n", ":3: fsdp_config.fsdp_version = 3: expected 1 or 2"),
    ("foo: 1\nbar: 2\n", "not a format plan --from reads"),
    ('{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}',
     "train_batch_size = 7"),
])
def test_bad_files_name_file_line_and_key(tmp_path, text, says):
    f = tmp_path / ("c.json" if text.startswith("{") else "c.yaml")
    f.write_text(text)
    r = CliRunner().invoke(app, ["plan", "--from", str(f)])
    assert r.exit_code == 2 and says in r.output and str(f.name) in r.output, r.output


def test_set_needs_a_shardwise_yaml():
    r = CliRunner().invoke(app, ["plan", "--from", str(DATA / "hf_ds_zero2.json"), "--set", "run.steps=3"])
    assert r.exit_code == 2 and "--set overrides a shardwise training YAML" in r.output


def test_emit_then_from_gives_the_plan_emitted(tmp_path):
    """plan --emit -> plan --from the emitted DeepSpeed JSON, accelerate YAML and shardwise YAML."""
    out = tmp_path / "emit"
    setup = ["-m", "llama-2-7b", "-s", "zero3", "--micro-batch", "2", "--checkpointing", "full"]
    r = CliRunner().invoke(app, ["plan", *setup, "--emit", str(out), "--emit-strategy", "zero3"])
    assert r.exit_code == 0, r.output
    # the JSON runs under another launcher (HF Trainer, deepspeed): what it cannot say (the loss, packing,
    # compiled layers) is planned with the planner's defaults, its ZeRO knobs as emitted
    want = plan(*FOREIGN, *setup)
    got = plan("--from", str(out / "ds_config.json"), "-m", "llama-2-7b", "--checkpointing", "full")
    got.pop("from")
    assert got == want  # batch, precision, ZeRO knobs and the layer fetch unit all come from the JSON
    # accelerate.yaml names ds_config_hf.json, whose batch and precision are "auto" (from the flags, as
    # accelerate does: launch_accelerate.sh passes --mixed_precision bf16, which the YAML does not say)
    got = plan("--from", str(out / "accelerate.yaml"), "-m", "llama-2-7b", "--checkpointing", "full",
               "--micro-batch", "2", "--precision", "bf16-mixed")
    got.pop("from")
    assert got == want
    # shardwise.yaml: its placeholders (the real weights and data) are planned without (and said);
    # it is the run the bare flags planned: the trainer's, packed SFT rows under FlexAttention included
    got = plan(str(out / "shardwise.yaml"))
    assert any("placeholder" in n for n in got.pop("from")["notes"])
    assert got["train"]["packed_attention"] == "flex"
    assert got == plan(*setup)


def test_fsdp_emit_round_trip_through_shardwise_yaml_and_stock_accelerate(tmp_path):
    out = tmp_path / "emit"
    setup = ["-m", "llama-2-7b", "-s", "fsdp", "--micro-batch", "2", "--checkpointing", "none"]
    assert CliRunner().invoke(app, ["plan", *setup, "--emit", str(out), "--emit-strategy", "fsdp"]).exit_code == 0
    got = plan(str(out / "shardwise.yaml"), "--set", "model.path=")
    src = got.pop("from")
    assert got == plan(*setup)
    assert plan(*src["as_flags"]) == got  # the trainer's knob defaults as flags
    # accelerate runs stock fully_shard: every layer resharded, gradients reduced in bf16
    got = plan("--from", str(out / "accelerate.yaml"), "-m", "llama-2-7b", "--micro-batch", "2")
    got.pop("from")
    assert got == plan(*FOREIGN, *setup, "--fsdp-reshard-after-forward", "layers", "--fsdp-wrap-embeddings", "--fsdp-reduce-dtype", "param",
                       "--fsdp-single-rank", "fsdp", "--fsdp-reduce-every-micro-batch", "false")  # and no_sync


def test_generated_flags_keep_the_old_names_and_take_the_spec_defaults():
    from shardwise.config.flags import FLAGS
    from shardwise.config.strategy import DDPKnobs, DeepSpeedKnobs, FSDPKnobs

    names = {n for f in FLAGS for n in f.names}
    assert {"--ds-reduce-bucket", "--ds-prefetch", "--ds-persistence-threshold", "--ds-max-live", "--ds-max-reuse",
            "--ds-overlap-comm", "--ds-multi-rank-allreduce", "--ds-comm-dtype", "--ds-fetch-unit",
            "--fsdp-reduce-dtype", "--fsdp-single-rank", "--fsdp-reshard-after-forward",
            "--fsdp-reduce-every-micro-batch", "--ddp-bucket-mb", "--ddp-wrap-one-rank"} <= names
    every = {(s, f) for s, cls in (("ds", DeepSpeedKnobs), ("fsdp", FSDPKnobs), ("ddp", DDPKnobs))
             for f in cls.model_fields}
    assert {(f.section, f.field) for f in FLAGS} == every  # one flag per knob field, nothing hand-listed
    r = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "250"})
    assert "Default: 5e8" in r.output and "strategy.deepspeed.reduce_bucket_size" in r.output


def test_from_runs_on_the_planner_only_install(tmp_path):
    """Every reader is torch-free: `plan --from` works where torch, transformers, deepspeed and
    accelerate cannot be imported (the core install)."""
    from tests.cli.test_cli_extras import planner_only

    example = ROOT / "examples" / "fsdp-synthetic-cpu.yaml"
    # (the LLaMA-Factory example names its DeepSpeed JSON relative to the repository root, and
    # this subprocess runs elsewhere: the other readers cover the imports)
    for f in [*(DATA / n for n in ("hf_ds_zero3.json", "accelerate_fsdp2.yaml", "axolotl_qlora.yaml")), example]:
        r = planner_only(["plan", "--from", str(f), "--json"], tmp_path)
        assert r.returncode == 0, (f, r.stderr[-3000:])
        assert json.loads(r.stdout)["from"]["file"] == str(f)


def test_accelerate_fsdp1_and_deepspeed_plugin(tmp_path):
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text("distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 16\nnum_machines: 2\n"
                     "fsdp_config:\n  fsdp_version: 1\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                     "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_backward_prefetch: BACKWARD_PRE\n")
    src = same(["--from", str(fsdp1)], ["-s", "fsdp-grad-op", "--gpus", "16", "--gpus-per-node", "8",
                                        "--fsdp-reduce-dtype", "param", "--fsdp-single-rank", "fsdp",
                                        "--fsdp-reduce-every-micro-batch", "false"])
    assert "fsdp_config.fsdp_backward_prefetch" in {i["key"] for i in src["ignored"]}
    plugin = tmp_path / "ds.yaml"
    plugin.write_text("distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 3\n"
                      "  offload_optimizer_device: cpu\n  gradient_accumulation_steps: 4\n  zero3_init_flag: true\n")
    # no mixed_precision: accelerate launch's default "no" (commands/launch.py), fp32
    same(["--from", str(plugin)], ["-s", "zero3+opt-offload", "--gpus", "8", "--gpus-per-node", "8",
                                   "--grad-accum", "4", "--ds-fetch-unit", "module", "--precision", "fp32"])


def test_training_args_fsdp_through_accelerates_plugin(tmp_path):
    f = tmp_path / "args.json"
    f.write_text(json.dumps({"output_dir": "o", "per_device_train_batch_size": 2, "bf16": True,
                             "fsdp": "full_shard auto_wrap",
                             "fsdp_config": {"fsdp_version": 2, "activation_checkpointing": True}}))
    same(["--from", str(f)], ["-s", "fsdp", "--micro-batch", "2", "--checkpointing", "full",
                              "--fsdp-reshard-after-forward", "layers", "--fsdp-wrap-embeddings", "--fsdp-reduce-dtype", "param",
                              "--fsdp-single-rank", "fsdp", "--fsdp-reduce-every-micro-batch", "false"])


def test_shardwise_yaml_with_set_is_the_trainers_runspec():
    """`plan CONFIG.yaml --set` takes the trainer's syntax and errors, and plans its RunSpec (on
    CUDA where --device cuda says so, over the YAML's run.device: cpu)."""
    from shardwise.config.load import load_config
    from shardwise.plan.planner import plan_strategies
    from shardwise.run import run_spec

    example = ROOT / "examples" / "fsdp-synthetic-cpu.yaml"
    got = plan(str(example), "--device", "cuda", "--set", "run.micro_batch=3", "--set", "strategy.name=zero2")
    run = run_spec(load_config(example, ["run.micro_batch=3", "strategy.name=zero2"]), got["hardware"]["gpus"],
                   "cuda", environ={})
    from shardwise.config.strategy import StrategyKnobs

    knobs = StrategyKnobs(ds=run.strategy.ds, fsdp=run.strategy.fsdp, ddp=run.strategy.ddp)
    [want] = plan_strategies(run.model, run.hardware, run.train, [run.strategy.name], knobs=knobs)
    row = got["strategies"][0]
    assert (row["name"], got["train"]["micro_batch"]) == ("zero2", 3)
    assert row["memory"]["total"] == pytest.approx(want.memory.gpu.total)
    assert row["time"]["step_s"] == pytest.approx(want.time.step_s)
    assert row["knobs"]["communication_data_type"] == "fp32"  # the trainer's default, not DeepSpeed's
    bad = CliRunner().invoke(app, ["plan", str(example), "--set", "run.micro_batch=abc"])
    assert bad.exit_code == 2 and "--set run.micro_batch=abc" in bad.output and "'run.micro_batch'" in bad.output


def test_autotp_emit_round_trip_through_the_deepspeed_json_and_shardwise_yaml(tmp_path):
    """ZeRO-2 x tp 2 (DeepSpeed's AutoTP): --emit writes `tensor_parallel.autotp_size` and
    `strategy.tp`, and --from either file plans the same TP run."""
    out = tmp_path / "emit"
    setup = ["-m", "llama-2-7b", "-s", "zero2", "--tp", "2", "--micro-batch", "2", "--checkpointing", "none"]
    r = CliRunner().invoke(app, ["plan", *setup, "--emit", str(out), "--emit-strategy", "zero2"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "ds_config.json").read_text())["tensor_parallel"]["autotp_size"] == 2
    got = plan("--from", str(out / "ds_config.json"), "-m", "llama-2-7b")
    src = got.pop("from")
    assert got == plan(*FOREIGN, *setup) and "--tp" in src["as_flags"]
    assert "tensor_parallel.autotp_size" in {i["key"] for i in src["read"]}
    got = plan(str(out / "shardwise.yaml"), "--set", "model.path=")
    got.pop("from")
    assert got == plan(*setup)


def test_autotp_under_zero3_is_refused_naming_the_key(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}))
    r = CliRunner().invoke(app, ["plan", "--from", str(f)])
    assert r.exit_code == 2
    assert "tensor_parallel.autotp_size" in r.output and "ZeRO stage 0, 1 or 2" in " ".join(r.output.split())


# --- pipeline and tensor parallelism in a DeepSpeed JSON, pipelines in a shardwise YAML -------------

PIPE = DATA / "ds_zero1_pipeline_tp.json"
H100_64 = ["--gpus", "64", "--gpu", "h100-sxm"]


def test_a_deepspeed_pipeline_is_planned_as_deepspeed_runs_it():
    """ZeRO-1 × pp 4 × the file's tp 4 on 64 GPUs: one row, zero1 tp4 pp4 (Megatron-DeepSpeed's TP
    beside DeepSpeed's pipeline engine), plan-only with that tool, and the recommendation names
    what shardwise train runs at the same layout: FSDP2 stages, tp 4, pp 4."""
    src = same(["--from", str(PIPE), *H100_64],
               [*H100_64, "-s", "zero1", "--pp", "4", "--tp", "4", "--micro-batch", "1", "--grad-accum", "32",
                "--precision", "bf16-mixed", "--checkpointing", "full", "--ds-reduce-bucket", "500000000"])
    doc = plan("--from", str(PIPE), *H100_64)
    assert [(s["name"], s["tp"], s["pp"], s["dp"]) for s in doc["strategies"]] == [("zero1", 4, 4, 4)]
    r = doc["recommended_setting"]
    assert (r["strategy"], r["tp"], r["pp"], r["runnable"], r["tool"]) == ("zero1", 4, 4, False, "Megatron-DeepSpeed")
    eq = r["runnable_equivalent"]
    assert eq["strategy"] in ("fsdp", "fsdp-grad-op", "fsdp-hybrid") and (eq["tp"], eq["pp"]) == (4, 4)
    assert f"shardwise train runs the same layout as {eq['strategy']} tp4 pp4" in doc["reason"]
    read = {i["key"]: i["as"] for i in src["read"]}
    assert read["pipeline.stages"].startswith("--pp 4") and read["tensor_parallel.tp_size"].startswith("--tp 4")
    assert read["pipeline.activation_checkpoint_interval"].startswith("--checkpointing full")
    assert read["train_batch_size"] == "checked: 1 × 32 × 4 data-parallel ranks (64 GPUs / (pp 4 × tp 4))"
    ignored = {i["key"] for i in src["ignored"]}
    assert {"pipeline.partition", "pipeline.pipe_partitioned", "pipeline.grad_partitioned"} <= ignored
    assert any("tensor_parallel.tp_size: deepspeed.init_inference's key" in n for n in src["notes"])
    # what to change stays in the file's own keys: a pipeline's checkpointing is the engine's interval
    edits = [k for item in src["what_to_change"]["faster"] for k in item["edits"]]
    assert edits and not [k for k in edits if k.startswith("TrainingArguments")]
    assert all(item["strategy"] in ("zero0", "zero1") for item in src["what_to_change"]["faster"])


def test_pipeline_parallel_size_and_autotp_beside_stages(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 0}, "pipeline_parallel_size": 2,
                             "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}},
                             "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}))
    doc = plan("--from", str(f), "--gpus", "16")
    assert [(s["name"], s["tp"], s["pp"]) for s in doc["strategies"]] == [("zero0", 2, 2)]
    read = {i["key"]: i["as"] for i in doc["from"]["read"]}
    assert read["pipeline_parallel_size"].startswith("--pp 2") and "Megatron-DeepSpeed" in read["tensor_parallel.autotp_size"]
    assert read["tensor_parallel.tp.tp_size"].startswith("checked")


@pytest.mark.parametrize(("data", "says"), [
    ({"zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}},
     ["pipeline.stages = 2", "ZeRO stage 0 or 1 with pipeline stages", "incompatible with pipeline"]),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}, "pipeline_parallel_size": 4},
     ["pipeline_parallel_size = 4", "2, the pipeline.stages of the same file"]),
    ({"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
     ["tensor_parallel.tp.tp_size = 4", "1 or 2, the tensor_parallel.autotp_size"]),
    ({"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2, "tp_size": 4}},
     ["tensor_parallel.tp_size = 4", "2, the tensor_parallel.autotp_size of the same file"]),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}, "train_micro_batch_size_per_gpu": 1,
      "gradient_accumulation_steps": 4, "train_batch_size": 32},
     ["train_batch_size = 32", "1 × accumulation 4 × 4 data-parallel ranks (8 GPUs / (pp 2 × tp 1)) = 16"]),
    ({"zero_optimization": {"stage": 1}, "pipeline": "two"}, ["pipeline = 'two'", "a mapping"]),
])  # fmt: skip
def test_bad_model_parallel_keys_name_the_key(tmp_path, data, says):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(data))
    r = CliRunner().invoke(app, ["plan", "--from", str(f), "--gpus", "8"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    for s in says:
        assert s in text


def test_a_shardwise_yaml_pipeline_is_planned(tmp_path):
    """strategy.pp / pp_schedule / pp_virtual_stages of a shardwise YAML go through run_spec into
    the plan: the emitted pipeline plans as its flags do, and says them as flags."""
    out = tmp_path / "emit"
    setup = ["-m", "llama-2-7b", "--gpus", "16", "-s", "fsdp", "--pp", "2", "--pp-schedule", "interleaved-1f1b",
             "--pp-virtual-stages", "2", "--micro-batch", "1", "--grad-accum", "8",
             "--checkpointing", "none"]
    r = CliRunner().invoke(app, ["plan", *setup, "--emit", str(out), "--emit-strategy", "fsdp"])
    assert r.exit_code == 0, r.output
    got = plan(str(out / "shardwise.yaml"), "--set", "model.path=", "--gpus", "16")
    src = got.pop("from")
    assert got == plan(*setup)
    assert [(s["name"], s["pp"]) for s in got["strategies"]] == [("fsdp", 2)]
    r = got["recommended_setting"]
    assert (r["pp"], r["pp_schedule"], r["pp_virtual_stages"]) == (2, "interleaved-1f1b", 2)
    flags = src["as_flags"]
    assert flags[flags.index("--pp") + 1] == "2" and flags[flags.index("--pp-schedule") + 1] == "interleaved-1f1b"
    assert flags[flags.index("--pp-virtual-stages") + 1] == "2"
    # a schedule the trainer refuses is refused by --from as by shardwise train, naming the YAML's keys
    bad = tmp_path / "bad.yaml"
    bad.write_text((out / "shardwise.yaml").read_text().replace("grad_accum: 8", "grad_accum: 5"))
    res = CliRunner().invoke(app, ["plan", str(bad), "--set", "model.path=", "--gpus", "16"])
    assert res.exit_code == 2 and "strategy.pp_schedule / run.grad_accum" in " ".join(res.output.split())



@pytest.mark.parametrize(("optim", "impl"), [("adamw_hf", "forloop"), ("adamw_apex_fused", "fused"),
                                             ("adamw_torch", "foreach"), ("adamw_torch_fused", "fused")])
def test_training_args_optim_names_the_kernel_it_runs(tmp_path, optim, impl):
    """transformers' own AdamW (`adamw_hf`) steps each parameter in Python with its own eager ops: a
    run of many small tensors pays a launch per op per tensor, which the planner prices only for
    `--optimizer-impl forloop`."""
    f = tmp_path / "args.json"
    f.write_text(json.dumps({"output_dir": "o", "per_device_train_batch_size": 2, "bf16": True, "optim": optim,
                             "model_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    source = same(["--from", str(f)], ["-m", "qwen2.5-0.5b", "-s", "ddp", "--micro-batch", "2", "--grad-accum", "1",
                                       "--precision", "bf16-mixed", "--checkpointing", "none", "--weight-decay", "0",
                                       "--optimizer-impl", impl])
    assert ["--optimizer-impl", impl] in [source["as_flags"][i:i + 2] for i in range(len(source["as_flags"]))]
