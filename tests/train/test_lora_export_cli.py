"""A LoRA run's export through the user's commands, without the base built: `shardwise train`
on 2 ranks with `checkpointing.save_final` (the adapter, and with `lora.save_merged` the merged
model) on a local safetensors base, and `shardwise export` of a 70B-shaped adapter checkpoint
and of a merged one, with the host memory each takes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_export_sharded import ENV, umask_022

HERE = Path(__file__).parent
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
TOL = 1e-5
# tiny-llama's shape (the bundled tokenizer fits its 2048 rows), untied
TINY = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 256, "tie_word_embeddings": False}


def tiny_base(root: Path) -> Path:
    """A local Llama as a hub download looks: safetensors shards with an index, the tokenizer beside."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.data import default_tokenizer_path, tokenizer_files

    out = root / "base"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(out, max_shard_size="200KB")
    for f in tokenizer_files(default_tokenizer_path()):
        shutil.copy2(f, out / f.name)
    assert (out / "model.safetensors.index.json").is_file()
    return out


def train(root: Path, base: Path, strategy: str, merged: bool) -> Path:
    """The issue's YAML at toy scale (fp32, a checkpoint at the last step for the reference)."""
    import yaml

    out = root / f"run-{strategy}"
    cfg = {"model": {"path": str(base)}, "data": {"kind": "sft", "sft": {"max_length": 64, "packing": True}},
           "strategy": {"name": strategy}, "optimizer": {"lr": 1.0e-2, "weight_decay": 0.0}, "precision": "fp32",
           "run": {"steps": 2, "micro_batch": 1, "grad_accum": 1, "nproc": 2, "device": "cpu"},
           "lora": LORA | {"save_merged": merged},
           "checkpointing": {"output_dir": str(out), "save_final": True, "save_every_steps": 2,
                             "save_every_minutes": None},
           "logging": {"progress": False}}
    path = root / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(path)], capture_output=True, text=True,
                       timeout=400, env=ENV, check=False, preexec_fn=umask_022)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-final")
    base = tiny_base(root)
    return base, {"fsdp": train(root, base, "fsdp", merged=True), "zero3": train(root, base, "zero3", merged=False)}


def reference_logits(base: Path, run: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, trained) logits in fp32: the base from its files with the run's adapters injected by
    PEFT and filled from the last checkpoint's tensors (every adapter, nothing else)."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
    from shardwise.train.checkpoint.sharded import read_tensors, tensor_shapes

    ckpt = checkpoints_dir(run) / step_dir_name(2)
    keys = [k for k in tensor_shapes(ckpt) if k.startswith("model.")]
    adapters = {k.removeprefix("model."): v for k, v in read_tensors(ckpt, keys).items()}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = model(ids).logits
    cfg = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"])
    model = inject_adapter_in_model(cfg, model, adapter_name="default")
    lora = {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert set(adapters) == lora and lora
    model.load_state_dict(adapters, strict=False)
    with torch.no_grad():
        return plain, model(ids).logits


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_two_rank_lora_run_exports_an_adapter_and_merged_model_equal_to_its_checkpoint(runs, strategy):
    """The run exits 0 with its export (the base is never rebuilt, so no rank reads it alone in a
    collective); the adapter loads with PeftModel.from_pretrained on the base, the merged model
    with AutoModelForCausalLM.from_pretrained, and both give the trained checkpoint's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, run = runs[0], runs[1][strategy]
    adapter = run / "model"
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                   "tokenizer.json"}
    assert not (adapter / "model.safetensors").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == str(base.resolve())
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    plain, want = reference_logits(base, run, ids)
    assert float((want - plain).abs().max()) > 1e-3  # the adapters changed the model: not base vs base
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(ids).logits, want, rtol=TOL, atol=TOL)
    merged_dir = run / "model-merged"
    assert merged_dir.is_dir() == (strategy == "fsdp")  # lora.save_merged on the fsdp run only
    if merged_dir.is_dir():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        assert not any("lora_" in n or "base_layer" in n for n in merged.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, want, rtol=TOL, atol=TOL)


# `shardwise export` run in this process (its typer app, as the console script runs it) with the
# host memory measured: the resident set once everything the export imports is loaded, and the
# peak after (VmHWM, reset to the current RSS first: /proc/PID/clear_refs 5).
MEASURE_EXPORT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import huggingface_hub.serialization, peft, safetensors.torch, torch, torch.distributed.checkpoint
    import transformers.models.llama.modeling_llama, transformers.models.auto.modeling_auto
    import shardwise.train.checkpoint.sharded, shardwise.train.export.hf_dir, shardwise.train.export.cli, shardwise.train.outputs
    from peft.tuners.lora import LoraModel

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS")
    sys.argv = ["shardwise export", *sys.argv[1:]]
    try:
        shardwise.train.export.cli.main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    print(json.dumps({"baseline": base, "peak": status("VmHWM"), "code": code}))
    """)


