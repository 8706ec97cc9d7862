"""One rank of the pipeline-parallel runs: trains every requested run in turn (as parity_worker).

Run items: `model:strategy:grad_accum[:flag...]`, parity_worker's flags plus `pp<N>` (strategy.pp),
`gpipe` / `interleaved<V>` (the schedule; 1F1B otherwise), `save<K>` (a checkpoint every K steps),
`resume<K>` (resume from the same item's step-K checkpoint written by an earlier run, named by
`from=<item>`). Models: `pp-llama` (Llama, MHA) and `pp-qwen2` (Qwen2, GQA 4:2, q/k/v biases,
untied), 4 decoder layers each, built from a config.json this worker writes (random weights).
Rank 0 writes `<item>-w<world>.pt`: the loss curve, grad norms and the consolidated final weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from parity_worker import parity_config
from worker_common import start_worker

from shardwise.run import run_spec
from shardwise.train.launch.rank import run_rank_script
from shardwise.train.loop import train

CONFIGS = {
    "pp-llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "intermediate_size": 176, "vocab_size": 2048,
                 "max_position_embeddings": 2048, "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    "pp-qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 2048,
                 "max_position_embeddings": 2048, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
}


def model_dir(root: Path, model: str) -> Path:
    d = root / "models" / model
    if not (d / "config.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"config.json.{torch.distributed.get_rank()}"
        tmp.write_text(json.dumps(CONFIGS[model]))
        tmp.replace(d / "config.json")
    return d


def pipeline_config(item: str, world: int, root: Path):
    model, strategy, ga, *flags = item.split(":")
    pp = next((int(f[2:]) for f in flags if f.startswith("pp") and f[2:].isdigit()), 1)
    tp = next((int(f[2:]) for f in flags if f.startswith("tp") and f[2:].isdigit()), 1)
    virtual = next((int(f[11:]) for f in flags if f.startswith("interleaved")), 1)
    # parity_config splits the global batch over world / tp data ranks; pipeline ranks share one
    base = parity_config(strategy, world // pp, int(ga), "tiny-llama", tuple(f for f in flags if not f.startswith("pp")))
    raw = base.model_dump(exclude={"source"})
    raw["model"] |= {"name": None, "path": str(model_dir(root, model)), "random_init": True}
    if raw["data"]["kind"] == "sft":  # the bundled tokenizer, as the catalog models' runs take it
        import shardwise

        raw["data"]["tokenizer"] = str(Path(shardwise.__file__).parent / "assets" / "tokenizer")
    raw["strategy"] |= {"pp": pp, "pp_schedule": "gpipe" if "gpipe" in flags else
                        "interleaved-1f1b" if virtual > 1 else "1f1b", "pp_virtual_stages": virtual}
    raw["strategy"]["tp"] = tp
    save = next((int(f[4:]) for f in flags if f.startswith("save")), None)
    raw["checkpointing"] |= {"output_dir": str(root / "runs" / item.replace(":", "-")), "save_every_steps": save}
    from shardwise.config.schema import TrainConfig

    return TrainConfig.model_validate(raw)


def main() -> None:
    runs, env, out = start_worker("model:strategy:ga[:flag...]")
    for item in runs:
        cfg = pipeline_config(item, env.world_size, out)
        run = run_spec(cfg, env.world_size, "cpu")
        res = train(run, env, export_weights=True)
        if env.is_main:
            record = {"losses": res.losses, "grad_norms": [r.grad_norm for r in res.records],
                      "layout": run.layout.model_dump()}
            torch.save(record | {"weights": res.final_weights}, out / f"{item.replace(':', '-')}-w{env.world_size}.pt")
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
