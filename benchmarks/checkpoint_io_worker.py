"""One rank of `benchmarks/checkpoint_io.py`: one (model, strategy) case per launch.

Builds the run the trainer builds (TrainConfig -> run_spec -> build_model -> build_engine),
takes a few real optimizer steps the way `shardwise.train.loop.train` does (global target
count, `loss_scale = world / targets`, set_lr, sync_grads, step, zero_grad), then:

1. one no-grad forward on a fixed batch (the reference loss) and per-key checksums of the
   engine's canonical checkpoint tensors (weights and both AdamW moments);
2. `save_checkpoint` (collective), timed on every rank, with its phases timed by wrappers
   around `engine.checkpoint_state`, `dcp.save`, `os.fsync` and the manifest's `_sha256`;
3. the first engine is closed and freed; a fresh model and engine are built (same seed, so
   the untrained init), one forward (must differ from the reference: the check can fail);
4. `read_manifest(verify_hashes=True)` on rank 0, timed (what preflight does on resume);
5. `load_checkpoint` into the fresh engine, timed on every rank (phases: `dcp.load`, rest);
6. one forward (must equal the reference loss) and the checksums again (must match).

Rank 0 writes `<result>`: every rank's numbers (gathered). On an exception each rank writes
`<result>.rank<r>.error.json` with the traceback and exits 1 (the launcher then ends the
other rank). A thread watches the host's MemAvailable and ends the case (exit 3, recorded)
before the machine runs out: other people's processes share this host.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

MIN_AVAILABLE_BYTES = 1 << 30  # the memory guard ends the case below this much free host memory
GUARD_EXIT = 86  # not one of shardwise's ExitCodes, so the launcher does not give it their meaning
PHASE = {"name": "start", "rss_by_phase": {}}  # what this rank is doing: the guard names it


def phase(name: str) -> None:
    """Enter a phase; record this rank's RSS and the host's MemAvailable as it starts."""
    PHASE["name"] = name
    PHASE["rss_by_phase"][name] = {"rss_gib": round(rss_bytes() / 2**30, 2),
                                   "peak_rss_gib": round(peak_rss_bytes() / 2**30, 2),
                                   "host_available_gib": round(mem_available() / 2**30, 2)}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Timers:
    """Accumulated seconds per name, reset per phase (save, load)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        self.acc, self.calls = {}, {}

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.acc[name] = self.acc.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def snapshot(self) -> dict[str, float]:
        return {**{f"{k}_s": v for k, v in self.acc.items()}, **{f"{k}_calls": v for k, v in self.calls.items()}}


def bench_config(model: str, strategy: str, seq: int, micro_batch: int, steps: int, out: Path):
    from shardwise.config.schema import TrainConfig

    return TrainConfig.model_validate(
        {
            "model": {"name": model},
            "data": {"kind": "synthetic", "synthetic": {"samples": 256, "seq_len": seq, "seed": 11}},
            "strategy": {"name": strategy},
            # weight decay on: two AdamW groups, as a real run has (ZeRO links them separately)
            "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "max_grad_norm": 1.0},
            "schedule": {"kind": "constant"},
            "precision": "fp32",
            "run": {"steps": steps, "micro_batch": micro_batch, "grad_accum": 1, "seed": 5, "device": "cpu"},
            "checkpointing": {"output_dir": str(out), "save_every_minutes": None, "keep_last": 2},
            "logging": {"progress": False, "tensorboard": False},
        }
    )


def start_memory_guard(result: Path, rank: int) -> None:
    def watch() -> None:
        while True:
            avail = mem_available()
            if avail < MIN_AVAILABLE_BYTES:
                msg = (f"aborted by the benchmark's memory guard in phase '{PHASE['name']}': host MemAvailable "
                       f"{avail / 2**30:.2f} GiB < {MIN_AVAILABLE_BYTES / 2**30:.0f} GiB; this rank's RSS "
                       f"{rss_bytes() / 2**30:.2f} GiB (peak {peak_rss_bytes() / 2**30:.2f} GiB)")
                Path(f"{result}.rank{rank}.error.json").write_text(json.dumps(
                    {"rank": rank, "error": msg, "kind": "memory_guard", "phase": PHASE["name"],
                     "rss_by_phase": PHASE["rss_by_phase"]}))
                os._exit(GUARD_EXIT)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps before the first save")
    ap.add_argument("--repeats", type=int, default=1, help="saves (one more step before each) and loads")
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--log", required=True, help="this rank's stdout/stderr go to LOG.rank<r>")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    log = open(f"{args.log}.rank{rank}", "w")  # lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:  # if the estimate was wrong, the kernel's OOM killer takes this rank, not a neighbour
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    start_memory_guard(Path(args.result), rank)
    try:
        run_case(args)
    except BaseException:
        Path(f"{args.result}.rank{rank}.error.json").write_text(
            json.dumps({"rank": rank, "error": traceback.format_exc(), "kind": "exception",
                        "phase": PHASE["name"], "rss_by_phase": PHASE["rss_by_phase"]}))
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


