"""Low-bit AdamW states (`optimizer.name`: adamw8bit, adamw4bit, paged_adamw8bit), through
`shardwise train` (examples/fsdp-synthetic-cpu.yaml, tiny Qwen2, 8 steps):

- adamw8bit and adamw4bit train on 2 FSDP2 ranks and on 1 rank (the config's fsdp runs as ddp
  there) close to the fp32-state AdamW run: the losses within a stated tolerance;
- optimizer.in_backward steps the same low-bit AdamW per parameter: the same losses and the
  same checkpoint as the stock step;
- a run resumed from its step-4 checkpoint (2 ranks, 8-bit) ends with the same losses and the
  same checkpoint, every tensor bit-exact, codes and scales included; on another world size the
  states change form (fp32 <-> codes) and the run goes on;
- the bytes it saves, by a census of the engine's states (tests/train/low_bit_worker.py, the
  bench model on 2 FSDP2 ranks), are the plan's change of `optimizer_states` within 10%;
- refused before any rank starts, naming the field: DeepSpeed, tensor parallelism, paged
  states on CPU or FSDP2, torchao missing, a checkpoint of another optimizer.name.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from shardwise.errors import ShardwiseError
from shardwise.train.checkpoint.sharded import read_tensors

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "fsdp-synthetic-cpu.yaml"
QUIET = ["--set", "checkpointing.save_final=false", "--set", "logging.progress=false"]
SAVES = ["--set", "checkpointing.save_every_steps=4", "--set", "checkpointing.keep_last=4"]
# The 2-rank runs take the settings the step in backward needs (one micro-batch per step, no
# clipping), so one stock run is the reference of both the baseline comparison and the in-backward
# one; the 1-rank runs keep the example's clipping at 1.0 (which clips: asserted) and accumulation.
TWO = ["--set", "run.grad_accum=1", "--set", "optimizer.max_grad_norm=0"]
RUNS: dict[str, list[str]] = {
    "w2-adamw": [*TWO],
    "w2-adamw8bit": [*TWO, *SAVES, "--set", "optimizer.name=adamw8bit"],
    "w2-adamw4bit": [*TWO, "--set", "optimizer.name=adamw4bit"],
    "w2-adamw8bit-in-backward": [*TWO, "--set", "optimizer.name=adamw8bit", "--set", "optimizer.in_backward=true"],
    "w1-adamw": ["--nproc", "1"],
    "w1-adamw8bit": ["--nproc", "1", *SAVES, "--set", "optimizer.name=adamw8bit"],
    "w1-adamw4bit": ["--nproc", "1", "--set", "optimizer.name=adamw4bit"],
}
STEP = "step-{:08d}"


def train(out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shardwise.train.cli", str(CONFIG), "--set", "run.steps=8", *QUIET,
            "--set", f"checkpointing.output_dir={out}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", **(env or {})})


def steps(out: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


@pytest.fixture(scope="session")
def run(shared_dir):
    """`run(name)` -> the output dir of RUNS[name], trained once per session whichever xdist
    worker asks first (a file lock per run)."""

    def get(name: str) -> Path:
        out = shared_dir / f"low-bit-{name}"
        with FileLock(str(out) + ".lock"):
            done = out.with_suffix(".json")
            if not done.exists():
                r = train(out, *RUNS[name])
                done.write_text(json.dumps({"rc": r.returncode, "stderr": r.stderr[-4000:]}))
        result = json.loads(done.read_text())
        assert result["rc"] == 0, f"{name}: {result['stderr']}"
        return out

    return get


def _max_rel(a: dict[int, tuple[float, float]], b: dict[int, tuple[float, float]]) -> float:
    return max(abs(a[s][0] - b[s][0]) / abs(b[s][0]) for s in b)


# Measured (torch 2.13, torchao 0.18, CPU), the largest relative loss difference from the
# fp32-state AdamW run over the 8 steps, 2 FSDP2 ranks / 1 rank: adamw8bit 2.2e-5 / 1.5e-5,
# adamw4bit 2.4e-4 / 1.4e-4. Steps 1 and 2 are equal: torchao's step updates the weights from its
# fp32 moments of that step and stores them quantized after, so the first update is AdamW's own
# and the quantization error (8-bit: one dynamic-exponent code per element and one fp32 scale per
# 256; 4-bit: 16 codes per element and one scale per 128) enters from the second update on. The
# tolerances keep 4-5x margin over what was measured. What they can tell: at lr 1e-3 over 8 steps
# the losses barely move (the 1-rank run with lr 1.1e-3 differs by 7.3e-5, with beta2 0.999 for
# 0.95 by 1.9e-5, with lr 2e-3 by 1.1e-3), so the 8-step bound says the quantized moments did not
# drift; the first update, equal to 1e-6 (a 10% lr error moves step 2 by 1.1e-5), says lr, eps,
# the bias correction and the update's sign are AdamW's. The hyperparameters and groups themselves
# are compared in test_the_bytes_it_saves_are_the_plans.
TOLERANCE = {"adamw8bit": 1e-4, "adamw4bit": 1e-3}
FIRST_UPDATE = 1e-6


@pytest.mark.parametrize("world", ["w2", "w1"])
@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_it_trains_close_to_fp32_adamw(run, world, name) -> None:
    base, ours = steps(run(f"{world}-adamw")), steps(run(f"{world}-{name}"))
    assert sorted(base) == sorted(ours) == list(range(1, 9))
    assert all(math.isfinite(ours[s][0]) and math.isfinite(ours[s][1]) for s in ours)
    assert ours[1][0] == base[1][0]  # the same model and batch before any update
    assert abs(ours[2][0] - base[2][0]) <= FIRST_UPDATE * base[2][0]
    rel = _max_rel(ours, base)
    assert 0 < rel <= TOLERANCE[name], (name, world, rel, ours, base)
    if world == "w1":  # the example's max_grad_norm 1.0 clipped these steps: the stock step's clipping ran
        assert max(g for _, g in base.values()) > 1.0 and max(g for _, g in ours.values()) > 1.0


def test_in_backward_trains_as_the_stock_step(run) -> None:
    stock, ours = run("w2-adamw8bit"), run("w2-adamw8bit-in-backward")
    a, b = steps(stock), steps(ours)
    assert [a[s][0] for s in a] == [b[s][0] for s in a]
    assert all(abs(a[s][1] - b[s][1]) <= 1e-4 * a[s][1] for s in a)  # norms summed per parameter there
    x = read_tensors(stock / "checkpoints" / STEP.format(8))
    y = read_tensors(ours / "checkpoints" / STEP.format(8))
    assert x.keys() == y.keys() and _codes_keys(x)
    assert not [k for k in x if not torch.equal(x[k], y[k])]


def _codes_keys(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in tensors if k.startswith("optim.exp_avg_codes.")]


def test_a_resumed_run_is_bit_exact(run, tmp_path) -> None:
    whole = run("w2-adamw8bit")
    half = tmp_path / "half"
    args = RUNS["w2-adamw8bit"]
    r = train(half, *args, "--set", "run.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(half, *args, "--resume", "latest")
    assert r.returncode == 0, r.stderr[-3000:]
    w, h = steps(whole), steps(half)
    assert [w[s] for s in range(5, 9)] == [h[s] for s in range(5, 9)]
    a = read_tensors(whole / "checkpoints" / STEP.format(8))
    b = read_tensors(half / "checkpoints" / STEP.format(8))
    assert a.keys() == b.keys() and _codes_keys(a)
    assert {t.dtype for k, t in a.items() if "_codes." in k} == {torch.uint8}
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    # the states moved after the checkpoint: not trivially equal
    c = read_tensors(whole / "checkpoints" / STEP.format(4))
    assert any(not torch.equal(a[k], c[k]) for k in _codes_keys(a))


QPROJ = "model.layers.0.self_attn.q_proj.weight"  # 64 × 64: quantized whole, fp32 in 2 shards of 2,048


def test_another_world_size_resumes_with_the_states_converted(run, tmp_path) -> None:
    """q_proj's states are 8-bit codes on 1 rank (4,096 elements) and fp32 on 2 (2,048 per shard,
    under torchao's 4,096): resumed on the other world size they change form (saved fp32
    quantized by torchao's copy, saved codes dequantized) and the run trains on."""
    for src, nproc, out in ((run("w2-adamw8bit"), "1", tmp_path / "to-w1"),
                            (run("w1-adamw8bit"), "2", tmp_path / "to-w2")):
        saved = read_tensors(src / "checkpoints" / STEP.format(4))
        r = train(out, *TWO, "--set", "optimizer.name=adamw8bit", "--nproc", nproc, "--set", "run.steps=5",
                  "--resume", str(src / "checkpoints" / STEP.format(4)))
        assert r.returncode == 0, r.stderr[-3000:]
        assert list(steps(out)) == [5] and all(math.isfinite(x) for x in steps(out)[5])
        ours = read_tensors(out / "checkpoints" / STEP.format(5))
        quantized_here = nproc == "1"
        assert (f"optim.exp_avg_codes.{QPROJ}" in saved) != quantized_here  # saved in the other form
        assert (f"optim.exp_avg_codes.{QPROJ}" in ours) == quantized_here
        assert (f"optim.exp_avg.{QPROJ}" in ours) != quantized_here


