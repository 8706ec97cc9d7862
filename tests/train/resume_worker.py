"""One rank of the resume runs (tests/train/test_resume.py), launched through `spawn`.

`--runs` lists `strategy:mode[:from_dir]` items, trained in turn in one launch:
- `full`: STEPS steps, a checkpoint every SAVE_EVERY steps (all kept);
- `resume`: continue to STEPS from the checkpoint `<out>/<from_dir>/checkpoints/step-SAVE_EVERY`.
Rank 0 writes `<out>/<strategy>-<mode>[-<from>]-w<world>.pt`: losses, grad norms and the
consolidated final weights. The config is the parity runs' (fp32, global batch 4 whatever the
world size), so a checkpoint of one world size resumes on another with the same samples.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
from shardwise.train.checkpoint.sharded import resolve_resume
from shardwise.train.launch.rank import init_distributed, run_rank_script
from shardwise.train.loop import train

sys.path.insert(0, str(Path(__file__).parent))
from parity_worker import parity_config

STEPS = 8
SAVE_EVERY = 3


def resume_config(strategy: str, world: int, out: Path) -> TrainConfig:
    """`strategy` may end in `+lora` (the parity runs' LoRA: adapters only in the checkpoint) or
    `@tp<N>` (tensor parallel degree N, `strategy.tp`)."""
    name, _, tp = strategy.partition("@")
    name, _, lora = name.partition("+")
    raw = parity_config(name, world, 1, flags=tuple(f for f in (lora, tp) if f)).model_dump()
    raw["run"]["steps"] = STEPS
    raw["checkpointing"].update(output_dir=str(out), save_every_steps=SAVE_EVERY, keep_last=10)
    return TrainConfig.model_validate(raw)


def eval_then_save(strategy: str, env, out: Path) -> None:
    """One step, then an evaluation forward (no backward), then a save and a load into a fresh
    engine: the loaded engine must give the saved engine's loss exactly."""
    from shardwise.train.checkpoint.sharded import TrainerState, load_checkpoint, save_checkpoint
    from shardwise.train.data import build_source
    from shardwise.train.engines import build_engine
    from shardwise.train.model.build import build_model

    run_dir = out / f"{strategy}-evalsave-w{env.world_size}"
    run = run_spec(resume_config(strategy, env.world_size, run_dir), env.world_size, "cpu")
    batch = next(build_source(run, env, 256))

    def engine():
        torch.manual_seed(123 + len(str(run_dir)))  # any init: the load must overwrite it
        return build_engine(build_model(run), run, env)

    def eval_loss(e) -> float:
        with torch.no_grad():
            return float(sum(e.module(input_ids=b["input_ids"]).logits.sum()
                             for b in batch))

    a = engine()
    for b in batch:
        a.forward_backward(b, 1e-3)
    a.step()
    a.zero_grad()
    before = eval_loss(a)  # the forward that leaves FSDP2's root unsharded
    path = save_checkpoint(a, TrainerState(step=1, samples_consumed=0, global_batch=4), run_dir,
                           config={}, strategy=strategy, keep_last=1)  # fmt: skip
    a.close()
    b_engine = engine()
    load_checkpoint(b_engine, path)
    after = eval_loss(b_engine)
    b_engine.close()
    if env.is_main:
        torch.save({"before": before, "after": after}, out / f"{run_dir.name}.pt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", nargs="+", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    out = Path(args.out)
    for item in args.runs:
        strategy, mode, *src = item.split(":")
        if mode == "evalsave":
            eval_then_save(strategy, env, out)
            continue
        run_dir = out / f"{strategy}-{mode}{'-' + src[0] if src else ''}-w{env.world_size}"
        resume = None
        if mode == "resume":
            ckpt = checkpoints_dir(out / src[0]) / step_dir_name(SAVE_EVERY)
            resume = resolve_resume(str(ckpt), out)
        cfg = resume_config(strategy, env.world_size, run_dir)
        res = train(run_spec(cfg, env.world_size, "cpu"), env, export_weights=True, resume=resume)
        if env.is_main:
            record = {"losses": res.losses, "grad_norms": [r.grad_norm for r in res.records],
                      "start_step": res.start_step, "weights": res.final_weights}  # fmt: skip
            torch.save(record, out / f"{run_dir.name}.pt")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)  # no interpreter shutdown: see its docstring (a gloo abort at exit)
