"""`plan --from` on published configs whose keys an earlier reading lost: each file is planned as
its own tool runs it, every expected value derived from that tool's source (cited beside it).

The files in tests/data/from/ (verbatim unless said):
lf_ds_z3_fp8_config.json: hiyouga/LLaMA-Factory examples/deepspeed/ds_z3_fp8_config.json (commit 45d4bde);
accelerate_tp_hsdp.yaml: huggingface/accelerate examples/torch_native_parallelism/configs/tp_hsdp.yaml
(commit 571ca02); trl_context_parallel_2gpu.yaml: huggingface/trl
examples/accelerate_configs/context_parallel_2gpu.yaml (commit 39662df); axolotl_hsdp_tp.yaml:
axolotl-ai-cloud/axolotl examples/distributed-parallel/llama-3_1-8b-hsdp-tp.yaml (commit 254e2be);
axolotl_fsdp_tp_cp.yaml: axolotl-ai-cloud/axolotl examples/distributed-parallel/qwen3-8b-fsdp-tp-cp.yaml
(commit 3922662); ah_zephyr_sft_qlora.yaml: huggingface/alignment-handbook
recipes/zephyr-7b-beta/sft/config_qlora.yaml (commit 0213b5b); openr1_grpo_demo.yaml:
huggingface/open-r1 recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml (commit 1b6fcac);
axolotl_qlora_fsdp_70b.yaml: axolotl-ai-cloud/axolotl examples/llama-3/qlora-fsdp-70b.yaml (commit
1c14c4a); axolotl_3b_fp8_fsdp2.yaml: axolotl-ai-cloud/axolotl examples/llama-3/3b-fp8-fsdp2.yaml
(commit 015d9de); lf_llama3_freeze_sft.yaml, lf_llama3_galore_full_sft.yaml,
lf_llama3_fp8_deepspeed_sft.yaml: hiyouga/LLaMA-Factory examples/extras/llama_pro/llama3_freeze_sft.yaml
(commit 0926d81), examples/extras/galore/llama3_full_sft.yaml (commit 3075df1),
examples/extras/fp8/llama3_fp8_deepspeed_sft.yaml (commit 52925a1).
DeepSpeed's short ZeRO-3 key names are those of deepspeedai/DeepSpeed deepspeed/runtime/zero/config.py
(commit 1b88ac3): `prefetch_bucket_size`, `param_persistence_threshold`, `max_live_parameters`,
`max_reuse_distance` are DeepSpeedZeroConfig's fields, each with its `stage3_` key as the alias.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.ingest.test_plan_from import DATA, plan, same
from typer.testing import CliRunner

from shardwise.cli.app import app


def _written(text: str) -> Path:
    import tempfile

    f = Path(tempfile.mkdtemp()) / "axolotl.yaml"
    f.write_text(text)
    return f


def refused(*args: str) -> str:
    r = CliRunner().invoke(app, ["plan", *args])
    assert r.exit_code == 2, r.output
    return " ".join(r.output.split())


# --- DeepSpeed JSON -------------------------------------------------------------------------------

def test_deepspeed_short_zero3_names_are_read(tmp_path: Path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 5e7, "param_persistence_threshold": 1e5, "max_live_parameters": 1e9,
        "max_reuse_distance": 1e8}}))
    src = same(["--from", str(f), "-m", "llama-2-7b"],
               ["-m", "llama-2-7b", "-s", "zero3", "--precision", "bf16-mixed", "--ds-prefetch", "50000000",
                "--ds-persistence-threshold", "100000", "--ds-max-live", "1000000000", "--ds-max-reuse", "100000000",
                "--ds-fetch-unit", "module"])
    assert not [i for i in src["ignored"] if "not a key" in i["why"]]
    # HF Trainer fills "auto" under the stage3_ names only (integrations/deepspeed.py trainer_config_finalize)
    f.write_text(json.dumps({"zero_optimization": {"stage": 3, "prefetch_bucket_size": "auto"}}))
    assert "zero_optimization.prefetch_bucket_size = 'auto'" in refused("--from", str(f))
    f.write_text(json.dumps({"zero_optimization": {"stage": 3, "max_live_parameters": 1, "stage3_max_live_parameters": 2}}))
    assert "one of max_live_parameters and stage3_max_live_parameters" in refused("--from", str(f))


def test_param_offload_alone_is_refused_naming_the_key(tmp_path: Path):
    """ZeRO-3 offload_param without offload_optimizer: DeepSpeed keeps the optimizer on the GPU
    (stage3.py _configure_offloading offloads the optimizer only where offload_optimizer names a
    device) and the parameters on the host; no strategy row plans that split (zero3+full-offload
    moves the optimizer step too, zero3 keeps the parameters on the GPU), so it is refused, naming
    the key and what to set. (It was planned as zero3 with a first-line warning: a run DeepSpeed
    does not give.)"""
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"bf16": {"enabled": True},
                             "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    text = refused("--from", str(f))
    assert "zero_optimization.offload_param.device = 'cpu': not plannable: offload_param without " \
           "offload_optimizer" in text
    assert "zero_optimization.offload_optimizer.device" in text


def test_fp16_false_beside_bf16_auto_is_the_trainers_precision(tmp_path: Path):
    """HF fills bf16.enabled "auto" from TrainingArguments.bf16 (integrations/deepspeed.py
    trainer_config_process: fill_match("bf16.enabled", ...)), so fp16 false does not make it fp32."""
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"fp16": {"enabled": False}, "bf16": {"enabled": "auto"},
                             "zero_optimization": {"stage": 2}}))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "o", "per_device_train_batch_size": 2, "bf16": True,
                                "deepspeed": str(f)}))
    src = same(["--from", str(args)], ["-s", "zero2", "--micro-batch", "2", "--precision", "bf16-mixed"])
    assert src["values"]["precision"] == "bf16-mixed"


def test_deepspeed_zenflow_is_refused_naming_the_key(tmp_path: Path):
    """A zenflow section (not null) turns DeepSpeed's ZenFlow optimizer on (zenflow/engine.py
    configure_zenflow): not planned, refused; `zenflow: null` is ZenFlow off."""
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.1}}}))
    assert "zero_optimization.zenflow = '{...}': not plannable: ZenFlow" in refused("--from", str(f))
    f.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": None}}))
    src = plan("--from", str(f))["from"]
    assert {r["key"]: r["as"] for r in src["read"]}["zero_optimization.zenflow"] == "null: ZenFlow off"


def test_deepspeed_bf16_master_weights_and_optimizer_states_are_bf16_pure(tmp_path: Path):
    """bf16.bf16_master_weights_and_grads with bf16_optimizer_states keep the ZeRO optimizer's master
    weights, gradients and Adam states in bf16 (DeepSpeed precision_config.py DeepSpeedBF16Config):
    bf16-pure. The master weights alone keep fp32 states (on the host), which no precision splits
    so: said first; the states without the master weights, or either under stage 0, DeepSpeed
    refuses (runtime/config.py asserts), and so does the plan."""
    f = tmp_path / "ds.json"
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    f.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": bf16, "zero_optimization": {"stage": 3}}))
    same(["--from", str(f), "-m", "llama-2-7b"],
         ["-m", "llama-2-7b", "-s", "zero3", "--micro-batch", "4", "--precision", "bf16-pure",
          "--ds-fetch-unit", "module"])
    f.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": {**bf16, "bf16_optimizer_states": False},
                             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    got = plan("--from", str(f))
    assert got["train"]["precision"] == "bf16-mixed"
    assert any("bf16_master_weights_and_grads is not planned" in w for w in got["from"]["warnings"])
    f.write_text(json.dumps({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                             "zero_optimization": {"stage": 2}}))
    assert "requires bf16_master_weights_and_grads" in refused("--from", str(f))
    f.write_text(json.dumps({"bf16": bf16, "zero_optimization": {"stage": 0}}))
    assert "only supported with ZeRO Stage 1, 2, or 3" in refused("--from", str(f))


def test_deepspeed_fp8_is_refused_naming_the_key():
    assert "fp8.enabled = True: not plannable" in refused("--from", str(DATA / "lf_ds_z3_fp8_config.json"))


def test_a_bare_deepspeed_json_says_what_it_left_unsaid(tmp_path: Path):
    """No fp16/bf16 section: raw DeepSpeed trains in fp32 (runtime/config.py: both disabled by
    default); no model key: the plan says which it used."""
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}))
    src = same(["--from", str(f)], ["-s", "zero2", "--precision", "fp32"])
    assert any(w.startswith("model: not named in the file") and "pass --model" in w for w in src["warnings"])
    assert any("planned as fp32" in w for w in src["warnings"])
    assert plan("--from", str(f), "-m", "llama-2-7b", "--precision", "bf16-mixed")["train"]["precision"] == "bf16-mixed"


# --- accelerate YAML ------------------------------------------------------------------------------

def test_accelerate_tp_and_hsdp_parallelism_config(tmp_path: Path):
    """accelerate's TP + HSDP example: 8 processes = dp_replicate 2 × dp_shard 2 × tp 2
    (ParallelismConfig: the product is num_processes); FSDP2 resharding after forward, bf16."""
    src = same(["--from", str(DATA / "accelerate_tp_hsdp.yaml")],
               ["-s", "fsdp-hybrid", "--shard-group", "2", "--tp", "2", "--gpus", "8", "--gpus-per-node", "8",
                "--checkpointing", "none", "--fsdp-reshard-after-forward", "layers", "--fsdp-wrap-embeddings", "--fsdp-reduce-dtype", "param",
                "--fsdp-single-rank", "fsdp", "--fsdp-reduce-every-micro-batch", "false"])
    doc = plan("--from", str(DATA / "accelerate_tp_hsdp.yaml"))
    assert [(s["name"], s["tp"], s["dp"]) for s in doc["strategies"]] == [("fsdp-hybrid", 2, 4)]
    assert any(w.startswith("model: not named in the file") for w in src["warnings"])
    bad = tmp_path / "acc.yaml"
    bad.write_text((DATA / "accelerate_tp_hsdp.yaml").read_text().replace("num_processes: 8", "num_processes: 16"))
    assert "sizes whose product is the 16 processes" in refused("--from", str(bad))


def test_accelerate_context_parallelism_is_planned_as_torchs_context_parallel():
    """TRL's CP config: 2 processes, dp_shard 1 × cp 2 (accelerate ParallelismConfig: the product is
    num_processes), FSDP2 (activation checkpointing off at this commit): accelerate's `maybe_context_parallel` runs
    torch's context_parallel over the FSDP2 model, which shards over the 2 cp ranks."""
    src = same(["--from", str(DATA / "trl_context_parallel_2gpu.yaml"), "-m", "llama-3.2-3b", "--seq-len", "16384"],
               ["-m", "llama-3.2-3b", "--seq-len", "16384", "-s", "fsdp", "--gpus", "2", "--gpus-per-node", "2",
                "--cp", "2", "--cp-impl", "torch", "--checkpointing", "none", "--precision", "bf16-mixed",
                "--micro-batch", "1", "--packed-attention", "none", "--cross-entropy", "standard", "--no-fused-kernels",
                "--fsdp-reshard-after-forward", "layers", "--fsdp-wrap-embeddings", "--fsdp-reduce-dtype", "param", "--fsdp-single-rank", "fsdp",
                "--fsdp-reduce-every-micro-batch", "false"])
    assert any(r["key"] == "parallelism_config.parallelism_config_cp_size" and "--cp 2" in r["as"]
               for r in src["read"])
    doc = plan("--from", str(DATA / "trl_context_parallel_2gpu.yaml"), "-m", "llama-3.2-3b", "--seq-len", "16384")
    assert [(s["name"], s["cp"], s["cp_impl"], s["dp_shard"]) for s in doc["strategies"]] == [("fsdp", 2, "torch", 2)]


