"""Step time of `shardwise train` vs a bare loop on the same engine, per strategy.

The bare loops are the engines' own tutorial loops on the same model, data, micro-batches
and engine config: `deepspeed.initialize` + `engine(...)`/`engine.backward`/`engine.step`;
`fully_shard` per layer + root with `loss.backward()`/clip/`opt.step()`; DDP likewise. The
trainer's extras (global target-token all-reduce, loss all-reduce, schedule, metrics
record) are what the ratio measures. Optionally also `transformers.Trainer` with the same
DeepSpeed config (zero2), when it runs here.

    python benchmarks/trainer_overhead.py [--steps 40] [--strategies ddp zero2 ...]

Writes benchmarks/results/trainer_overhead.json. Target: ratio <= 1.03 (bare), <= 1.0 (HF).
Runs on CPU (2 gloo ranks) or CUDA (one rank per GPU) — the device decides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "trainer_overhead.json"
STRATEGIES = ["ddp", "zero0", "zero1", "zero2", "zero3", "fsdp", "fsdp-grad-op"]


def bench_config(strategy: str, steps: int, device: str):
    from shardwise.config.schema import TrainConfig

    return TrainConfig.model_validate(
        {
            "model": {"name": "tiny-llama"},
            "data": {"kind": "synthetic", "synthetic": {"samples": 64, "seq_len": 256, "seed": 1}},
            "strategy": {"name": strategy},
            "optimizer": {"lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0},
            "schedule": {"kind": "constant"},
            "precision": "fp32" if device == "cpu" else "bf16-mixed",
            "run": {"steps": steps, "micro_batch": 4, "grad_accum": 1, "seed": 0, "device": device},
            "logging": {"progress": False, "tensorboard": False},
        }
    )


def bare_loop(cfg, env, steps) -> list[float]:
    """The tutorial loop on the same engine; HF's own loss (mean over the micro-batch)."""
    import torch

    from shardwise.run import deepspeed_config, run_spec
    from shardwise.train.engines.base import decay_groups
    from shardwise.train.model.build import build_model

    run = run_spec(cfg, env.world_size, env.device)
    model = build_model(run)
    s = run.strategy
    dev = env.torch_device
    if s.engine == "deepspeed":
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=decay_groups(model, 0.0), config=deepspeed_config(run)
        )

        def one(b):
            loss = engine(input_ids=b["input_ids"].to(dev), labels=b["labels"].to(dev)).loss
            engine.backward(loss)
            engine.step()
    else:
        if s.engine == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            model.to(dev)
            for layer in model.model.layers:
                fully_shard(layer, reshard_after_forward=s.resharding != "none")  # the tutorial: one bool
            fully_shard(model, reshard_after_forward=False)
            net = model
        else:
            net = torch.nn.parallel.DistributedDataParallel(model.to(dev))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

        def one(b):
            loss = net(input_ids=b["input_ids"].to(dev), labels=b["labels"].to(dev)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    from shardwise.train.data import build_source

    data = build_source(run, env, model.config.vocab_size)
    times = []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        one(next(data)[0])
        if env.device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0, time.thread_time() - c0))
    if s.engine == "deepspeed":
        engine.destroy()
    return times