def run_case(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    from shardwise.data.labels import count_target_tokens
    from shardwise.run import run_spec
    from shardwise.train.checkpoint import sharded as ckpt
    from shardwise.train.checkpoint.directory import MANIFEST, TRAINER_STATE
    from shardwise.train.data import SyntheticSource, build_source, stack
    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import model_inputs, token_loss_sum
    from shardwise.train.launch.rank import init_distributed
    from shardwise.train.loop import seed_everything
    from shardwise.train.model.build import build_model

    env = init_distributed("cpu", timeout_s=900)
    out = Path(args.ckpt_dir)
    cfg = bench_config(args.model, args.strategy, args.seq, args.micro_batch, args.steps + args.repeats, out)
    run = run_spec(cfg, env.world_size, "cpu")
    rec: dict = {"rank": rank_of(env), "mem_available_at_start": mem_available()}

    timers = Timers()
    # the save's file entries and read_manifest's verification both hash through this one function
    ckpt._sha256 = timers.wrap("sha256", ckpt._sha256)
    dcp.save = timers.wrap("dcp_save", dcp.save)
    dcp.load = timers.wrap("dcp_load", dcp.load)
    os.fsync = timers.wrap("fsync", os.fsync)
    import torch.distributed.checkpoint.filesystem as dcp_fs

    dcp_fs._write_item = timers.wrap("dcp_write_item", dcp_fs._write_item)  # torch.save of each item + write

    num_params = 0

    def build():
        seed_everything(cfg.run.seed)
        t0 = time.perf_counter()
        model = build_model(run)
        nonlocal num_params
        num_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 empties them
        t1 = time.perf_counter()
        engine = build_engine(model, run, env)
        t2 = time.perf_counter()
        engine.checkpoint_state = timers.wrap("checkpoint_state", engine.checkpoint_state)
        return model, engine, {"build_model_s": t1 - t0, "build_engine_s": t2 - t1}

    def forward_loss(engine, batch) -> float:
        """The mean target-token loss of one no-grad forward (the same batch on every rank)."""
        fwd = next(m for m in (getattr(engine, "ds", None), getattr(engine, "ddp", None), engine.module)
                   if m is not None)
        with torch.no_grad():
            logits = fwd(**model_inputs(batch, env.torch_device)).logits
            loss = float(token_loss_sum(logits, batch["labels"])) / count_target_tokens(batch)
        from torch.distributed.fsdp import FSDPModule

        for m in engine.module.modules():  # FSDP2 leaves the root unsharded after a forward
            if isinstance(m, FSDPModule):  # without backward: shard it again, as after a step
                m.reshard()
        return loss

    def checksums(engine) -> tuple[dict[str, list[float]], dict]:
        """Per canonical key: (sum, sum of squares) in float64 of this rank's part."""
        tensors, extra = engine.checkpoint_state()
        out_ = {}
        for k, t in tensors.items():
            local = t.to_local() if hasattr(t, "to_local") else t
            x = local.detach().double()
            out_[k] = [float(x.sum()), float((x * x).sum())]
        del tensors
        return out_, extra

    phase("build")
    model, engine, rec["build"] = build()
    data = build_source(run, env, model.config.vocab_size)
    src = SyntheticSource(cfg.data.synthetic, model.config.vocab_size)
    probe = stack([src[len(src) - 1 - i] for i in range(args.micro_batch)])  # same on every rank

    step_times: list[float] = []
    step_no = 0

    def train_step() -> None:
        nonlocal step_no
        micro = next(data)
        counts = torch.tensor([float(sum(count_target_tokens(b) for b in micro))], dtype=torch.float64)
        dist.all_reduce(counts)
        dist.barrier()
        t0 = time.perf_counter()
        engine.set_lr(cfg.optimizer.lr)
        for i, b in enumerate(micro):
            with engine.sync_grads(i == len(micro) - 1):
                engine.forward_backward(b, env.world_size / float(counts[0]))
        engine.step()
        engine.zero_grad()
        step_times.append(time.perf_counter() - t0)
        step_no += 1

    phase("train steps")
    for _ in range(args.steps):
        train_step()

    saves, path = [], None
    ref_loss = ref_sums = ref_extra = None
    for r in range(args.repeats):
        train_step()
        if r == args.repeats - 1:  # the reference: the weights the last save holds
            phase("reference forward + checksums")
            ref_loss = forward_loss(engine, probe)
            timers.reset()
            ref_sums, ref_extra = checksums(engine)
            checksum_s = timers.acc.get("checkpoint_state", 0.0)
        state = ckpt.TrainerState(step=step_no, samples_consumed=step_no * cfg.run.micro_batch * env.world_size,
                                  global_batch=cfg.run.micro_batch * env.world_size)
        gc.collect()
        dist.barrier()
        phase(f"save {r + 1}")
        timers.reset()
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(engine, state, out, config=cfg.model_dump(mode="json"),
                                    strategy=run.strategy.name, keep_last=cfg.checkpointing.keep_last)
        total = time.perf_counter() - t0
        saves.append({"step": step_no, "total_s": total, **timers.snapshot(), "rss_after": rss_bytes()})

    manifest = ckpt.read_manifest(path, verify_hashes=False)
    files = manifest["files"]
    mine = {n: e["bytes"] for n, e in files.items()
            if n == f"rank-{env.rank:05d}.json" or (n.startswith(f"__{env.rank}_") and n.endswith(".distcp"))}
    shared = {n: e["bytes"] for n, e in files.items() if n in (".metadata", TRAINER_STATE)}
    manifest_bytes = (path / MANIFEST).stat().st_size
    rec["bytes"] = {"rank_files": mine, "rank_bytes": sum(mine.values()),
                    "all_listed_bytes": sum(e["bytes"] for e in files.values()),
                    "shared_files": shared, "manifest_bytes": manifest_bytes,
                    "tensor_keys_on_rank": len(ref_sums)}

    # --- load into a freshly built engine ------------------------------------------------
    engine.close()
    del engine, model
    data = None  # drops the iterator (and anything it holds) before the second build
    gc.collect()
    dist.barrier()
    rec["mem_available_before_load_build"] = mem_available()
    phase("build for load")
    _model, engine, rec["build_for_load"] = build()
    fresh_loss = forward_loss(engine, probe)

    verify_s = None
    dist.barrier()
    if env.rank == 0:
        t0 = time.perf_counter()
        ckpt.read_manifest(path, verify_hashes=True)
        verify_s = time.perf_counter() - t0
    dist.barrier()

    loads, losses_after = [], []
    for i in range(args.repeats):
        gc.collect()
        dist.barrier()
        phase(f"load {i + 1}")
        timers.reset()
        t0 = time.perf_counter()
        state = ckpt.load_checkpoint(engine, path)
        total = time.perf_counter() - t0
        loads.append({"total_s": total, **timers.snapshot()})
        losses_after.append(forward_loss(engine, probe))
    phase("checksums after load")
    new_sums, new_extra = checksums(engine)
    mismatched = sorted(k for k in ref_sums if new_sums.get(k) != ref_sums[k])
    missing = sorted(set(ref_sums) ^ set(new_sums))
    rec["verify"] = {
        "loss_before_save": ref_loss,
        "loss_fresh_engine_before_load": fresh_loss,
        "loss_after_load": losses_after,
        "loss_equal": all(x == ref_loss for x in losses_after),
        "loss_abs_diff_max": max(abs(x - ref_loss) for x in losses_after),
        "fresh_differs": fresh_loss != ref_loss,
        "checksum_keys": len(ref_sums),
        "checksum_mismatched_keys": mismatched[:20],
        "checksum_mismatched_count": len(mismatched),
        "key_set_difference": missing[:20],
        "optimizer_step_saved": ref_extra["optimizer_step"],
        "optimizer_step_loaded": new_extra["optimizer_step"],
        "trainer_state_step": state.step,
    }
    rec["verify"]["ok"] = bool(rec["verify"]["loss_equal"] and rec["verify"]["fresh_differs"] and not mismatched
                               and not missing and ref_extra["optimizer_step"] == new_extra["optimizer_step"])
    rec.update(num_params=num_params, step_times_s=step_times, saves=saves, loads=loads,
               manifest_verify_s=verify_s, checksum_pass_s=checksum_s,
               peak_rss=peak_rss_bytes(), mem_available_at_end=mem_available())
    phase("end")
    rec["rss_by_phase"] = PHASE["rss_by_phase"]
    engine.close()

    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, rec)
    if env.rank == 0:
        Path(args.result).write_text(json.dumps({
            "model": args.model, "strategy": args.strategy, "strategy_resolved": run.strategy.name,
            "engine": run.strategy.engine, "world_size": env.world_size, "seq_len": args.seq,
            "micro_batch": args.micro_batch, "steps_before_save": args.steps, "repeats": args.repeats,
            "num_params": num_params, "step_median_s": statistics.median(step_times[1:] or step_times),
            "ranks": gathered,
        }, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def rank_of(env) -> int:
    return env.rank


if __name__ == "__main__":
    main()