def test_accelerate_param_offload_plugin_is_refused(tmp_path: Path):
    """The plugin's offload_param_device alone: as a DeepSpeed JSON's offload_param alone (above)."""
    f = tmp_path / "acc.yaml"
    f.write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 8\ndeepspeed_config:\n"
                 "  zero_stage: 3\n  offload_optimizer_device: none\n  offload_param_device: cpu\n")
    assert "deepspeed_config.offload_param_device = 'cpu': not plannable" in refused("--from", str(f))


def test_accelerate_deepspeed_file_with_auto_precision_is_fp32(tmp_path: Path):
    """A deepspeed_config_file whose fp16/bf16 are "auto": accelerate launch's mixed_precision is "no"
    where neither its flag nor the config names one (accelerate commands/launch.py), and
    DeepSpeedPlugin.set_mixed_precision fills both "auto" with false: fp32, said first; a
    --precision beside the file is the launch line's flag and wins."""
    f = tmp_path / "acc.yaml"
    f.write_text(f"distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n"
                 f"  deepspeed_config_file: {DATA / 'hf_ds_zero2.json'}\n")
    got = plan("--from", str(f))
    assert got["train"]["precision"] == "fp32"
    assert any("planned as fp32" in w and "--mixed_precision" in w for w in got["from"]["warnings"])
    assert plan("--from", str(f), "--precision", "bf16-mixed")["train"]["precision"] == "bf16-mixed"
    f.write_text(f.read_text() + "mixed_precision: bf16\n")
    assert plan("--from", str(f))["train"]["precision"] == "bf16-mixed"