def measured_export(ckpt: Path, out: Path, *flags: str) -> dict:
    r = subprocess.run([sys.executable, "-c", MEASURE_EXPORT, str(ckpt), str(out), *flags], capture_output=True,
                       text=True, timeout=600, env=ENV, check=False, preexec_fn=umask_022)
    assert r.returncode == 0, r.stderr[-3000:]
    mem = json.loads(r.stdout.strip().splitlines()[-1])
    assert mem["code"] == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return mem


def lora_checkpoint(root: Path, model: dict, lora: dict, shapes: dict | None = None, **extra) -> Path:
    """A LoRA checkpoint as a run writes it (`model.<adapter>` tensors, random), written directly
    with `save_checkpoint`: `shapes`, or the adapters the config's model takes (from the meta device)."""
    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec
    from shardwise.train.checkpoint.sharded import TrainerState, save_checkpoint
    from shardwise.train.model.build import trainable_shapes

    cfg = TrainConfig.model_validate({"model": model, "data": {"kind": "synthetic"}, "precision": "bf16-mixed",
                                      "lora": lora, **extra})
    shapes = shapes or trainable_shapes(run_spec(cfg, 1, "cpu", environ={}))

    class Stand:  # the engine's checkpoint_state, as tests/train/fault_workers/slow_save.py's
        def checkpoint_state(self):
            g = torch.Generator().manual_seed(0)
            return {f"model.{k}": torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}, {}

    return save_checkpoint(Stand(), TrainerState(step=1, samples_consumed=1, global_batch=1), root / "run",
                           config=cfg.model_dump(mode="json"), strategy="ddp", keep_last=1)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads VmRSS/VmHWM from /proc")
