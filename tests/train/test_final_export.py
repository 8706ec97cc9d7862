"""The end-of-run export (`checkpointing.save_final`) streams from disk
with bounded host memory: the last step's checkpoint, or the final weights staged for it by every
rank (shardwise.train.export.final_weights), written shard by shard on rank 0 as `shardwise export`
writes them; never the whole fp32 model gathered on one host."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_export_sharded import ENV, REPO, ckpt_model_weights, shard_files, umask_022


def train(out: Path, config: str, *sets: str, nproc: int = 2) -> None:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(REPO / "examples" / config), "--nproc", str(nproc)]
    for s in (f"checkpointing.output_dir={out}", "logging.progress=false", "checkpointing.save_final=true",
              "checkpointing.save_every_minutes=null", *sets):
        argv += ["--set", s]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=ENV, check=False, preexec_fn=umask_022)
    assert r.returncode == 0, r.stderr[-3000:]


def hf_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in shard_files(d):
        out |= load_file(str(d / f))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_staged_and_checkpointed_final_exports_are_the_same_files(tmp_path, strategy):
    """On 2 ranks, a run that saves no checkpoint (its final weights staged for the export, then
    removed) exports what the same run exports from its last step's checkpoint, and what
    `shardwise export` writes from that checkpoint, bit for bit (bf16, sharded)."""
    sets = ("run.steps=2", f"strategy.name={strategy}", "precision=bf16-mixed", "export.max_shard_size=100KB")
    staged, saved = tmp_path / "staged", tmp_path / "saved"
    train(staged, "fsdp-synthetic-cpu.yaml", *sets)
    train(saved, "fsdp-synthetic-cpu.yaml", *sets, "checkpointing.save_every_steps=2")
    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
    from shardwise.train.export.hf_dir import export_checkpoint

    assert not checkpoints_dir(staged).exists()  # the staged weights are gone, and the directory made for them
    again = export_checkpoint(checkpoints_dir(saved) / step_dir_name(2), tmp_path / "again")
    files = shard_files(staged / "model")
    assert len(files) >= 3 and files == shard_files(saved / "model") == shard_files(again)
    a, b, c = (hf_weights(d) for d in (staged / "model", saved / "model", again))
    assert a.keys() == b.keys() == c.keys()
    for k, v in a.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, b[k]) and torch.equal(v, c[k]), k
    index = json.loads((staged / "model" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)


RUN_MODEL = {"model_type": "llama", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 12, "intermediate_size": 3072, "vocab_size": 8000,
             "max_position_embeddings": 256, "tie_word_embeddings": False}
RUN_SHARD = 20 * 10**6  # export.max_shard_size

# `shardwise train --nproc 1` (the rank in-process) with both phases of the export measured: the
# staging (in the loop, the engine alive: `final_weights`) and the write (`export_final`, after the
# loop). Before each, the heap's free pages go back to the OS (glibc's malloc_trim: else the phase
# reuses what training freed, unseen) and the peak is reset: the growth is what the phase adds.
MEASURE_RUN = textwrap.dedent("""
    import ctypes, ctypes.util, json, sys
    from pathlib import Path
    import shardwise.train.export.hf_dir as export, shardwise.train.export.final_weights as final_weights

    libc = ctypes.CDLL(ctypes.util.find_library("c"))

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    mem, record = {}, Path(sys.argv[1])

    def measured(name, fn):
        def phase(*args, **kwargs):
            libc.malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            base = status("VmRSS")
            out = fn(*args, **kwargs)
            mem[name] = {"baseline": base, "peak": status("VmHWM")}
            mem["staged"] = mem.get("staged", getattr(out, "temporary", None))
            record.write_text(json.dumps(mem))
            return out
        return phase

    final_weights.final_weights = measured("stage", final_weights.final_weights)
    export.export_final = measured("write", export.export_final)
    sys.argv = ["shardwise-train", *sys.argv[2:]]
    from shardwise.train.cli import main
    main()
    """)


def _clear_refs_resets_the_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _clear_refs_resets_the_peak(), reason="resets VmHWM through /proc/self/clear_refs")
@pytest.mark.parametrize("final", ["staged", "checkpoint"])
def test_end_of_run_export_host_memory_is_about_one_shard_not_the_model(tmp_path, final):
    """`checkpointing.save_final` on rank 0 (one DDP rank: it holds the whole model, the worst case
    for a gather) exports from a DCP directory shard by shard: the last step's checkpoint, or the
    weights staged for the export when the run saves none (then removed)."""
    model_dir = tmp_path / "base"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(RUN_MODEL))
    out = tmp_path / "run"
    sets = [f"model.path={model_dir}", "model.random_init=true", "model.name=null", "strategy.name=ddp",
            "run.steps=1", "run.micro_batch=1", "run.grad_accum=1", "data.synthetic.seq_len=16",
            "precision=bf16-mixed", f"checkpointing.output_dir={out}", "checkpointing.save_final=true",
            f"export.max_shard_size={RUN_SHARD}", "logging.progress=false", "checkpointing.save_every_minutes=null"]
    if final == "checkpoint":
        sets.append("checkpointing.save_every_steps=1")
    argv = [str(REPO / "examples" / "fsdp-synthetic-cpu.yaml"), "--nproc", "1"]
    for s in sets:
        argv += ["--set", s]
    record = tmp_path / "mem.json"
    r = subprocess.run([sys.executable, "-c", MEASURE_RUN, str(record), *argv], capture_output=True, text=True,
                       timeout=600, env=ENV, check=False, preexec_fn=umask_022)
    assert r.returncode == 0, r.stderr[-3000:]
    mem = json.loads(record.read_text())
    assert mem["staged"] == (final == "staged")
    hf = out / "model"
    files = shard_files(hf)
    largest = max((hf / f).stat().st_size for f in files)
    fp32_bytes = 2 * sum((hf / f).stat().st_size for f in files)  # the files hold bf16
    growth = {k: mem[k]["peak"] - mem[k]["baseline"] for k in ("stage", "write")}
    from safetensors import safe_open

    numels = []
    for f in files:
        with safe_open(str(hf / f), "pt") as h:
            numels += [int(torch.Size(h.get_slice(k).get_shape()).numel()) for k in h.keys()]
    largest_tensor = 4 * max(numels)  # fp32, as the export reads it
    # what the write holds at most: a shard's cast copies and safetensors' bytes of them, and a read
    # group's fp32 tensors (half a shard, or one larger tensor) twice (DCP loads each item, then
    # copies it into ours), plus allocator slack (measured here: the write of 8 and of 12 layers
    # grows 124-136 MB in the process that trained, 85-95 MB in a fresh one)
    bound = 2 * largest + 2 * max(RUN_SHARD // 2, largest_tensor) + 96 * 2**20
    print(f"\n{final}: fp32 model {fp32_bytes / 1e6:.0f} MB, {len(files)} bf16 shards (largest "
          f"{largest / 1e6:.1f} MB, largest fp32 tensor {largest_tensor / 1e6:.1f} MB), peak RSS growth on "
          f"rank 0: staging {growth['stage'] / 1e6:.0f} MB, writing {growth['write'] / 1e6:.0f} MB "
          f"(bound {bound / 1e6:.0f} MB)")
    assert len(files) >= 8
    for g in growth.values():
        assert g <= bound, (growth, bound)
        assert g < fp32_bytes / 2, (growth, fp32_bytes)  # a gather on rank 0 holds the whole fp32 model
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the staged weights are gone
    # the export is the run's final fp32 master weights in bf16, exactly
    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name

    if final == "checkpoint":
        ckpt = checkpoints_dir(out) / step_dir_name(1)
        master, stored = ckpt_model_weights(ckpt), hf_weights(hf)
        assert stored.keys() == master.keys()
        assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in master.items())
    else:
        assert not (out / "checkpoints").exists()
