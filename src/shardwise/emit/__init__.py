"""`shardwise plan --emit DIR`: ready-to-run configs for one planned strategy.

Writes shardwise.yaml (the trainer's own config, made by the run bridge's inverse
`shardwise.run.to_config`), ds_config.json + ds_config_hf.json (DeepSpeed strategies: the
builder the trainer's engine uses, `shardwise.run.deepspeed_config`, on that same run),
accelerate.yaml, launch scripts and a README with the plan's memory numbers. Torch-free:
building the dicts is pure, only `emit_configs` touches the disk.

Writing never goes through what is already in the directory, and removes only what an earlier
emit wrote unchanged (shardwise.emit.safe_write: private temp directory, renames, the
`.shardwise-emit.json` record).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from shardwise import strict_json
from shardwise.config.load import PLACEHOLDER
from shardwise.config.schema import TrainConfig
from shardwise.emit.accelerate import DS_HF_FILE, accelerate_config, accelerate_launches, check_emittable
from shardwise.emit.launch import launch_scripts
from shardwise.emit.safe_write import publish, writable_dir
from shardwise.plan.evaluate import memory_as_run
from shardwise.plan.memory import MemoryPlan
from shardwise.run import RunSpec, config_dict, deepspeed_config, run_spec, to_config
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec
from shardwise.specs.hardware import GIB
from shardwise.specs.layer_class import layer_class

__all__ = ["accelerate_config", "deepspeed_config", "emit_configs", "emitted_run"]


def emitted_run(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, *,
                base: TrainConfig | None = None) -> tuple[RunSpec, list[str]]:
    """The run the emitted files describe: the trainer config for the plan (the bridge's
    inverse), read back through the bridge, so every file is built from the run that will train."""
    check_emittable(strategy)
    cfg, notes = to_config(model, hw, train, strategy, base=base, device="cuda")
    # A catalog model round-trips by name; a user's config.json is written as a path for the
    # user to fill in (placeholders), so the emitted run keeps the planned ModelSpec: nothing is
    # read back from that path (whatever the config's directory is called).
    keep = model if cfg.model.path is not None and base is None else None
    run = run_spec(cfg, hw.world_size, "cuda", environ={}, model=keep)
    return run, notes


def emit_configs(
    model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, out_dir: Path,
    *, plan: MemoryPlan | None = None, base: TrainConfig | None = None,
) -> list[Path]:
    """Write every config and script for `strategy` into `out_dir` (created); return the paths."""
    run, notes = emitted_run(model, hw, train, strategy, base=base)
    out_dir = Path(out_dir)
    writable_dir(out_dir)
    plan = plan or memory_as_run(model, hw, train, strategy)
    files: dict[str, tuple[str, bool]] = {}  # name -> (text, executable), written at the end by `publish`

    def write(name: str, text: str, executable: bool = False) -> None:
        files[name] = (text, executable)

    if strategy.engine == "deepspeed":
        write("ds_config.json", strict_json.dumps(deepspeed_config(run), indent=2) + "\n")
        write(DS_HF_FILE, strict_json.dumps(deepspeed_config(run, hf_auto=True), indent=2) + "\n")

    header = "".join(f"# NOTE: {n}\n" for n in notes)
    holes = placeholders(model) if base is None else {}
    write("shardwise.yaml", f"# shardwise train config for {strategy.name} (emitted by `shardwise plan --emit`)\n"
          + ("# Replace the <FILL IN ...> values first (model weights, training files): until then\n"
             "# `shardwise train` refuses this file, naming them.\n" if holes else "")
          + f"# Run: shardwise train shardwise.yaml   (or a launch_*.sh script beside it)\n{header}"
          + trainer_yaml(run.config, holes))  # fmt: skip

    # Portable: no file names the directory it was emitted to. accelerate resolves
    # deepspeed_config_file against the directory it is launched from, so the YAML holds the
    # name and launch_accelerate.sh passes the path beside the script (--deepspeed_config_file).
    # TP and PP run through `shardwise train` only (accelerate_launches).
    accelerate = accelerate_launches(strategy)
    if accelerate:
        acc = accelerate_config(model, hw, train, strategy, ds_config_file=DS_HF_FILE)
        write("accelerate.yaml", yaml.safe_dump(acc, sort_keys=False))

    for name, text in launch_scripts(hw, train, strategy).items():
        if accelerate or name != "launch_accelerate.sh":
            write(name, text, executable=True)

    names = [*files, "README.md"]
    write("README.md", readme(model, hw, train, strategy, plan, names=names, notes=notes, run=run, holes=holes))
    return publish(out_dir, files)


# shardwise's schedule kinds as TrainingArguments' --lr_scheduler_type (transformers SchedulerType)
_HF_SCHEDULER = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup",
                 "warmup_decay": "linear"}

# (field in its section, placeholder value, the comment written above it in shardwise.yaml)
Placeholder = tuple[str, object, str]


def placeholders(model: ModelSpec) -> dict[str, Placeholder]:
    """What `plan --emit` cannot know: the real weights and the training data. Written as
    `<FILL IN ...>` values, which `load_config` refuses by field name: an emitted config used
    unchanged would otherwise train the catalog architecture from random weights on the
    bundled sample data, and look like it worked."""
    return {
        "model": ("path", f"{PLACEHOLDER}: local Hugging Face directory with the {model.name} weights>",
                  f"REQUIRED: the local HF directory of {model.name} (config.json, weights, tokenizer).\n"
                  "Without `path` the trainer builds `name` from RANDOM weights: delete this line only for that."),
        "sft": ("train_files", [f"{PLACEHOLDER}: your JSON/JSONL/Parquet training files (paths or globs)>"],
                "REQUIRED: your SFT data (alpaca, chat, sharegpt or text records; docs/data.md)."),
    }  # fmt: skip


def trainer_yaml(cfg: TrainConfig, holes: dict[str, Placeholder]) -> str:
    """`cfg` as YAML (the bridge's config_dict) with the placeholders set and commented."""
    sw = config_dict(cfg)
    sections = {"model": sw["model"], "sft": sw["data"]["sft"]}
    for section, (key, value, _) in holes.items():
        body = sections[section]
        rest = {k: v for k, v in body.items() if k != key}
        body.clear()
        first = {k: rest.pop(k) for k in ("name",) if k in rest}  # model: path right after name
        body.update({**first, key: value, **rest})
    lines = yaml.safe_dump(sw, sort_keys=False, width=10_000).splitlines()
    for _, (key, _, comment) in holes.items():
        # the key's line: the value is on it, or on the next line (a list's first item)
        i = next(i for i, line in enumerate(lines)
                 if line.lstrip().startswith(f"{key}:") and any(PLACEHOLDER in x for x in lines[i : i + 2]))
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        lines[i:i] = [f"{indent}# {c}" for c in comment.split("\n")]
    return "\n".join(lines) + "\n"


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


def readme(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, plan: MemoryPlan, *,
           names: list[str], notes: list[str], run: RunSpec,
           holes: dict[str, Placeholder] | None = None) -> str:  # fmt: skip
    g, host, lay = plan.gpu, plan.host, plan.layout
    fill = [f"`{'data.sft' if s == 'sft' else s}.{key}`" for s, (key, _, _) in (holes or {}).items()]
    lines = [
        f"# {strategy.name}: {model.name} on {hw.nodes} x {hw.gpus_per_node} {hw.gpu.name}",
        "",
        *([f"**Before training**: set {' and '.join(fill)} in `shardwise.yaml` (they hold `<FILL IN ...>` "
           "placeholders, which `shardwise train` refuses), or pass them with `--set`.", ""] if fill else []),
        (
            f"Emitted by `shardwise plan --emit`. Training setup: sequence {train.seq_len}, micro-batch "
            f"{train.micro_batch}, gradient accumulation {train.grad_accum} (global batch "
            f"{train.micro_batch * train.grad_accum * lay.batch_ranks} sequences), {train.precision}, optimizer "
            f"{train.optimizer}, activation checkpointing {train.checkpointing}. Layout: "
            + (f"tensor-parallel {lay.tp}, " if lay.tp > 1 else "")
            + (f"pipeline-parallel {lay.pp} ({strategy.pp_schedule} schedule over the {train.grad_accum} "
               f"micro-batches of a step" + (f", {strategy.pp_virtual_stages} stages a rank" if
                                             strategy.pp_virtual_stages > 1 else "") + "), " if lay.pp > 1 else "")
            + (f"context-parallel {lay.cp} ({strategy.cp_scheme}; of the data-parallel ranks), " if lay.cp > 1 else "")
            + f"data-parallel {lay.dp} (shard {lay.dp_shard} x replicate {lay.dp_replicate})."
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
            ("gathered parameters", g.gathered_params),
            ("unsharded gradients held between micro-batches", g.held_grads),
            ("reference model", g.ref_params + g.ref_forward),
            ("runtime overhead", g.runtime_overhead),
            ("less: parts not live at the peak", -g.not_at_peak),
        ) if v or k == "runtime overhead"],
        f"| **total** | **{_gib(g.total)}** |",
        "",
        (
            f"GPU capacity {_gib(plan.capacity_bytes)}, usable {_gib(plan.usable_bytes)} after a "
            f"{plan.margin:.0%} margin: **{'fits' if plan.fits else 'does NOT fit'}**."
        ),
    ]
    if host.total:
        lines += ["", f"Host memory per node for offload: {_gib(host.total)} of {_gib(plan.host_capacity_bytes)}."]
    load = host.load
    if load.per_rank:
        lines += ["", f"Host memory while the weights load ({load.path} read of a safetensors checkpoint): "
                      f"{_gib(load.per_rank)} per rank, {_gib(load.per_node)} per node of {load.ranks_per_node} ranks "
                      f"(of {_gib(plan.host_capacity_bytes)})."]
    if notes:
        lines += ["", "## Differences from the plan", "", *[f"- {n}" for n in notes]]
    if plan.runs_as is not None:
        lines += ["", f"A shard group of one rank shards nothing: `shardwise train` runs this as {plan.runs_as.name} "
                      "(the module unwrapped under autocast; no `fully_shard` casts and copies), and the memory above "
                      "is that plan. `accelerate launch` with the FSDP config still runs `fully_shard`; "
                      "`strategy.fsdp.single_rank: fsdp` keeps it in `shardwise train` too."]
    elif strategy.engine == "fsdp2":
        wrap = f"FSDP2 wraps each `{layer_class(model)}`; decoder layers resharded after forward: {strategy.resharding}."
        if strategy.fsdp.reshard_root != "auto":
            wrap += f" The root is {'freed after forward and gathered again for backward' if strategy.reshards_root else 'kept gathered from forward to backward'}."
        if plan.grad_sync is not None:  # the planned gradient sync under accumulation (plan/grad_sync.py)
            wrap += (f" Gradient sync: {plan.grad_sync.line().removeprefix(strategy.name + ': ')}; `shardwise "
                     "train` decides the same on the same memory. accelerate and the HF Trainer hold the unsharded "
                     "grads (`no_sync`) whatever it says.")
        if strategy.resharding in ("not-last", "all") or not strategy.fsdp.wrap_embeddings \
                or strategy.fsdp.reshard_root != "auto":
            wrap += (" `accelerate.yaml` says one bool (`fsdp_reshard_after_forward`), and accelerate (1.14 and "
                     "later) reshards every layer and the embedding after forward and shards the head ([final norm, "
                     "lm_head]) as a unit kept gathered (`shardwise plan --fsdp-reshard-after-forward layers "
                     "--fsdp-wrap-embeddings` plans that run).")
        lines += ["", wrap]
    if strategy.zero_stage == 3:
        unit = strategy.ds.zero3_unit(model.params_per_layer / strategy.tp)
        lines += ["", f"ZeRO-3 fetches each `{layer_class(model)}` whole (`leaf_module`: one fetch and release "
                      "per layer and pass, not one per submodule)." if unit == "layer" else
                      "ZeRO-3 fetches every submodule on its own (DeepSpeed's default): a decoder layer is over "
                      "the gathered-parameter cap to be fetched whole."]
        if unit == "layer" and train.lora_rank:
            lines += ["", "With LoRA, call `model.enable_input_require_grads()` before `deepspeed.initialize` (Trainer "
                          "does with `--gradient_checkpointing`): DeepSpeed reduces a leaf's gradients from a backward "
                          "hook that fires too early on the first layer when the frozen embedding's output needs no grad."]
    if strategy.engine == "deepspeed":
        opt = run.config.optimizer
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
            f"  --learning_rate {opt.lr} --max_grad_norm {opt.max_grad_norm} \\",
            # the planned AdamW: Trainer's own defaults are betas (0.9, 0.999) and weight decay 0
            f"  --adam_beta1 {opt.betas[0]} --adam_beta2 {opt.betas[1]} --adam_epsilon {opt.eps} "
            f"--weight_decay {opt.weight_decay} \\",
            f"  --lr_scheduler_type {_HF_SCHEDULER[run.config.schedule.kind]} --warmup_steps "
            f"{run.config.schedule.warmup_steps} "
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
