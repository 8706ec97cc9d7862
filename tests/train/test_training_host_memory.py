"""Host memory while LoRA trains under FSDP2, through `python -m shardwise.train.cli` on 2 CPU ranks:
once the weights are in, each rank holds its bf16 shard of the frozen base, and a step adds what
FSDP2 gathers and the activations, never a copy of the model.

The checkpoint (tests/train/big_checkpoint.py `llama-8x1024`, built once into pytest's cache) has
its parameters in the decoder layers, each weight 2-6 MiB in bf16: under glibc's dynamic mmap
threshold (up to 32 MiB) every layer FSDP2 gathered and freed left a hole in the heap that the
activations saved for backward split, and each rank grew by most of the unsharded model in its
first forward (measured on this checkpoint, the step's peak over the RSS after the load: +300 to
+380 MiB per rank; with shardwise.train.launch.host_alloc holding the threshold at 1 MiB: +135 MiB,
against the bound of 207 MiB below).

The ranks run with benchmarks/host_memory_probe first on PYTHONPATH, which only reads: each
rank's /proc/self/status once the weights are in (the load's peak, then reset) and after each
step (the training's peak). One run (~30 s) serves every assertion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from big_checkpoint import as_downloaded, make_checkpoint  # noqa: E402

RANKS, SEQ, MIB = 2, 64, 2**20
BF16 = 2


def _shapes(ckpt: Path) -> dict[str, int]:
    """Elements of the whole Llama, of one decoder layer and of the root group FSDP2 keeps
    gathered from forward to backward (embeddings, final norm, lm_head), from its config.json."""
    c = json.loads((ckpt / "config.json").read_text())
    h, f, n_layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    layer = 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two norms (kv heads = heads)
    root = 2 * v * h + h
    return {"params": n_layers * layer + root, "layer": layer, "root": root, "layers": n_layers,
            "hidden": h, "mlp": f}


@pytest.fixture(scope="module")
def run(request, tmp_path_factory) -> dict:
    """One 2-rank FSDP2 LoRA run (bf16-mixed, seq 64, 1 step) of the CLI; its per-rank phases."""
    ckpt = make_checkpoint(Path(request.config.cache.mkdir("shardwise-checkpoints")), "llama-8x1024")
    tmp = tmp_path_factory.mktemp("host-memory")
    model = as_downloaded(ckpt, tmp / "model")
    cfg = tmp / "lora.yaml"
    cfg.write_text(f"""model: {{path: {model}}}
data: {{kind: sft, sft: {{max_length: {SEQ}, packing: true}}}}
strategy: {{name: fsdp}}
optimizer: {{lr: 1.0e-4, weight_decay: 0.0}}
precision: bf16-mixed
run: {{steps: 1, micro_batch: 1, grad_accum: 1, nproc: {RANKS}, device: cpu}}
lora: {{rank: 8, alpha: 16, target_modules: [q_proj, v_proj]}}
checkpointing: {{output_dir: {tmp / 'out'}, save_final: false}}
logging: {{progress: false}}
""")
    phases = tmp / "phases"
    phases.mkdir()
    env = dict(os.environ, SHARDWISE_HOST_PHASES_DIR=str(phases), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "host_memory_probe"), str(ROOT / "src"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(cfg)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = {}
    for r in range(RANKS):
        rows = [json.loads(line) for line in (phases / f"rank{r}.jsonl").read_text().splitlines()]
        ranks[r] = {row["phase"]: row for row in rows} | {"last": rows[-1]}
    return {"ranks": ranks, "shapes": _shapes(ckpt), "metrics": (tmp / "out" / "metrics.jsonl").read_text()}


def test_each_rank_holds_its_bf16_shard_of_the_base_after_the_load(run):
    """RSS once the engine loaded the weights, over RSS once the (meta) model was built: the rank's
    half of the base in bf16 (+32 MiB for RoPE buffers and DCP's bookkeeping), not an fp32 or
    unsharded copy (each would at least double it)."""
    s = run["shapes"]
    shard = BF16 * s["params"] / RANKS
    for r, ph in run["ranks"].items():
        held = ph["loaded"]["VmRSS"] - ph["built"]["VmRSS"]
        assert held <= shard + 32 * MIB, (r, held / MIB, shard / MIB)


def test_a_step_adds_what_fsdp2_gathers_and_the_activations_only(run):
    """The training's peak RSS over the RSS after the load is at most: the root group gathered in
    bf16 while FSDP2 all-gathers it (its input shard, the flat output and the unsharded copy:
    (1/n + 2) x), three decoder layers gathered in bf16 (in flight, prefetched, being freed), the
    activations a Llama layer saves for backward (s·(34h + 6f) bytes in bf16, Korthikanti et al.'s
    34·s·h with a SwiGLU MLP, no attention scores under SDPA), and 96 MiB for the libraries' own
    (autograd, gloo, the data). A gradient for the frozen base (at least its bf16 shard) or a
    layer's worth of heap left per layer does not fit."""
    s = run["shapes"]
    gathered = BF16 * s["root"] * (1 / RANKS + 2) + 3 * BF16 * s["layer"]
    activations = s["layers"] * SEQ * (34 * s["hidden"] + 6 * s["mlp"])
    bound = gathered + activations + 96 * MIB
    for r, ph in run["ranks"].items():
        grown = ph["last"]["VmHWM"] - ph["loaded"]["VmRSS"]
        assert grown <= bound, (r, grown / MIB, bound / MIB)
    loss = [json.loads(line)["loss"] for line in run["metrics"].splitlines() if '"loss"' in line]
    assert loss and all(x == x and abs(x) < 1e3 for x in loss), loss


def test_the_threshold_is_set_once_and_restored_by_the_outermost_context(monkeypatch):
    """The load's context nests inside the run's: only the outermost one sets glibc's threshold
    and sets it back, so the load's exit does not end the run's setting."""
    from shardwise.train.launch import host_alloc

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(host_alloc, "_mallopt", lambda: lambda param, value: calls.append((param, value)))
    with host_alloc.large_allocations_returned():
        with host_alloc.large_allocations_returned():
            pass
        assert calls == [(-3, 1 << 20)]  # M_MMAP_THRESHOLD (glibc malloc.h), 1 MiB
    assert calls == [(-3, 1 << 20), (-3, 32 << 20)]