def test_alignment_handbook_qlora_recipe_is_qlora():
    """TRL ModelConfig: use_peft + load_in_4bit = a 4-bit bitsandbytes base with LoRA adapters of
    rank lora_r on lora_target_modules with lora_dropout 0.05 (trl/trainer/model_config.py, get_quantization_config,
    get_peft_config); the SFT arguments as HF Trainer reads them: per_device_train_batch_size 4,
    gradient_accumulation_steps 2, bf16, gradient_checkpointing, max_length 2048 (SFTConfig); no
    deepspeed/fsdp: DDP; attn_implementation flash_attention_2."""
    seven = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    src = same(["--from", str(DATA / "ah_zephyr_sft_qlora.yaml")],
               ["-m", "mistral-7b", "-s", "ddp", "--micro-batch", "4", "--grad-accum", "2", "--precision",
                "bf16-mixed", "--checkpointing", "full", "--seq-len", "2048", "--lora-rank", "16", "--lora-targets",
                seven, "--lora-dropout", "0.05", "--qlora", "--attention", "flash"])
    ignored = {i["key"] for i in src["ignored"]}
    assert not ignored & {"use_peft", "load_in_4bit", "lora_r", "lora_alpha", "lora_target_modules"}
    # the launcher's process count is not in the file: the plan says which it used
    assert "not in the file, planned with shardwise's defaults: --gpus 8 --gpu a100-80g (pass your own)" in src[
        "warnings"]