def test_adapter_export_of_a_70b_lora_checkpoint_allocates_no_base_tensor(tmp_path):
    """Llama-2-70B (280 GB of fp32 base, catalog `llama-2-70b`), rank-4 adapters on q_proj and
    v_proj (real tensors, ~33 MB): `shardwise export` writes PEFT's adapter while its resident set
    grows by less than 256 MiB, less than one MLP weight of the base (28672 x 8192 fp32: 940 MB)."""
    from safetensors import safe_open

    hidden, kv, r = 8192, 8 * 128, 4  # Llama-2-70B: hidden 8192, 8 KV heads of 128
    shapes = {}
    for i in range(80):
        for proj, out_features in (("q_proj", hidden), ("v_proj", kv)):
            stem = f"model.layers.{i}.self_attn.{proj}"
            shapes |= {f"{stem}.lora_A.default.weight": (r, hidden), f"{stem}.lora_B.default.weight": (out_features, r)}
    ckpt = lora_checkpoint(tmp_path, {"name": "llama-2-70b"}, {"rank": r, "target_modules": ["q_proj", "v_proj"]},
                           shapes)
    out = tmp_path / "adapter"
    mem = measured_export(ckpt, out)
    growth = mem["peak"] - mem["baseline"]
    print(f"\n70B adapter export: baseline {mem['baseline'] / 1e6:.0f} MB, growth {growth / 1e6:.0f} MB")
    assert growth < 256 * 2**20, growth
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as h:
        shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
    assert len(shapes) == 80 * 2 * 2
    assert shapes["base_model.model.model.layers.79.self_attn.q_proj.lora_A.weight"] == (4, 8192)
    assert shapes["base_model.model.model.layers.79.self_attn.v_proj.lora_B.weight"] == (1024, 4)  # 8 KV heads
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads VmRSS/VmHWM from /proc")
def test_merged_export_streams_the_base_shard_by_shard(request, tmp_path):
    """The 134M Llama of tests/train/big_checkpoint.py (bf16 shards of 500 MB, cached), its
    all-linear adapters merged by `shardwise export --merged` into 20 MB bf16 shards: host growth
    at most two shards + the largest tensor in fp32 + 256 MiB, under the base's fp32 size; and the
    merged weights are W + alpha/r * B @ A of the files' weights (spot-checked)."""
    from big_checkpoint import make_checkpoint
    from safetensors import safe_open

    from shardwise.train.checkpoint.sharded import read_tensors

    base = make_checkpoint(Path(request.config.cache.mkdir("shardwise-checkpoints")), "llama-134m")
    shard = 20 * 10**6
    ckpt = lora_checkpoint(tmp_path, {"path": str(base)}, {"rank": 8, "alpha": 32, "target_modules": "all-linear"},
                           export={"max_shard_size": "20MB"})
    out = tmp_path / "merged"
    mem = measured_export(ckpt, out, "--merged")
    growth = mem["peak"] - mem["baseline"]
    index = json.loads((base / "model.safetensors.index.json").read_text())
    numels = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(base / f), "pt") as h:
            numels |= {k: torch.Size(h.get_slice(k).get_shape()).numel() for k in h.keys()}
    largest, fp32_model = 4 * max(numels.values()), 4 * sum(numels.values())
    print(f"\nmerged export: growth {growth / 1e6:.0f} MB; 2 shards + largest fp32 + 256 MiB = "
          f"{(2 * shard + largest + 2**28) / 1e6:.0f} MB; fp32 base {fp32_model / 1e6:.0f} MB")
    assert growth <= 2 * shard + largest + 2**28, growth
    assert growth < fp32_model, (growth, fp32_model)
    written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert written.keys() == index["weight_map"].keys() and len(set(written.values())) >= 10
    key = "model.layers.5.mlp.down_proj"
    lora = read_tensors(ckpt, [f"model.{key}.lora_{x}.default.weight" for x in "AB"])
    a, b = (lora[f"model.{key}.lora_{x}.default.weight"] for x in "AB")
    with safe_open(str(base / index["weight_map"][f"{key}.weight"]), "pt") as h:
        w = h.get_tensor(f"{key}.weight").float()
    with safe_open(str(out / written[f"{key}.weight"]), "pt") as h:
        got = h.get_tensor(f"{key}.weight")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), w + (32 / 8) * (b @ a), rtol=2**-8, atol=1e-6)  # bf16's rounding
    assert float((b @ a).abs().max()) > 1e-3  # the merge moved the weight


def test_qlora_checkpoint_merges_into_the_full_precision_base(tmp_path):
    """`shardwise export --merged` of a QLoRA (nf4) checkpoint: the base's own fp32 weights from its
    files plus alpha/r * B @ A (never the 4-bit values), every other tensor the file's, exactly."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from shardwise.train.checkpoint.sharded import read_tensors, tensor_shapes
    from shardwise.train.export.cli import app

    base = tiny_base(tmp_path)
    ckpt = lora_checkpoint(tmp_path, {"path": str(base)}, LORA | {"quantization": "nf4"})
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, [str(ckpt), str(out), "--merged", "--set", "export.dtype=fp32"])  # in-process
    assert res.exit_code == 0, res.output
    got = load_file(str(out / "model.safetensors"))
    want = {}
    for f in base.glob("*.safetensors"):
        want |= load_file(str(f))
    assert got.keys() == want.keys()
    keys = [k for k in tensor_shapes(ckpt) if k.startswith("model.")]
    lora = {k.removeprefix("model."): v for k, v in read_tensors(ckpt, keys).items()}
    merged = 0
    for k, w in want.items():
        stem = k.removesuffix(".weight")
        if f"{stem}.lora_A.default.weight" in lora:
            a, b = lora[f"{stem}.lora_A.default.weight"], lora[f"{stem}.lora_B.default.weight"]
            torch.testing.assert_close(got[k], w + (LORA["alpha"] / LORA["rank"]) * (b @ a), rtol=1e-6, atol=1e-7)
            merged += 1
        else:
            assert torch.equal(got[k], w), k
    assert merged == 2 * TINY["num_hidden_layers"]
