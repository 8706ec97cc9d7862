"""Regenerate benchmarks/results/measured_model_states.json and measured_activations.json.

    python benchmarks/measure_memory.py            # both
    python benchmarks/measure_memory.py states     # model states only (2 gloo processes, ~1 min)
    python benchmarks/measure_memory.py activations

CPU only; the numbers are bytes per rank (model states) and saved-for-backward bytes
(activations) as shardwise.bench measures them. The planner is never consulted here.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _versions() -> dict[str, str]:
    import deepspeed
    import torch
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def model_states() -> dict:
    from shardwise.bench import worker

    psi = worker.model_params()
    unit = 4 * psi  # P: one fp32 copy of the model
    runs = worker.measure_model_states(worker.STRATEGIES)
    out: dict = {
        "what": "bytes held per rank after backward of step 2 (and after step 2), by census category; "
                "2 processes, gloo, CPU, fp32, AdamW (torch), see src/shardwise/bench/census.py",
        "psi": psi, "P_bytes": unit, "world_size": worker.WORLD,
        "seq_len": worker.SEQ, "micro_batch": worker.BATCH,
        "model": {"model_type": "llama", **worker.TINY_LLAMA},
        # every run is the trainer's engine (build_engine) on this config, through the run bridge
        "configs": {v: worker.bench_config(v).model_dump(mode="json") for v in worker.STRATEGIES},
        "deepspeed_config": {v: worker.ds_config(v) for v in worker.STRATEGIES if v.startswith("zero")},
        "versions": _versions(),
        "strategies": {},
    }
    for name, ranks in runs.items():
        out["strategies"][name] = [
            {
                "rank": r["rank"],
                "after_backward": r["after_backward"],
                "after_step": r["after_step"],
                "after_backward_in_P": {k: round(v / unit, 5) for k, v in r["after_backward"].items()},
                "after_step_in_P": {k: round(v / unit, 5) for k, v in r["after_step"].items()},
                "largest_storages_after_backward": r["top_after_backward"],
            }
            for r in ranks
        ]
    return out


def activations() -> dict:
    from shardwise.bench import saved

    # saved.loss_side_bytes builds every shape with sdpa, which transformers refuses where it has
    # no SDPA path (Gemma2, MPT): run each shape with an attention it has (saved.attentions).
    build = saved.build_model

    def runnable(shape, layers, precision, attention, checkpointing, reentrant=False):
        if attention not in saved.attentions(shape):
            attention = saved.attentions(shape)[0]
        return build(shape, layers, precision, attention, checkpointing, reentrant=reentrant)

    saved.build_model = runnable
    try:
        out = saved.measure_all()
    finally:
        saved.build_model = build
    eager_only = [name for name in saved.SHAPES if "sdpa" not in saved.attentions(name)]
    out["loss_side"]["what"] += f" (eager for the shapes without sdpa: {', '.join(eager_only)})"
    # Record each shape's real head width: an explicit head_dim (gemma's 48, qwen3's 32) is not
    # hidden // heads, and MLA (deepseek_v3) has its own qk_nope/qk_rope/v head dims instead.
    shapes = {}
    for name, v in saved.SHAPES.items():
        shapes[name] = dict(v)
        if "head_dim" not in v and "qk_nope_head_dim" not in v:
            shapes[name]["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    out["shapes"] = shapes
    return out


def main(argv: list[str]) -> None:
    which = argv[1:] or ["states", "activations"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    if "states" in which:
        (RESULTS / "measured_model_states.json").write_text(json.dumps(model_states(), indent=1) + "\n")
    if "activations" in which:
        (RESULTS / "measured_activations.json").write_text(json.dumps(activations(), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv)