def hf_trainer(cfg, env, steps) -> list[float]:
    """transformers.Trainer with the same DeepSpeed config (zero2), step times from a callback."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from shardwise.run import deepspeed_config, run_spec
    from shardwise.train.data import SyntheticSource
    from shardwise.train.model.build import build_model

    run = run_spec(cfg, env.world_size, env.device)
    model = build_model(run)
    ds = deepspeed_config(run)
    ds.pop("scheduler")  # Trainer builds its own
    ds["optimizer"]["params"]["lr"] = "auto"
    times: list[float] = []

    class Clock(TrainerCallback):
        """Step-begin to step-begin: the whole iteration, data loading included, the same window
        as shardwise's step time (which fetches the next step's batches inside the step)."""

        t0: float | None = None

        def on_step_begin(self, *a, **k):
            now = time.perf_counter()
            if self.t0 is not None:
                times.append(now - self.t0)
            self.t0 = now

    src = SyntheticSource(cfg.data.synthetic, model.config.vocab_size)
    rows = [{"input_ids": src[i]["input_ids"], "labels": src[i]["labels"]} for i in range(len(src))]
    args = TrainingArguments(
        output_dir="/tmp/shardwise-hf-bench",
        max_steps=steps,
        report_to=[],
        per_device_train_batch_size=cfg.run.micro_batch,
        deepspeed=ds,
        save_strategy="no",
        logging_strategy="no",
        use_cpu=env.device == "cpu",
        dataloader_drop_last=True,
        learning_rate=1e-4,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        weight_decay=0.0,
    )
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()]).train()
    return times


def worker(args) -> None:
    import torch

    from shardwise.run import run_spec
    from shardwise.train.launch.rank import init_distributed
    from shardwise.train.loop import train

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    env = init_distributed(device)
    warm = 5
    out: dict[str, dict] = {}
    for strategy in args.strategies:
        cfg = bench_config(strategy, args.steps, device)
        wall = {"bare": [], "shardwise": []}
        cpu = {"bare": [], "shardwise": []}
        for _ in range(args.rounds):  # alternate to cancel drift of a shared machine
            bare_t = bare_loop(cfg, env, args.steps)[warm:]
            wall["bare"].append(statistics.median(t for t, _ in bare_t))
            cpu["bare"].append(statistics.median(c for _, c in bare_t))
            res = train(run_spec(cfg, env.world_size, env.device), env).records[warm:]
            wall["shardwise"].append(statistics.median(r.step_time_s for r in res))
            cpu["shardwise"].append(statistics.median(r.cpu_time_s for r in res))
        row = {}
        for name, m in (("wall", wall), ("cpu", cpu)):
            # Paired per round (bare and shardwise run back to back), then the median over rounds:
            # drift of a shared machine cancels within a pair; the spread is reported, not hidden.
            ratios = sorted(o / b for b, o in zip(m["bare"], m["shardwise"], strict=False))
            row |= {f"bare_{name}_s": statistics.median(m["bare"]),
                    f"shardwise_{name}_s": statistics.median(m["shardwise"]),
                    f"ratio_{name}": statistics.median(ratios), f"ratio_{name}_rounds": ratios}
        out[strategy] = row
        if env.is_main:
            print(
                f"{strategy:14s} wall: bare {row['bare_wall_s'] * 1e3:7.2f} ms shardwise "
                f"{row['shardwise_wall_s'] * 1e3:7.2f} ms ratio {row['ratio_wall']:.3f} "
                f"(rounds {min(row['ratio_wall_rounds']):.3f}–{max(row['ratio_wall_rounds']):.3f}) | cpu ratio "
                f"{row['ratio_cpu']:.3f}",
                flush=True,
            )
    hf = None
    if args.hf:
        cfg = bench_config("zero2", args.steps, device)
        try:  # median over rounds, as for the other comparisons
            hf_t = statistics.median(statistics.median(hf_trainer(cfg, env, args.steps)[warm:]) for _ in range(args.rounds))
            ours = out.get("zero2", {}).get("shardwise_wall_s")
            hf = {"hf_trainer_step_s": hf_t, "shardwise_step_s": ours, "ratio": ours / hf_t if ours else None}
        except Exception as e:
            hf = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if env.is_main:
            print("transformers.Trainer (zero2):", hf, flush=True)
    if env.is_main:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            json.dumps(
                {
                    "device": device,
                    "world_size": env.world_size,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "model": "tiny-llama",
                    "seq_len": 256,
                    "micro_batch": 4,
                    "precision": cfg.precision,
                    "metric": "per round: median per-step wall (and rank-0 CPU) time after 5 warm-up steps, "
                    "bare and shardwise back to back; ratio = median over rounds of the paired ratios",
                    "target_ratio": 1.03,
                    "strategies": out,
                    "transformers_trainer": hf,
                },
                indent=2,
            )
            + "\n"
        )
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES)
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    args = ap.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    from shardwise.train.launch.spawn import spawn

    sys.exit(
        spawn([__file__, *sys.argv[1:]], args.nproc, extra_env={"DS_ACCELERATOR": "cpu"}, threads_per_rank=1)
    )


if __name__ == "__main__":
    main()
