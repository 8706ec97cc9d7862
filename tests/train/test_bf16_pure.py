"""`precision: bf16-pure`: parameters, gradients and AdamW states all bf16, no fp32 master copy, no
autocast (torchtune's `dtype: bf16`), run through `shardwise train` on CPU ranks.

- 8 steps (FSDP2 on 2 ranks; 1 rank, where the one-rank shard group runs as DDP) train as
  bf16-mixed does: every loss and gradient norm finite, each step's loss within LOSS_TOLERANCE
  of bf16-mixed's. Measured on this config (tiny-qwen, lr 1e-3, accumulation 2, clipping 1.0):
  at most 2.4e-4 apart on 2 ranks and 1.9e-4 on 1 rank, on losses near 7.64 (3e-5 relative).
  The two runs start from the same bf16 values (FSDP2 casts the fp32 masters to bf16 for the
  forward; bf16-pure rounds them once: step 1's losses are equal on 2 ranks), then differ by
  how updates land: bf16-pure rounds each update into the bf16 weight (one below half a bf16
  step, about 1/256 of the weight, is lost), bf16-mixed accumulates it in fp32. On one rank
  bf16-mixed also autocasts over an fp32 residual stream, which bf16-pure keeps in bf16.
  LOSS_TOLERANCE is about 8x the measured gap: a lost update, or bf16 moments gone wrong, moves
  these losses by more.
- The end-of-run export (`export.dtype: auto`) and `shardwise export` write bf16: the
  checkpoint's own values, bit for bit.
- A census on 2 gloo ranks (tests/train/bf16_pure_worker.py): every parameter, gradient and AdamW
  state of the engine is bf16 on every rank (FSDP2, DDP, LoRA adapters too); the bytes of
  params + grads + optimizer states, bf16-mixed minus bf16-pure, within 10% of the plan's
  (shardwise.plan.evaluate.memory_as_run). Measured equal to the plan on both ranks: FSDP2
  saves 5,263,872 bytes per rank, DDP 10,527,744 (8 of bf16-mixed's 16 bytes per parameter of
  the 1,315,968-parameter bench model, sharded over 2 ranks or replicated). LoRA is checked for dtypes only: the plan books LoRA adapters and their gradients
  in fp32 whatever the precision (plan/memory_lora.py), bf16-pure trains them in bf16.
- A run resumed from its step-4 checkpoint ends with the same losses and the same checkpoint,
  bit for bit. Across precisions the checkpoint's tensors are cast as they load: a bf16-mixed
  checkpoint resumed with bf16-pure computes step 5 exactly as bf16-mixed does (the rounded
  masters are the bf16 weights its forward used), and a bf16-pure one resumed with bf16-mixed
  exactly as bf16-pure does (bf16 widens to fp32 exactly); each says so before any rank starts.
- `optimizer.in_backward` with bf16-pure (torchtune's single-GPU 8B recipe): one short run,
  finite losses and norms, a bf16 checkpoint.
- Refused before any rank starts, naming the field: every DeepSpeed strategy (its bf16 keeps
  fp32 master weights), and an explicit `strategy.fsdp.reduce_dtype: fp32` (mixed precision's).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.errors import ShardwiseError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"
LOSS_TOLERANCE = 2e-3  # absolute, on losses near 7.64 (see the module docstring)
DEEPSPEED = ["zero0", "zero1", "zero2", "zero3", "zero1+opt-offload", "zero2+opt-offload", "zero3+opt-offload",
             "zero3+full-offload"]


def train(out: Path, *extra: str, steps: int = 8) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--set", f"run.steps={steps}",
            "--set", "checkpointing.save_final=false", "--set", "logging.progress=false",
            "--set", f"checkpointing.output_dir={out}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def steps(out: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


def checkpoint(d: Path) -> dict[str, torch.Tensor]:
    from shardwise.train.checkpoint.sharded import read_tensors

    return read_tensors(d)


def step_dir(out: Path, step: int) -> Path:
    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name

    return checkpoints_dir(out) / step_dir_name(step)


# Both precisions, 8 steps on 2 ranks, saving at steps 4 and 8 (bf16-pure also exports its final
# weights): what the loss comparison, the export, the resume and the cross-precision tests read.
SAVE_AT_4 = ["--set", "checkpointing.save_every_steps=4", "--set", "checkpointing.keep_last=4"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("two_ranks")
    export = {"bf16-pure": ["--set", "checkpointing.save_final=true"], "bf16-mixed": []}
    for precision in ("bf16-mixed", "bf16-pure"):
        ok(train(root / precision, "--set", f"precision={precision}", *SAVE_AT_4, *export[precision]))
    return {p: root / p for p in ("bf16-mixed", "bf16-pure")}


def close_to_mixed(mixed: dict[int, tuple[float, float]], pure: dict[int, tuple[float, float]]) -> None:
    assert sorted(mixed) == sorted(pure) == list(range(1, 9))
    for s in pure:
        assert all(math.isfinite(v) for v in pure[s]) and pure[s][1] > 0, (s, pure[s])
        assert abs(pure[s][0] - mixed[s][0]) <= LOSS_TOLERANCE, (s, pure[s], mixed[s])


def test_it_trains_as_bf16_mixed_does_on_two_ranks(two_ranks) -> None:
    close_to_mixed(steps(two_ranks["bf16-mixed"]), steps(two_ranks["bf16-pure"]))
    saved = checkpoint(step_dir(two_ranks["bf16-pure"], 8))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}  # weights and AdamW moments
    assert {t.dtype for t in checkpoint(step_dir(two_ranks["bf16-mixed"], 8)).values()} == {torch.float32}


def test_it_trains_as_bf16_mixed_does_on_one_rank(tmp_path) -> None:
    for precision in ("bf16-mixed", "bf16-pure"):
        ok(train(tmp_path / precision, "--nproc", "1", "--set", f"precision={precision}"))
    close_to_mixed(steps(tmp_path / "bf16-mixed"), steps(tmp_path / "bf16-pure"))
    assert {t.dtype for t in checkpoint(step_dir(tmp_path / "bf16-pure", 8)).values()} == {torch.bfloat16}


def test_the_export_is_the_checkpoints_bf16_weights(two_ranks, tmp_path) -> None:
    """export.dtype auto: bf16, the checkpoint's own values bit for bit; `shardwise export` alike."""
    from safetensors.torch import load_file

    from shardwise.train.export.hf_dir import export_checkpoint

    saved = checkpoint(step_dir(two_ranks["bf16-pure"], 8))
    weights = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    again = export_checkpoint(step_dir(two_ranks["bf16-pure"], 8), tmp_path / "again")
    for d in (two_ranks["bf16-pure"] / "model", again):
        exported = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        assert weights.keys() <= exported.keys()
        assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v) for k, v in weights.items())
        assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"