def test_grpo_recipe_plans_prompt_plus_completion_and_says_what_is_not_planned():
    """GRPOConfig: a row is the prompt (max_prompt_length 512) and its completion
    (max_completion_length 1024): sequence 1536; the rollouts are not planned (said first). Its
    torch_dtype bfloat16 under DDP, full fine-tuning: the weights train as loaded, bf16-pure."""
    src = same(["--from", str(DATA / "openr1_grpo_demo.yaml")],
               ["-m", "qwen2.5-1.5b", "-s", "ddp", "--micro-batch", "16", "--grad-accum", "16", "--precision",
                "bf16-pure", "--checkpointing", "full", "--seq-len", "1536", "--attention", "flash"])
    assert any("GRPO" in w and "not planned" in w for w in src["warnings"])
    assert any(w.startswith("openr1_grpo_demo.yaml: num_processes") for w in src["warnings"])


def test_galore_optimizer_is_refused(tmp_path: Path):
    f = tmp_path / "args.json"
    f.write_text(json.dumps({"output_dir": "o", "per_device_train_batch_size": 1, "optim": "galore_adamw"}))
    assert "optim = 'galore_adamw': not plannable: GaLore" in refused("--from", str(f))


# --- axolotl --------------------------------------------------------------------------------------

# accelerate's FSDP2 (axolotl and the HF Trainer run it): every layer and the embedding resharded, the head
# a unit of its own kept gathered, bf16 reduce, fully_shard on one rank too, and no_sync under accumulation
# (the unsharded grads held)
FSDP_ACCELERATE = ["--fsdp-reshard-after-forward", "layers", "--fsdp-wrap-embeddings", "--fsdp-reduce-dtype", "param",
                   "--fsdp-single-rank", "fsdp", "--fsdp-reduce-every-micro-batch", "false"]


