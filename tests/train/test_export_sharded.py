"""Export at scale: sharded safetensors with Hugging Face's index, in the run's
compute dtype, written one shard at a time with bounded host memory, config.json naming the
architecture and the dtype; every file 0644."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardwise.errors import ShardwiseError

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
GIB = 2**30


def umask_022() -> None:
    os.umask(0o022)


def export(ckpt: Path, out: Path, *sets: str, timeout: int = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.train.export.cli", str(ckpt), str(out)]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV, check=False,
                          preexec_fn=umask_022)


def ckpt_model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from shardwise.train.checkpoint.sharded import read_tensors, tensor_shapes

    keys = [k for k in tensor_shapes(ckpt) if k.startswith("model.")]
    return {k.removeprefix("model."): v for k, v in read_tensors(ckpt, keys).items()}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> Path:
    """A real 2-rank FSDP2 run in bf16-mixed, checkpointed at step 2 (fp32 master weights)."""
    out = tmp_path_factory.mktemp("bf16-run")
    argv = [sys.executable, "-m", "shardwise.train.cli", str(REPO / "examples" / "fsdp-synthetic-cpu.yaml"),
            "--nproc", "2"]
    for s in (f"checkpointing.output_dir={out}", "run.steps=2", "checkpointing.save_every_steps=2",
              "checkpointing.save_every_minutes=null", "logging.progress=false", "precision=bf16-mixed"):
        argv += ["--set", s]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=ENV, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name

    ckpt = checkpoints_dir(out) / step_dir_name(2)
    assert (ckpt / "manifest.json").is_file()
    return ckpt


def shard_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.safetensors"))


def check_loads_exactly(out: Path, ckpt: Path, dtype: torch.dtype, hf_name: str) -> dict:
    """from_pretrained(out) holds the checkpoint's fp32 master weights cast to `dtype`, bit for bit."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]  # tiny-qwen is a qwen2
    assert cfg["dtype"] == hf_name and cfg["torch_dtype"] == hf_name
    master = ckpt_model_weights(ckpt)
    assert all(v.dtype == torch.float32 for v in master.values())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    state = model.state_dict()
    # tiny-qwen ties lm_head to the embeddings: the file holds the one name, the model both
    expected = {k: v.to(dtype) for k, v in master.items()}
    expected.setdefault("lm_head.weight", expected["model.embed_tokens.weight"])
    assert state.keys() == expected.keys()
    for k, v in expected.items():
        assert state[k].dtype == dtype, k
        assert torch.equal(state[k], v), k
    # and the files themselves: each name once, in the export dtype
    from safetensors.torch import load_file

    stored = {}
    for f in shard_files(out):
        part = load_file(str(out / f))
        assert not stored.keys() & part.keys()
        stored |= part
    assert stored.keys() == master.keys() - {"lm_head.weight"}
    assert all(v.dtype == dtype for v in stored.values())
    return stored


def test_two_rank_bf16_checkpoint_exports_sharded_bf16_that_loads_exactly(bf16_run, tmp_path):
    out = tmp_path / "hf"
    r = export(bf16_run, out, "export.max_shard_size=100KB")
    assert r.returncode == 0, r.stderr[-3000:]
    files = shard_files(out)
    n = len(files)
    assert n >= 3, files
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert set(index["weight_map"].values()) == set(files)
    stored = check_loads_exactly(out, bf16_run, torch.bfloat16, "bfloat16")
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in stored.values())
    for name, f in index["weight_map"].items():  # the index says where each tensor is
        from safetensors import safe_open

        with safe_open(str(out / f), "pt") as h:
            assert name in h.keys()
    # every shard but a single oversized tensor's is within the limit (the header aside)
    for f in files:
        from safetensors import safe_open

        with safe_open(str(out / f), "pt") as h:
            sizes = [h.get_slice(k).get_shape() for k in h.keys()]
        data = sum(2 * int(torch.Size(s).numel()) for s in sizes)
        assert data <= 100_000 or len(sizes) == 1, (f, data)
    # every file 0644 (umask 022), the index too
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.rglob("*") if p.is_file()}
    assert "model.safetensors.index.json" in modes
    assert modes == {k: oct(0o644) for k in modes}