def test_the_bytes_it_saves_are_the_plans() -> None:
    """The census on the bench model (tiny-llama-bench: every decoder and embedding tensor is a
    whole number of 256-element blocks per FSDP2 shard; only the norms, 576 of a rank's 657,984
    elements, stay fp32) against the plan's change of `optimizer_states`. Measured: adamw 5,263,872
    bytes per rank, adamw8bit 1,339,968 (saves 3,923,904; planned 3,927,342, -0.09%), adamw4bit
    703,104 (saves 4,560,768; planned 4,564,764, -0.09%). On the example's tiny Qwen2 the plan
    would be 11% over for 8-bit: its 2-rank attention shards (2,048 and 1,024 elements) are under
    torchao's 4,096 and stay fp32, which the plan does not model (a fraction of a percent of a real
    decoder's elements)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import low_bit_worker

    from shardwise.bench import worker
    from shardwise.plan.evaluate import memory_as_run

    names = ["adamw", "adamw8bit", "adamw4bit"]
    measured = worker.spawn_ranks(low_bit_worker.rank_main, names, timeout_s=300)
    run = worker.bench_run("fsdp")

    def planned(name: str) -> float:
        train = run.train.model_copy(update={"optimizer": name})
        return memory_as_run(run.model, run.hardware, train, run.strategy).gpu.optimizer_states

    for name in ("adamw8bit", "adamw4bit"):
        plan_saves = planned("adamw") - planned(name)
        for rank in range(worker.WORLD):
            stock, ours = measured["adamw"][rank], measured[name][rank]
            assert ours["class"] == {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}[name]
            assert len(stock["groups"]) == 2  # weight-decayed and not
            for g, h in zip(ours["groups"], stock["groups"], strict=True):  # torchao's lr is an fp32 tensor
                assert g == {**h, "lr": g["lr"]} and g["lr"] == pytest.approx(h["lr"], rel=1e-7), (g, h)
            assert stock["bytes"] == 8 * stock["params"]  # fp32 AdamW: two 4-byte moments
            saves = stock["bytes"] - ours["bytes"]
            assert saves > 0 and abs(saves - plan_saves) <= 0.10 * plan_saves, (name, rank, saves, plan_saves)


def test_paged_states_checkpoint_exactly(tmp_path) -> None:
    """bitsandbytes' PagedAdamW8bit is refused on CPU before any rank starts, but its engine side
    runs here: bitsandbytes falls back to unpaged buffers on CPU (and warns). One rank, the bare
    replica: 3 steps, a checkpoint (uint8 `state1`/`state2` as codes, `absmax` as scales; fp32
    states of the small tensors), a fresh engine loaded from it, 2 more steps on each: equal."""
    import warnings

    from shardwise.bench import worker
    from shardwise.config.load import load_config
    from shardwise.run import run_spec
    from shardwise.train.checkpoint.sharded import TrainerState, load_checkpoint, save_checkpoint
    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.model.build import build_model

    cfg = load_config(CONFIG, ["optimizer.name=paged_adamw8bit", "strategy.name=ddp", "run.nproc=1"])
    spec = run_spec(cfg, 1, "cpu", environ={})
    env = DistEnv()

    def batch(i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, spec.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}

    def steps_(engine, a: int, b: int) -> None:
        for i in range(a, b):
            worker.micro_step(engine, batch(i), last=True)
            engine.step()
            engine.zero_grad()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        a = build_engine(build_model(spec), spec, env)
        assert type(a.optimizer).__name__ == "PagedAdamW8bit"
        steps_(a, 0, 3)
        ckpt = save_checkpoint(a, TrainerState(step=3, samples_consumed=6, global_batch=2), tmp_path / "out",
                               config=cfg.model_dump(mode="json", exclude={"source"}), strategy="ddp", keep_last=1)
        saved = read_tensors(ckpt)
        assert {saved[k].dtype for k in _codes_keys(saved)} == {torch.uint8}
        assert any(k.startswith("optim.exp_avg.") for k in saved)  # the norms and biases: fp32
        torch.manual_seed(1)
        b = build_engine(build_model(spec), spec, env)
        load_checkpoint(b, ckpt)
        steps_(a, 3, 5)
        steps_(b, 3, 5)
    pa, pb = dict(a.module.named_parameters()), dict(b.module.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for p, q in zip(a.optimizer.state, b.optimizer.state, strict=True):
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"] == 5
        assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))


def _run(world: int = 2, device: str = "cpu", **changes: str):
    from shardwise.config.load import load_config
    from shardwise.run import run_spec

    return run_spec(load_config(CONFIG, [f"{k}={v}" for k, v in changes.items()]), world, device)


@pytest.mark.parametrize(("changes", "world", "device", "says"), [
    ({"optimizer.name": "adamw8bit", "strategy.name": "zero3"}, 2, "cpu",
     r"optimizer\.name 'adamw8bit': DeepSpeed's engine owns the optimizer and its states \(zero3\).*strategy\.name 'zero3'"),
    ({"optimizer.name": "adamw4bit", "strategy.name": "zero1"}, 2, "cpu", r"DeepSpeed's engine owns the optimizer"),
    ({"optimizer.name": "adamw8bit", "strategy.tp": "2"}, 2, "cpu", r"not with tensor parallelism \(tp 2\)"),
    ({"optimizer.name": "paged_adamw8bit", "strategy.name": "ddp"}, 2, "cpu",
     r"optimizer\.name 'paged_adamw8bit': bitsandbytes' paged optimizer keeps its states in CUDA unified memory"),
    ({"optimizer.name": "paged_adamw8bit", "run.device": "cuda"}, 2, "cuda",
     r"take plain tensors, not FSDP2's DTensor shards \(fsdp\)"),
])
def test_what_it_cannot_run_is_refused_naming_the_field(changes, world, device, says) -> None:
    from shardwise.train.preflight import check_low_bit

    with pytest.raises(ShardwiseError, match=says):
        check_low_bit(_run(world, device, **changes))


def test_paged_runs_where_it_can() -> None:
    """One ddp rank (or FSDP2 on one rank, which runs as ddp) on CUDA: nothing to refuse (the
    import of bitsandbytes is checked too)."""
    from shardwise.train.preflight import check_low_bit

    check_low_bit(_run(1, "cuda", **{"optimizer.name": "paged_adamw8bit", "run.device": "cuda"}))
    check_low_bit(_run(2, "cuda", **{"optimizer.name": "paged_adamw8bit", "run.device": "cuda",
                                     "strategy.name": "ddp"}))


def test_a_missing_torchao_is_refused_before_any_rank_starts(tmp_path) -> None:
    fake = tmp_path / "site"
    (fake / "torchao").mkdir(parents=True)
    (fake / "torchao" / "__init__.py").write_text("raise ImportError('No module named torchao (faked by the test)')\n")
    path = os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])
    r = train(tmp_path / "out", "--set", "optimizer.name=adamw8bit", env={"PYTHONPATH": path})
    assert r.returncode == 2, r.stderr[-3000:]
    assert (f"{CONFIG}: optimizer.name 'adamw8bit' runs torchao's AdamW8bit, and torchao does not import here "
            "(No module named torchao (faked by the test)): pip install torchao") in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_another_optimizer_cannot_resume_its_checkpoint(run) -> None:
    from shardwise.config.load import load_config
    from shardwise.run import run_spec
    from shardwise.train.checkpoint.resume_checks import check_resumable

    ckpt = run("w2-adamw8bit") / "checkpoints" / STEP.format(4)
    for name in ("adamw4bit", "adamw"):
        cfg = load_config(CONFIG, [f"optimizer.name={name}"])
        with pytest.raises(ShardwiseError, match=rf"optimizer\.name = '{name}', but .* was trained with 'adamw8bit' "
                                                 r"and holds its optimizer states \(torchao's 8-bit codes and scales\)"):
            check_resumable(cfg, run_spec(cfg, 2, "cpu"), ckpt)
    cfg = load_config(CONFIG, ["optimizer.name=adamw8bit"])
    check_resumable(cfg, run_spec(cfg, 2, "cpu"), ckpt)


def test_plan_emit_writes_the_name_where_the_trainer_runs_it() -> None:
    from shardwise.catalog import build_hardware, get_model
    from shardwise.run.bridge import to_config
    from shardwise.specs import Strategy, TrainSpec

    model, hw = get_model("llama-3.1-8b"), build_hardware(gpu="h100-sxm", gpus=8)
    for name, strategy, runs in (("adamw8bit", "fsdp", "adamw8bit"), ("adamw4bit", "ddp", "adamw4bit"),
                                 ("paged_adamw8bit", "ddp", "paged_adamw8bit"), ("adamw8bit", "zero3", "adamw"),
                                 ("paged_adamw8bit", "fsdp", "adamw"), ("sgd", "fsdp", "adamw")):
        cfg, notes = to_config(model, hw, TrainSpec(optimizer=name), Strategy.from_name(strategy))
        assert cfg.optimizer.name == runs
        assert any(f"planned optimizer {name!r}" in n for n in notes) == (runs != name)