def test_census_every_tensor_is_bf16_and_the_bytes_are_the_plans() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import bf16_pure_worker

    from shardwise.bench import worker
    from shardwise.plan.evaluate import memory_as_run
    from shardwise.run import run_spec

    cases = [f"{v}:{p}" for v in ("fsdp", "ddp") for p in ("bf16-mixed", "bf16-pure")] + ["fsdp-lora:bf16-pure"]
    measured = worker.spawn_ranks(bf16_pure_worker.rank_main, cases, timeout_s=300)
    assert sorted(measured) == sorted(cases), measured.keys()
    for rank in range(worker.WORLD):
        for case in cases:
            got = measured[case][rank]
            assert got["engine"] == ("ddp" if case.startswith("ddp") else "fsdp2"), (case, got)
            want = ["bfloat16"] if case.endswith("bf16-pure") else ["float32"]
            for part in ("trained", "grads", "optimizer_states"):  # a LoRA run's adapters, their grads and states
                assert got[part]["dtypes"] == want, (case, rank, part, got)
            if case.endswith("bf16-pure"):
                assert got["params"]["dtypes"] == ["bfloat16"], (case, rank, got)  # a LoRA base too
    for variant in ("fsdp", "ddp"):

        def planned(precision: str, variant: str = variant) -> float:
            run = run_spec(worker.bench_config(variant).model_copy(update={"precision": precision}), worker.WORLD,
                           "cpu", environ={})
            gpu = memory_as_run(run.model, run.hardware, run.train, run.strategy).gpu
            return gpu.params + gpu.grads + gpu.optimizer_states

        plan_saves = planned("bf16-mixed") - planned("bf16-pure")
        for rank in range(worker.WORLD):
            held = {p: sum(measured[f"{variant}:{p}"][rank][k]["bytes"] for k in ("params", "grads", "optimizer_states"))
                    for p in ("bf16-mixed", "bf16-pure")}
            saves = held["bf16-mixed"] - held["bf16-pure"]
            assert saves > 0 and abs(saves - plan_saves) <= 0.10 * plan_saves, (variant, rank, saves, plan_saves)


