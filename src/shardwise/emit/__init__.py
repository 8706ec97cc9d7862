"""`shardwise plan --emit DIR`: ready-to-run configs for one planned strategy.

Writes shardwise.yaml (the trainer's own config, made by the run bridge's inverse
`shardwise.run.to_config`), ds_config.json + ds_config_hf.json (DeepSpeed strategies: the
builder the trainer's engine uses, `shardwise.run.deepspeed_config`, on that same run),
accelerate.yaml, launch scripts and a README with the plan's memory numbers. Torch-free:
building the dicts is pure, only `emit_configs` touches the disk.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import yaml

from shardwise.emit.accelerate import DS_HF_FILE, accelerate_config, check_emittable, layer_class
from shardwise.emit.launch import launch_scripts
from shardwise.plan.memory import MemoryPlan, plan_memory
from shardwise.run import RunSpec, config_dict, deepspeed_config, run_spec, to_config
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec
from shardwise.specs.hardware import GIB
from shardwise.train.config import TrainConfig

__all__ = ["accelerate_config", "deepspeed_config", "emit_configs", "emitted_run"]


def emitted_run(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, *,
                base: TrainConfig | None = None) -> tuple[RunSpec, list[str]]:
    """The run the emitted files describe: the trainer config for the plan (the bridge's
    inverse), read back through the bridge, so every file is built from the run that will train."""
    check_emittable(strategy)
    cfg, notes = to_config(model, hw, train, strategy, base=base, device="cuda")
    run = run_spec(cfg, hw.world_size, "cuda", environ={})
    # A catalog model round-trips by name; a user's config.json is written as a placeholder
    # path, so the emitted run keeps the planned ModelSpec.
    if cfg.model.path is not None and base is None:
        run = replace(run, model=model)
    return run, notes


def emit_configs(
    model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, out_dir: Path,
    *, plan: MemoryPlan | None = None, base: TrainConfig | None = None,
) -> list[Path]:
    """Write every config and script for `strategy` into `out_dir` (created); return the paths."""
    run, notes = emitted_run(model, hw, train, strategy, base=base)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = out_dir.resolve()
    plan = plan or plan_memory(model, hw, train, strategy)
    written: list[Path] = []

    def write(name: str, text: str, executable: bool = False) -> None:
        path = out_dir / name
        path.write_text(text)
        if executable:
            path.chmod(0o755)
        written.append(path)

    if strategy.engine == "deepspeed":
        write("ds_config.json", json.dumps(deepspeed_config(run), indent=2) + "\n")
        write(DS_HF_FILE, json.dumps(deepspeed_config(run, hf_auto=True), indent=2) + "\n")

    sw = config_dict(run.config)
    header = "".join(f"# NOTE: {n}\n" for n in notes)
    write("shardwise.yaml", f"# shardwise train config for {strategy.name} (emitted by `shardwise plan --emit`)\n"
          f"# Run: shardwise train shardwise.yaml   (or a launch_*.sh script beside it)\n{header}"
          + yaml.safe_dump(sw, sort_keys=False))  # fmt: skip

    # An absolute path: accelerate resolves deepspeed_config_file against the launch directory.
    acc = accelerate_config(model, hw, train, strategy, ds_config_file=str(root / DS_HF_FILE))
    write("accelerate.yaml", yaml.safe_dump(acc, sort_keys=False))

    for name, text in launch_scripts(hw, train, strategy, str(root)).items():
        write(name, text, executable=True)

    names = [p.name for p in written] + ["README.md"]
    write("README.md", readme(model, hw, train, strategy, plan, names, notes, run))
    return written


def _nodes(hw: HardwareSpec) -> str:
    return f"--num_nodes {hw.nodes} --hostfile hostfile " if hw.nodes > 1 else ""


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB"


_FILES = {
    "ds_config.json": "DeepSpeed config with every value concrete: `deepspeed your_train.py --deepspeed_config ds_config.json`, or `deepspeed.initialize(config=...)`.",
    DS_HF_FILE: "The same for Hugging Face Trainer: batch, optimizer, scheduler, precision and clipping are `\"auto\"` and come from `TrainingArguments`; the ZeRO knobs stay the planned ones.",
    "shardwise.yaml": "shardwise's own trainer config: `shardwise train shardwise.yaml`.",
    "accelerate.yaml": "`accelerate launch --config_file accelerate.yaml` config (DeepSpeed via ds_config_hf.json, FSDP2, or multi-GPU DDP).",
    "launch_torchrun.sh": "torchrun on every node (c10d rendezvous at `$MASTER_ADDR:$MASTER_PORT`).",
    "launch_deepspeed.sh": "The `deepspeed` launcher, run on node 0 (multi-node: `HOSTFILE` with `host slots=N` lines).",
    "launch_accelerate.sh": "`accelerate launch` with accelerate.yaml; no arguments = shardwise's trainer, or pass your own script.",
    "slurm.sbatch": "`sbatch slurm.sbatch`: one task per node running torchrun, MASTER_ADDR from `scontrol show hostnames`.",
    "README.md": "This file.",
}  # fmt: skip


def readme(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, plan: MemoryPlan,
           names: list[str], notes: list[str], run: RunSpec) -> str:  # fmt: skip
    g, host, lay = plan.gpu, plan.host, plan.layout
    lines = [
        f"# {strategy.name}: {model.name} on {hw.nodes} x {hw.gpus_per_node} {hw.gpu.name}",
        "",
        (
            f"Emitted by `shardwise plan --emit`. Training setup: sequence {train.seq_len}, micro-batch "
            f"{train.micro_batch}, gradient accumulation {train.grad_accum} (global batch "
            f"{train.micro_batch * train.grad_accum * lay.dp} sequences), {train.precision}, optimizer "
            f"{train.optimizer}, activation checkpointing {train.checkpointing}. Layout: data-parallel "
            f"{lay.dp} (shard {lay.dp_shard} x replicate {lay.dp_replicate})."
        ),
        "",
        "## Files",
        "",
        *[f"- `{n}`: {_FILES[n]}" for n in names],
        "",
        "## Planned memory (per GPU, at the step's peak)",
        "",
        "| part | bytes |",
        "|---|---|",
        *[f"| {k} | {_gib(v)} |" for k, v in (
            ("parameters", g.params), ("gradients", g.grads), ("fp32 master parameters", g.master_params),
            ("optimizer states", g.optimizer_states), ("optimizer-step buffers", g.step_buffers),
            ("activations", g.activations + g.recompute), ("logits", g.logits),
            ("engine buffers", g.engine_buffers), ("gradient buffers", g.grad_buffers),
            ("runtime overhead", g.runtime_overhead),
        )],
        f"| **total** | **{_gib(g.total)}** |",
        "",
        (
            f"GPU capacity {_gib(plan.capacity_bytes)}, usable {_gib(plan.usable_bytes)} after a "
            f"{plan.margin:.0%} margin: **{'fits' if plan.fits else 'does NOT fit'}**."
        ),
    ]
    if host.total:
        lines += ["", f"Host memory per node for offload: {_gib(host.total)} of {_gib(plan.host_capacity_bytes)}."]
    if notes:
        lines += ["", "## Differences from the plan", "", *[f"- {n}" for n in notes]]
    if strategy.engine == "fsdp2":
        wrap = f"FSDP2 wraps each `{layer_class(model)}`; reshard after forward: {strategy.reshard_after_forward}."
        lines += ["", wrap]
    if strategy.engine == "deepspeed":
        lines += [
            "",
            "## Hugging Face Trainer with `ds_config_hf.json`",
            "",
            (
                "Pass the file to `TrainingArguments(deepspeed=\"ds_config_hf.json\", ...)` or "
                "`--deepspeed ds_config_hf.json` on the command line of a Trainer script, and launch it "
                "with `deepspeed`, `torchrun` or `accelerate launch`. Trainer fills every `\"auto\"` from "
                "its arguments, so set them to the planned values:"
            ),
            "",
            "```bash",
            f"deepspeed {_nodes(hw)}--num_gpus {hw.gpus_per_node} train_sft.py --deepspeed ds_config_hf.json \\",
            f"  --per_device_train_batch_size {train.micro_batch} --gradient_accumulation_steps {train.grad_accum} \\",
            f"  --learning_rate {run.config.optimizer.lr} --max_grad_norm {run.config.optimizer.max_grad_norm} "
            + {"bf16": "--bf16", "fp16": "--fp16", "fp32": ""}[train.compute_dtype]
            + (" --gradient_checkpointing" if train.checkpointing != "none" else ""),
            "```",
            "",
            (
                "Activation checkpointing is the model's setting (`--gradient_checkpointing`), not "
                "DeepSpeed's. The planned micro-batch and accumulation only hold if the Trainer "
                "arguments match them."
            ),
        ]  # fmt: skip
    return "\n".join(lines).rstrip() + "\n"