def test_fp32_export_by_set_is_exact_and_fits_one_file(bf16_run, tmp_path):
    out = tmp_path / "hf32"
    r = export(bf16_run, out, "export.dtype=fp32")  # default max_shard_size 5GB: one file, no index
    assert r.returncode == 0, r.stderr[-3000:]
    assert shard_files(out) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    check_loads_exactly(out, bf16_run, torch.float32, "float32")
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644


def test_bad_max_shard_size_is_refused_naming_the_field(bf16_run, tmp_path):
    out = tmp_path / "bad"
    r = export(bf16_run, out, "export.max_shard_size=5XB")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = " ".join(r.stderr.split())
    assert "export.max_shard_size" in err and "'5XB'" in err and "5GB" in err
    assert not out.exists()
    # only export.* can change on a checkpoint
    r = export(bf16_run, out, "model.name=tiny-llama")
    assert r.returncode == 2 and "only export.*" in " ".join(r.stderr.split())
    assert not out.exists()


@pytest.mark.parametrize("value", ["5XB", "0", "-1GB", "1.5", "true", "nanGB", "GB"])
def test_bad_max_shard_size_in_a_train_config(tmp_path, value):
    from shardwise.config.load import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp32\n")
    with pytest.raises(ShardwiseError, match=r"export\.max_shard_size"):
        load_config(cfg, [f"export.max_shard_size={value}"])


@pytest.mark.parametrize(("value", "expected"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), (1234, 1234),
                                                 ("2.5GB", 2_500_000_000), ("64KB", 64_000)])
def test_max_shard_size_units(tmp_path, value, expected):
    from shardwise.config.schema import TrainConfig

    assert TrainConfig.model_validate({"export": {"max_shard_size": value}}).export.max_shard_bytes == expected


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16),
                                                  ("fp32", torch.float32)])
def test_auto_dtype_is_the_runs_compute_dtype(precision, dtype):
    from shardwise.config.schema import TrainConfig
    from shardwise.train.export.hf_dir import export_dtype

    assert export_dtype(TrainConfig.model_validate({"precision": precision})) == dtype
    assert export_dtype(TrainConfig.model_validate({"precision": precision, "export": {"dtype": "fp32"}})) \
        == torch.float32


def test_fp16_overflow_is_refused_and_nothing_written(tmp_path):
    """A finite fp32 weight beyond fp16's range would be inf in the file: refused like a NaN."""
    from shardwise.config.schema import TrainConfig
    from shardwise.errors import NonFiniteError
    from shardwise.train.export.hf_dir import export_hf

    cfg = TrainConfig.model_validate({"model": {"name": "tiny-llama"}, "precision": "fp16-mixed",
                                      "data": {"kind": "synthetic"}})
    with pytest.raises(NonFiniteError, match="float16"):
        export_hf(cfg, {"model.embed_tokens.weight": torch.full((4, 4), 1e6)}, tmp_path / "m")
    assert not (tmp_path / "m").exists() and not list(tmp_path.iterdir())


def test_a_long_export_reports_progress_per_read_group_and_shard(tmp_path):
    """The end of a run passes the watchdog's heartbeat as `progress`: called as each read group
    is fetched and each shard is written, never only once, so an export longer than run.timeout_s
    is not taken for a hang. Four 16 KB fp32 tensors in 40 KB bf16 shards: 2 files, 2 groups each."""
    from shardwise.config.schema import TrainConfig
    from shardwise.train.export.hf_dir import write_hf

    cfg = TrainConfig.model_validate({"model": {"name": "tiny-llama"}, "precision": "bf16-mixed",
                                      "data": {"kind": "synthetic"}, "export": {"max_shard_size": "20KB"}})
    tensors = {f"t{i}": torch.ones(64, 64) for i in range(4)}  # 8 KB each in bf16, 16 KB read in fp32
    events: list[str] = []

    def read(names):
        events.append("read")
        return {k: tensors[k] for k in names}

    write_hf(cfg, {k: ((64, 64), torch.float32) for k in tensors}, read, tmp_path / "m",
             progress=lambda: events.append("progress"))
    assert shard_files(tmp_path / "m") == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert events == ["read", "progress", "read", "progress", "progress"] * 2


