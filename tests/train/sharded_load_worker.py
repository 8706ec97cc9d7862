"""One rank of the sharded-load checks: builds each requested (strategy, lora) run from a local
bf16 safetensors checkpoint as the trainer does (`build_model(run, deferred=True)` then the
engine), and rank 0 writes `<item>.pt` with the eval loss sum of a fixed batch (the engine's own
forward) and the consolidated weights.

Run by tests/train/test_sharded_load.py: `--runs CKPT_DIR:strategy[:lora] ...`.
"""

from __future__ import annotations

import torch
from worker_common import start_worker

from shardwise.config.schema import TrainConfig
from shardwise.run import run_spec
from shardwise.train.engines import build_engine
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.model.build import build_model

BATCH_SEED = 11


def load_config(path: str, strategy: str, lora: bool, precision: str = "fp32") -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"path": path, "attention": "eager"},
        "data": {"kind": "synthetic", "synthetic": {"samples": 8, "seq_len": 16, "seed": 7}},
        "strategy": {"name": strategy},
        "precision": precision,
        "run": {"steps": 1, "micro_batch": 1, "grad_accum": 1, "seed": 3, "device": "cpu"},
        "logging": {"progress": False, "tensorboard": False},
        "loss": {"implementation": "standard"},
        "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"} if lora else None,
    })


def fixed_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(BATCH_SEED)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    items, env, out = start_worker("ckpt:strategy[:lora]")
    for item in items:
        path, strategy, *flags = item.split(":")
        run = run_spec(load_config(path, strategy, "lora" in flags), env.world_size, "cpu")
        model = build_model(run, deferred=True)
        engine = build_engine(model, run, env)
        batch = fixed_batch(run.model.vocab_size)
        loss = engine.evaluate(batch)
        wrapper = getattr(engine, "ds", None) or getattr(engine, "ddp", None) or engine.module
        with torch.no_grad():  # the engine's own forward, whole logits (no loss inside the model)
            logits = wrapper(input_ids=batch["input_ids"]).logits.float().cpu()
        weights = engine.consolidated_state_dict()
        if env.is_main:
            name = f"{strategy}{'-lora' if 'lora' in flags else ''}{'-bin' if 'bin' in flags else ''}-w{env.world_size}.pt"
            torch.save({"loss_sum": loss.double().item(), "logits": logits, "weights": weights, "engine": engine.name},
                       out / name)
        engine.close()
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