def test_axolotl_fsdp_offload_params_is_offload():
    """fsdp_config.fsdp_offload_params: true is accelerate's CPUOffload of the FSDP units
    (FullyShardedDataParallelPlugin.cpu_offload): fsdp+offload. adapter qlora, lora_r 8,
    lora_target_linear (every linear), lora_dropout 0.05, sequence_len 512, micro_batch_size 1, accumulation 4,
    gradient_checkpointing, flash_attention, optimizer adamw_torch (HF's foreach AdamW), bf16 auto."""
    src = same(["--from", str(DATA / "axolotl_qlora_fsdp_70b.yaml"), "-m", "llama-3-70b"],
               ["-m", "llama-3-70b", "-s", "fsdp+offload", "--micro-batch", "1", "--grad-accum", "4", "--seq-len",
                "512", "--lora-rank", "8", "--lora-targets", "all-linear", "--lora-dropout", "0.05", "--qlora",
                "--checkpointing", "full", "--attention", "flash", "--weight-decay", "0", "--optimizer-impl", "foreach",
                *FSDP_ACCELERATE])
    read = {i["key"]: i["as"] for i in src["read"]}
    assert read["fsdp_config.fsdp_offload_params"].startswith("true: -s fsdp+offload")


def test_axolotl_hsdp_and_tensor_parallel_sizes():
    """dp_shard_size 4 × dp_replicate_size 2 × tensor_parallel_size 2 = 16 ranks: HSDP (shard
    group 4) at TP 2; the CutCrossEntropyPlugin computes the loss without the logits (fused)."""
    same(["--from", str(DATA / "axolotl_hsdp_tp.yaml")],
         ["-m", "llama-3.1-8b", "-s", "fsdp-hybrid", "--shard-group", "4", "--tp", "2", "--gpus", "16",
          "--micro-batch", "1", "--grad-accum", "1", "--seq-len", "2048", "--precision", "bf16-mixed",
          "--packed-attention", "flash_varlen", "--attention", "flash", "--cross-entropy", "fused",
          "--optimizer-impl", "fused", *FSDP_ACCELERATE])
    doc = plan("--from", str(DATA / "axolotl_hsdp_tp.yaml"))
    assert [(s["name"], s["tp"], s["dp"]) for s in doc["strategies"]] == [("fsdp-hybrid", 2, 8)]


def test_axolotl_context_parallel_is_planned_as_its_ring_attention():
    """dp_shard_size 2 × context_parallel_size 2 × tensor_parallel_size 2 = 8 ranks. Under
    sample_packing axolotl's ring_attn_func defaults to varlen_llama3 (`validate_ring_attn_func`):
    ring-flash-attn's llama3 varlen function, K/V all-gathered, each row cut into cp consecutive
    chunks (`chunk(local_world_size)[local_rank]`); flash_attention_2 packs with the varlen kernel."""
    same(["--from", str(DATA / "axolotl_fsdp_tp_cp.yaml")],
         ["-m", "qwen3-8b", "-s", "fsdp", "--tp", "2", "--cp", "2", "--cp-impl", "allgather", "--no-cp-load-balance",
          "--gpus", "8", "--micro-batch", "1", "--grad-accum", "1", "--seq-len", "8192", "--precision", "bf16-mixed",
          "--packed-attention", "flash_varlen", "--attention", "flash", "--cross-entropy", "fused",
          "--optimizer-impl", "fused", *FSDP_ACCELERATE])
    doc = plan("--from", str(DATA / "axolotl_fsdp_tp_cp.yaml"))
    assert [(s["name"], s["tp"], s["cp"], s["dp_shard"]) for s in doc["strategies"]] == [("fsdp", 2, 2, 4)]
    # batch_ring without packing; an unknown ring function names the key
    text = (DATA / "axolotl_fsdp_tp_cp.yaml").read_text()
    unpacked = plan("--from", str(_written(text.replace("sample_packing: true", "sample_packing: false"))))
    assert unpacked["strategies"][0]["cp_impl"] == "ring"
    assert "ring_attn_func" in refused("--from", str(_written(text + "ring_attn_func: spiral\n")))