# --- bounded host memory ---------------------------------------------------------------------

BIG = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
       "num_key_value_heads": 16, "intermediate_size": 4096, "vocab_size": 8000, "max_position_embeddings": 512,
       "tie_word_embeddings": False}
SHARD = "50MB"

MEASURE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import huggingface_hub.serialization, safetensors.torch, torch, torch.distributed.checkpoint
    import transformers.models.auto.modeling_auto
    import shardwise.train.checkpoint.sharded, shardwise.train.export.hf_dir, shardwise.train.outputs

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    base = status("VmRSS")
    shardwise.train.export.hf_dir.export_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]),
                                             overrides=("export.max_shard_size=%s",))
    print(json.dumps({"baseline": base, "peak": status("VmHWM")}))
    """ % SHARD)  # noqa: UP031 (the script's own braces would need doubling under str.format)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmRSS/VmHWM from /proc")
def test_export_host_memory_is_about_one_shard_not_the_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.config.schema import TrainConfig
    from shardwise.train.checkpoint.sharded import TrainerState, save_checkpoint

    model_dir = tmp_path / "base"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(BIG))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(**BIG))
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    fp32_bytes = 4 * sum(int(torch.Size(s).numel()) for s in shapes.values())
    assert fp32_bytes > 800 * 10**6  # several hundred MB of master weights

    class Stand:  # the engine's checkpoint_state, as tests/train/fault_workers/slow_save.py's
        def checkpoint_state(self):
            g = torch.Generator().manual_seed(0)
            return {f"model.{k}": torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}, {}

    cfg = TrainConfig.model_validate({"model": {"path": str(model_dir), "random_init": True},
                                      "data": {"kind": "synthetic"}, "precision": "bf16-mixed"})
    ckpt = save_checkpoint(Stand(), TrainerState(step=1, samples_consumed=1, global_batch=1), tmp_path / "run",
                           config=cfg.model_dump(mode="json"), strategy="ddp", keep_last=1)
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-c", MEASURE, str(ckpt), str(out)], capture_output=True, text=True,
                       timeout=600, env=ENV, check=False, preexec_fn=umask_022)
    assert r.returncode == 0, r.stderr[-3000:]
    mem = json.loads(r.stdout.strip().splitlines()[-1])
    growth = mem["peak"] - mem["baseline"]
    files = shard_files(out)
    largest = max((out / f).stat().st_size for f in files)
    print(f"\nfp32 model {fp32_bytes / 1e6:.0f} MB, {len(files)} bf16 shards (largest {largest / 1e6:.1f} MB), "
          f"export peak RSS {mem['peak'] / 1e6:.0f} MB, baseline {mem['baseline'] / 1e6:.0f} MB, "
          f"growth {growth / 1e6:.0f} MB")
    assert len(files) >= 8
    assert growth <= largest + GIB
    assert growth < fp32_bytes / 4, (growth, fp32_bytes)  # far from a full fp32 (or even bf16) copy
    # the export is the checkpoint in bf16, exactly (spot-check: the first, a middle and the last tensor)
    from safetensors import safe_open

    from shardwise.train.checkpoint.sharded import read_tensors

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == shapes.keys()
    names = list(shapes)
    for name in (names[0], names[len(names) // 2], names[-1]):
        with safe_open(str(out / index["weight_map"][name]), "pt") as h:
            got = h.get_tensor(name)
        want = read_tensors(ckpt, [f"model.{name}"])[f"model.{name}"].to(torch.bfloat16)
        assert torch.equal(got, want), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
