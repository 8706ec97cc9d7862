"""One rank of the pipeline measurements (tests/accuracy/test_measured_pipeline.py): the trainer's
PipelineEngine, built from a TrainConfig through the run bridge and `build_engine` as `shardwise
train` builds it, runs STEPS steps of GA micro-batches on random tokens:

- step 1: a full step (the stages' first-step set-up, AdamW's states allocated);
- step 2: forward and backward of every micro-batch inside `bench.saved.following_saved` (the peak
  of live saved-for-backward bytes on this rank, storage-deduped; parameters, sharded or gathered,
  and the batch not counted), then the census of model states (`bench.census`, after backward,
  before the optimizer step), then the step;
- steps 3..STEPS: timed, the garbage collector paused: each stage's `forward_one_chunk` /
  `backward_one_chunk` wrapped to record (kind, stage, micro-batch, start, end, CPU time): the
  machine's monotonic clock around the call and the CPU time this rank's thread spent in it
  (`time.thread_time`), and the step's forward and backward between a barrier and its return.

Items: `<model>-pp<P>[-dp<D>]-<schedule>`, schedule `gpipe`, `1f1b` or `interleaved<V>`; models
`m7` (7 decoder layers: uneven stages) and `m8` (8: equal ones), tiny Llamas whose embedding and
lm_head are small beside the layers (a vocabulary of 256), built from a config.json this worker
writes (random weights). Every rank writes `<item>.rank<r>.json`.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

LAYERS = {"m7": 7, "m8": 8}
SEQ, MICRO, GA, STEPS = 128, 2, 4, 8


def hf_config(model: str) -> dict[str, Any]:
    return {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": LAYERS[model], "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 256, "max_position_embeddings": 512,
            "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def model_dir(root: Path, model: str) -> Path:
    d = root / "models" / model
    if not (d / "config.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"config.json.{os.getpid()}"
        tmp.write_text(json.dumps(hf_config(model)))
        tmp.replace(d / "config.json")
    return d


def item_config(item: str, world: int, root: Path):
    """The TrainConfig of a run item (module docstring); the test plans the same one."""
    from shardwise.config.schema import TrainConfig

    model, pp, *rest = item.split("-")
    schedule = rest[-1]
    virtual = int(schedule[len("interleaved"):]) if schedule.startswith("interleaved") else 1
    return TrainConfig.model_validate({
        "name": f"pp-{item}",
        "model": {"path": str(model_dir(root, model)), "random_init": True, "attention": "sdpa"},
        "data": {"kind": "synthetic", "synthetic": {"samples": MICRO * GA * world, "seq_len": SEQ}},
        "strategy": {"name": "fsdp", "pp": int(pp[2:]), "pp_virtual_stages": virtual,
                     "pp_schedule": "interleaved-1f1b" if virtual > 1 else schedule},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.0, "max_grad_norm": 1.0},
        "precision": "fp32",
        "run": {"micro_batch": MICRO, "grad_accum": GA, "device": "cpu", "seed": 0, "nproc": world},
        "logging": {"progress": False, "trackers": []},
        "checkpointing": {"output_dir": str(root / "runs" / item)},
    })


def _micro_batches(step: int, vocab: int) -> list[dict[str, Any]]:
    import torch

    out = []
    for i in range(GA):
        g = torch.Generator().manual_seed(1000 * step + i)
        ids = torch.randint(0, vocab, (MICRO, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _timed(engine, record: list) -> None:
    """Wrap each local stage's forward and backward of one micro-batch (read-only: the call is
    passed through) to append (kind, stage, micro-batch, start, end, CPU time)."""
    for stage in engine.stages:
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            inner = getattr(stage, name)

            def timed(chunk, *args, _inner=inner, _kind=kind, _stage=stage.stage_index, **kwargs):
                t0, c0 = time.monotonic(), time.thread_time()
                out = _inner(chunk, *args, **kwargs)
                record.append((_kind, _stage, chunk, t0, time.monotonic(), time.thread_time() - c0))
                return out

            setattr(stage, name, timed)


def _saved(engine, micro: list[dict[str, Any]], scale: float) -> tuple[int, int]:
    """(peak, left at the end) of the live saved-for-backward bytes over one step's forwards and
    backwards; the batch and every parameter as it is at the moment a tensor is saved (FSDP2's
    gathered ones too) are not counted."""
    from shardwise.bench.census import storage_key
    from shardwise.bench.saved import following_saved

    batch = {storage_key(t)[0] for b in micro for t in b.values()}
    modules = [engine.module, *engine.parts]

    def skip(ptr: int) -> bool:
        return ptr in batch or any((k := storage_key(p)) is not None and k[0] == ptr
                                   for m in modules for p in m.parameters())

    with following_saved(skip) as book:
        engine.forward_backward_step(micro, scale)
    return book.peak, book.live


def measure(item: str, env, out: Path) -> dict[str, Any]:
    import torch.distributed as dist

    from shardwise.bench.census import take_census
    from shardwise.run import run_spec
    from shardwise.train.engines import build_engine
    from shardwise.train.model.build import build_model

    run = run_spec(item_config(item, env.world_size, out), env.world_size, "cpu", environ={})
    engine = build_engine(build_model(run), run, env)
    vocab = run.model.vocab_size
    scale = 1.0 / (GA * MICRO * SEQ)
    record: list = []
    _timed(engine, record)
    result: dict[str, Any] = {"pp_rank": engine.pp_rank, "stages": list(engine.local), "steps": []}
    for step in range(1, STEPS + 1):
        micro = _micro_batches(step, vocab)
        dist.barrier()
        del record[:]
        if step == 2:
            result["saved_peak"], result["saved_left"] = _saved(engine, micro, scale)
            exclude = tuple(t for b in micro for t in b.values())
            result["census"] = take_census(engine.module, engine.optimizer, engine, exclude=exclude).bytes
        else:
            gc.collect()
            gc.disable()  # a collection inside one rank's action would be noise in the timeline
            t0 = time.monotonic()
            engine.forward_backward_step(micro, scale)
            t1 = time.monotonic()
            gc.enable()
            if step > 2:
                result["steps"].append({"start": t0, "end": t1, "actions": sorted(record, key=lambda a: a[3])})
        engine.step()
        engine.zero_grad()
    engine.close()
    return result


def main() -> None:
    from worker_common import start_worker

    runs, env, out = start_worker("<model>-pp<P>[-dp<D>]-<schedule>")
    import torch.distributed as dist

    for item in runs:
        (out / f"{item}.rank{env.rank}.json").write_text(json.dumps(measure(item, env, out)))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # worker_common
    from shardwise.train.launch.rank import run_rank_script

    run_rank_script(main)
