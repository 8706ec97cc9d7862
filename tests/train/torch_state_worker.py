"""One rank: the DDP and FSDP2 engines' canonical state through torch's state-dict API
(get_state_dict / set_state_dict). For each item `<strategy>:<model>:<precision>[:fused][:lora]`,
rank 0 writes `<item>.json`: the canonical keys against the trained parameters, whether they
alias the live tensors, the step count before any update, and after a save at step 3 and a
load into a fresh engine: the extras, every tensor, and the next step's weights, bit for bit.

Run by tests/train/test_torch_state.py on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.checkpoint import sharded as ckpt
from shardwise.train.engines import build_engine
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.loop import seed_everything
from shardwise.train.model.build import build_model

CANONICAL = ("model", "optim.exp_avg", "optim.exp_avg_sq")


def config(strategy: str, model: str, precision: str, fused: bool, lora: bool, out: Path) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"name": model, "attention": "eager"},
        "data": {"kind": "synthetic"},
        "strategy": {"name": strategy},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "fused": fused},
        "precision": precision,
        "run": {"device": "cpu", "steps": 4, "seed": 3},
        "lora": {"rank": 4, "target_modules": "all-linear"} if lora else None,
        "checkpointing": {"output_dir": str(out)},
        "logging": {"progress": False, "tensorboard": False},
    })


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def step(engine, ids: torch.Tensor) -> None:
    with engine.sync_grads(True):
        engine.forward_backward({"input_ids": ids, "labels": ids}, 1 / ids.numel())
    engine.step()
    engine.zero_grad()


def one(item: str, env, out: Path) -> None:
    strategy, model, precision, *flags = item.split(":")
    cfg = config(strategy, model, precision, "fused" in flags, "lora" in flags, out / item.replace(":", "-"))
    run = run_spec(cfg, env.world_size, "cpu")
    seed_everything(cfg.run.seed)
    engine = build_engine(build_model(run), run, env)
    ids = torch.randint(0, run.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(env.rank))
    tensors, extra0 = engine.checkpoint_state()
    trained = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    live = {n: (p.to_local() if hasattr(p, "to_local") else p).data_ptr() for n, p in trained.items()}
    aliases = all((t.to_local() if hasattr(t, "to_local") else t).data_ptr() == live[k.removeprefix("model.")]
                  for k, t in tensors.items() if k.startswith("model."))
    keys_ok = set(tensors) == {f"{c}.{n}" for n in trained for c in CANONICAL}
    for _ in range(3):
        step(engine, ids)
    path = ckpt.save_checkpoint(engine, ckpt.TrainerState(step=3, samples_consumed=3, global_batch=1),
                                cfg.checkpointing.output_dir, config=cfg.model_dump(mode="json"),
                                strategy=strategy, keep_last=1)
    saved, extra = engine.checkpoint_state()
    saved = {k: full(v) for k, v in saved.items()}
    step(engine, ids)
    after = engine.consolidated_state_dict()
    engine.close()
    seed_everything(cfg.run.seed + 1)  # another init: everything must come from the checkpoint
    fresh = build_engine(build_model(run), run, env)
    ckpt.load_checkpoint(fresh, path)
    loaded, extra1 = fresh.checkpoint_state()
    same = all(torch.equal(saved[k], full(v)) for k, v in loaded.items()) and loaded.keys() == saved.keys()
    steps = sorted({float(s["step"]) for s in fresh.optimizer.state.values()})
    step(fresh, ids)
    again = fresh.consolidated_state_dict()
    fresh.close()
    if env.is_main:
        exact = after.keys() == again.keys() and all(torch.equal(after[k], again[k]) for k in after)
        (out / f"{item.replace(':', '-')}.json").write_text(json.dumps({
            "keys_match_trained_params": keys_ok, "n_trained": len(trained), "aliases_live": aliases,
            "step_before_update": extra0["optimizer_step"], "extra_saved": extra, "extra_loaded": extra1,
            "state_equal": same, "steps_loaded": steps, "next_step_exact": exact,
            "has_frozen": any(not p.requires_grad for p in fresh.module.parameters())}))


def main() -> None:
    items, env, out = start_worker("strategy:model:precision[:fused][:lora]")
    for item in items:
        one(item, env, out)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