def test_a_resumed_run_is_bit_exact(two_ranks, tmp_path) -> None:
    keep = ["--set", "precision=bf16-pure", *SAVE_AT_4]
    ok(train(tmp_path / "half", *keep, steps=4))
    ok(train(tmp_path / "half", *keep, "--resume", "latest"))
    whole, half = steps(two_ranks["bf16-pure"]), steps(tmp_path / "half")
    assert [whole[s] for s in range(5, 9)] == [half[s] for s in range(5, 9)]
    a, b = checkpoint(step_dir(two_ranks["bf16-pure"], 8)), checkpoint(step_dir(tmp_path / "half", 8))
    assert a.keys() == b.keys() and any(k.startswith("optim.exp_avg_sq.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_resuming_across_precisions_casts_the_checkpoint(two_ranks, tmp_path) -> None:
    """The other precision resumes each run's step-4 checkpoint and computes step 5's loss exactly
    as the uninterrupted run did."""
    for saved, resumed, says in (("bf16-mixed", "bf16-pure", "loads them rounded to bf16"),
                                 ("bf16-pure", "bf16-mixed", "loads them widened to fp32 (exactly)")):
        out = tmp_path / f"{saved}-then-{resumed}"
        r = ok(train(out, "--set", f"precision={resumed}", "--resume", str(step_dir(two_ranks[saved], 4)), steps=5))
        assert says in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
        assert steps(out)[5][0] == steps(two_ranks[saved])[5][0], (steps(out), steps(two_ranks[saved]))
        dtype = torch.bfloat16 if resumed == "bf16-pure" else torch.float32
        assert {t.dtype for t in checkpoint(step_dir(out, 5)).values()} == {dtype}


def test_the_step_in_backward_runs_with_it(tmp_path) -> None:
    """One short run (no clipping, no accumulation: the step in backward's contract)."""
    ok(train(tmp_path / "out", "--set", "precision=bf16-pure", "--set", "optimizer.in_backward=true",
             "--set", "run.grad_accum=1", "--set", "optimizer.max_grad_norm=0", steps=4))
    got = steps(tmp_path / "out")
    assert sorted(got) == [1, 2, 3, 4] and all(math.isfinite(v) and v > 0 for s in got for v in got[s]), got
    assert {t.dtype for t in checkpoint(step_dir(tmp_path / "out", 4)).values()} == {torch.bfloat16}


def _run(**changes):
    from shardwise.config.load import load_config
    from shardwise.run import run_spec

    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in ({"precision": "bf16-pure"} | changes).items()])
    return run_spec(cfg, 2, "cpu")


@pytest.mark.parametrize("name", DEEPSPEED)
def test_deepspeed_is_refused_naming_the_field(name) -> None:
    from shardwise.train.preflight import check_precision

    says = (r"precision 'bf16-pure' keeps no fp32 copy of the weights, but DeepSpeed's bf16 keeps fp32 master weights"
            rf".*\(strategy\.name '{re.escape(name)}'\); use precision bf16-mixed")
    with pytest.raises(ShardwiseError, match=says):
        check_precision(_run(**{"strategy.name": name}))
    check_precision(_run(**{"strategy.name": name, "precision": "bf16-mixed"}))  # bf16-mixed runs there


def test_an_fp32_reduce_is_refused_and_the_torch_strategies_run() -> None:
    from shardwise.train.preflight import check_precision

    with pytest.raises(ShardwiseError, match=r"strategy\.fsdp\.reduce_dtype 'fp32' is mixed precision's setting"):
        check_precision(_run(**{"strategy.fsdp.reduce_dtype": "fp32"}))
    for name in ("fsdp", "fsdp-grad-op", "fsdp-hybrid", "fsdp+offload", "ddp"):
        check_precision(_run(**{"strategy.name": name}))
    check_precision(_run(**{"strategy.fsdp.reduce_dtype": "param"}))


def test_refused_before_any_rank_starts(tmp_path) -> None:
    r = train(tmp_path / "out", "--set", "precision=bf16-pure", "--set", "strategy.name=zero3")
    assert r.returncode == 2 and f"{CONFIG}: precision 'bf16-pure' keeps no fp32 copy" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_plan_emits_it_where_the_trainer_runs_it() -> None:
    """The planner's bf16-pure becomes the config's on fsdp and ddp; on DeepSpeed the config says
    bf16-mixed with a note (the trainer refuses bf16-pure there)."""
    from shardwise.catalog import build_hardware, get_model
    from shardwise.run.bridge import to_config
    from shardwise.specs import Strategy, TrainSpec

    hw = build_hardware(gpus=8)
    for name in ("fsdp", "ddp"):
        cfg, notes = to_config(get_model("llama-2-7b"), hw, TrainSpec(precision="bf16-pure"), Strategy.from_name(name))
        assert cfg.precision == "bf16-pure" and not notes, notes
    cfg, notes = to_config(get_model("llama-2-7b"), hw, TrainSpec(precision="bf16-pure"), Strategy.from_name("zero2"))
    assert cfg.precision == "bf16-mixed" and len(notes) == 1 and "DeepSpeed's bf16 keeps fp32" in notes[0]