def test_axolotl_fp8_is_planned_as_torchaos_tensorwise_recipe_with_its_all_gather():
    """fp8: true is torchao float8 with axolotl's default tensorwise recipe, and
    fp8_enable_fsdp_float8_all_gather its FSDP2 float8 all-gather; on a GPU without FP8 tensor cores
    (the planner's default A100) it is refused naming the GPU."""
    assert "a100-80g has no FP8 tensor-core rate" in refused("--from", str(DATA / "axolotl_3b_fp8_fsdp2.yaml"))
    r = CliRunner().invoke(app, ["plan", "--from", str(DATA / "axolotl_3b_fp8_fsdp2.yaml"), "--gpu", "h100-sxm",
                                 "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["train"]["fp8"], doc["train"]["fp8_all_gather"]) == ("tensorwise", True)
    assert ["--fp8", "tensorwise"] in [doc["from"]["as_flags"][i:i + 2] for i in range(len(doc["from"]["as_flags"]))]


# --- LLaMA-Factory --------------------------------------------------------------------------------

def test_bf16_weights_trained_under_ddp_are_bf16_pure(tmp_path: Path):
    """A full fine-tuning whose weights load in bf16 and train under DDP has no fp32 master (the
    Trainer's AdamW steps the weights as loaded): bf16-pure. axolotl loads in bf16 for bf16 (true or
    auto: resolve_dtype's torch_dtype), TRL/the alignment handbook for torch_dtype: bfloat16. Under
    DeepSpeed (fp32 masters) or FSDP (accelerate upcasts to fp32), or with LoRA, bf16-mixed."""
    ax = tmp_path / "ax.yaml"
    base = ("base_model: meta-llama/Llama-3.2-1B\nsequence_len: 2048\nmicro_batch_size: 1\n"
            "gradient_accumulation_steps: 1\nbf16: auto\n")
    ax.write_text(base)
    assert plan("--from", str(ax))["train"]["precision"] == "bf16-pure"
    ax.write_text(base + "adapter: lora\nlora_r: 8\nlora_target_linear: true\n")
    assert plan("--from", str(ax))["train"]["precision"] == "bf16-mixed"
    ax.write_text(base + "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n")
    assert plan("--from", str(ax))["train"]["precision"] == "bf16-mixed"
    ax.write_text(base.replace("bf16: auto", "bf16: false"))
    assert plan("--from", str(ax))["train"]["precision"] == "fp32"
    trl = tmp_path / "sft.yaml"
    base = ("model_name_or_path: meta-llama/Llama-3.2-1B\ntorch_dtype: bfloat16\nbf16: true\n"
            "per_device_train_batch_size: 1\noutput_dir: out\n")
    trl.write_text(base)
    got = plan("--from", str(trl))
    assert got["train"]["precision"] == "bf16-pure"
    assert not any("torch_dtype" in w for w in got["from"]["warnings"])
    assert plan("--from", str(trl), "--precision", "bf16-mixed")["train"]["precision"] == "bf16-mixed"
    trl.write_text(base + "use_peft: true\n")
    assert plan("--from", str(trl))["train"]["precision"] == "bf16-mixed"
    trl.write_text(base + "fsdp: full_shard auto_wrap\n")
    assert plan("--from", str(trl))["train"]["precision"] == "bf16-mixed"
    trl.write_text(base.replace("bfloat16", "float16").replace("bf16: true", "fp16: true"))
    got = plan("--from", str(trl))
    assert got["train"]["precision"] == "fp16-mixed"
    assert any("torch_dtype is not planned" in w for w in got["from"]["warnings"])


def test_axolotl_unfrozen_parameters_is_refused_before_its_deepspeed_json():
    """axolotl's bigstral example (unfrozen_parameters: embeddings, lm_head, experts of layers 44-55)
    trains a subset of tensors (utils/freeze.py freeze_layers_except): refused for that, before the
    DeepSpeed JSON it names (whose offload_param alone is refused too) is read."""
    root = Path(__file__).parents[1] / "data" / "corpus" / "axolotl"
    text = refused("--from", str(root / "examples/mistral/bigstral/bigstral-ds-zero3.yaml"),
                   "--model", "llama-2-7b")
    assert "unfrozen_parameters = '6 pattern(s)': not plannable: axolotl trains only the parameters" in text
    assert "offload_param" not in text


def test_llama_factory_freeze_and_galore_are_refused_with_the_reason():
    """freeze: only the last freeze_trainable_layers (8 here) train (LLaMA-Factory
    model/adapter.py _setup_freeze_tuning); GaLore is not in the planner."""
    text = refused("--from", str(DATA / "lf_llama3_freeze_sft.yaml"))
    assert "finetuning_type = 'freeze': not plannable: only the last 8 layer(s) train" in text
    text = refused("--from", str(DATA / "lf_llama3_galore_full_sft.yaml"))
    assert "use_galore = True: not plannable: GaLore" in text and "galore_layerwise" in text



def test_llama_factory_fp8_is_planned_by_its_backend_and_a_deepspeed_fp8_section_refused(tmp_path: Path):
    """fp8_backend te is Transformer Engine's delayed scaling, torchao (and auto) torchao's rowwise
    recipe (LLaMA-Factory train/fp8_utils.py); the DeepSpeed JSON the example names has an fp8
    section beside bf16 and fp16 off, which DeepSpeed's ZeRO engine does not run: refused."""
    text = (DATA / "lf_llama3_fp8_deepspeed_sft.yaml").read_text()
    named = tmp_path / "with_ds.yaml"
    named.write_text(text.replace("examples/deepspeed/ds_z3_fp8_config.json", str(DATA / "lf_ds_z3_fp8_config.json")))
    assert "fp8.enabled = True: not plannable" in refused("--from", str(named))
    alone = tmp_path / "alone.yaml"
    alone.write_text(text.replace("deepspeed: examples/deepspeed/ds_z3_fp8_config.json", ""))
    for backend, recipe in (("te", "delayed"), ("torchao", "rowwise")):
        alone.write_text(alone.read_text().replace("fp8_backend: te", f"fp8_backend: {backend}").replace(
            "fp8_backend: torchao", f"fp8_backend: {backend}"))
        r = CliRunner().invoke(app, ["plan", "--from", str(alone), "--gpu", "h100-sxm", "--json"])
        assert r.exit_code in (0, 3), r.output
        assert json.loads(r.stdout)["train"]["fp8"] == recipe


def test_a_trainer_yaml_with_bf16_true_is_not_a_deepspeed_json(tmp_path: Path):
    """DeepSpeed's fp16/bf16 are sections; a trainer's `bf16: true` (and `optim: adamw_torch_8bit`,
    HF's torchao 8-bit AdamW) belong to the LLaMA-Factory file they are in."""
    f = tmp_path / "lf.yaml"
    f.write_text("model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct\nstage: sft\nfinetuning_type: full\n"
                 "optim: adamw_torch_8bit\ncutoff_len: 1024\nper_device_train_batch_size: 1\nbf16: true\n")
    r = CliRunner().invoke(app, ["plan", "--from", str(f), "--json"])  # (DDP of 8B does not fit: exit 3)
    src = json.loads(r.stdout)["from"]
    assert (src["format"], src["values"]["optimizer"]) == ("llama_factory", "adamw8bit")


def test_an_accelerate_deepspeed_file_says_its_auto_micro_batch_is_the_scripts(monkeypatch):
    """accelerate's own DeepSpeed template names a JSON whose train_micro_batch_size_per_gpu is
    "auto": accelerate fills it from the script's DataLoader, which the file cannot say, so the
    plan says what it assumed and which flag to pass (and says nothing once the flag is given)."""
    monkeypatch.chdir(Path(__file__).parents[1] / "data" / "corpus" / "accelerate")
    r = CliRunner().invoke(app, ["plan", "--from", "examples/config_yaml_templates/deepspeed.yaml"])
    assert r.exit_code in (0, 3), r.output
    assert 'train_micro_batch_size_per_gpu "auto" is your script\'s DataLoader batch size' in " ".join(r.output.split())
    r = CliRunner().invoke(app, ["plan", "--from", "examples/config_yaml_templates/deepspeed.yaml", "--micro-batch", "4"])
    assert "DataLoader batch size" not in r.output
