"""The resume checks, run once before any rank starts (after shardwise.train.preflight's launch,
data and memory checks): which checkpoint `checkpointing.resume` names, its manifest verified,
and that it belongs to this config: the same model, tensor for tensor and shape for shape, the
same LoRA adapters on the same base, a step not past `run.steps`. Refused here with one message
naming the field, instead of as a shape error in every rank's load (the checkpoint's format:
shardwise.train.checkpoint.sharded)."""

from __future__ import annotations

from pathlib import Path

from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.run import RunSpec


def resolve_checkpoint(cfg: TrainConfig, run: RunSpec, verify_hashes: bool = True) -> Path | None:
    """The checkpoint to resume from: `checkpointing.resume` resolved and its manifest verified
    (sizes, and sha256 when `verify_hashes`) before any rank starts. None: start fresh."""
    cp = cfg.checkpointing
    if cp.resume is None:  # a fresh run: the launcher needs no torch (seconds of start-up)
        return None
    from shardwise.train.checkpoint.sharded import resolve_resume

    resume = resolve_resume(cp.resume, cp.output_dir, verify_hashes=verify_hashes)
    if cp.resume == "latest" and resume is None:
        print(f"shardwise: --resume latest: no checkpoint under {cp.output_dir}/checkpoints yet; starting at step 0")
    if resume is not None:
        check_resumable(cfg, run, resume)
    return resume


def check_resumable(cfg: TrainConfig, run: RunSpec, checkpoint: Path) -> None:
    """Refuse a checkpoint of another model (its tensors would not fit this one) and say what a
    changed global batch or master dtype means; engine, world size and precision may change
    freely (a bf16-pure checkpoint's bf16 tensors load widened into fp32 masters, an fp32 one's
    rounded into bf16-pure's parameters: `precision_note`)."""
    from shardwise.train.checkpoint.directory import read_manifest_json

    manifest = read_manifest_json(checkpoint)
    saved = manifest["config"]
    check_saved_config(saved, checkpoint)
    old_model = {k: (saved.get("model") or {}).get(k) for k in ("name", "path")}
    new_model = {"name": cfg.model.name, "path": cfg.model.path}
    if (old_model["path"] or old_model["name"]) != (new_model["path"] or new_model["name"]):
        raise ShardwiseError(
            f"{cfg.source}: model {new_model['path'] or new_model['name']!r} cannot resume {checkpoint}, which "
            f"holds {old_model['path'] or old_model['name']!r}; use the checkpoint's model or another output_dir"
        )
    check_same_adapters(cfg, saved, checkpoint)
    check_same_optimizer(cfg, saved, checkpoint)
    check_same_shapes(cfg, run, checkpoint)
    if manifest["step"] > cfg.run.steps:
        raise ShardwiseError(f"{cfg.source}: run.steps = {cfg.run.steps}, but {checkpoint} is already at step "
                             f"{manifest['step']}; raise run.steps to train on")
    note = precision_note(run, checkpoint, saved.get("precision"))
    if note:
        print(f"shardwise: {note}")
    r = saved.get("run") or {}
    old_tp = int((saved.get("strategy") or {}).get("tp", 1) or 1)
    old_batch = r.get("micro_batch", 0) * r.get("grad_accum", 0) * (manifest.get("world_size", 0) // old_tp)
    new_batch = cfg.run.micro_batch * cfg.run.grad_accum * run.layout.dp
    if old_batch != new_batch:
        print(f"shardwise: resuming {checkpoint} with a global batch of {new_batch} sequences (it was trained with "
              f"{old_batch}): the data continues from the same sample, the curve is not the uninterrupted one")


def check_same_shapes(cfg: TrainConfig, run: RunSpec, checkpoint: Path) -> None:
    """The checkpoint's tensors (`model.<name>`, from its index alone) are the ones the config
    builds, name for name and shape for shape: a `model.path` whose config.json changed since
    the save (another width, depth or vocabulary) is refused here, naming the first tensor that
    differs, instead of failing in every rank's load."""
    from shardwise.train.checkpoint.sharded import tensor_shapes
    from shardwise.train.model.build import trainable_shapes

    saved = {k.removeprefix("model."): s for k, (s, _) in tensor_shapes(checkpoint).items() if k.startswith("model.")}
    built = trainable_shapes(run)
    model = f"model.path {cfg.model.path!r}" if cfg.model.path else f"model.name {cfg.model.name!r}"
    fix = "resume with the model it was trained with, or start a fresh run in another checkpointing.output_dir"
    for name, shape in built.items():
        if name not in saved:
            raise ShardwiseError(f"{cfg.source}: {model} cannot resume {checkpoint}: the model has tensor {name!r} "
                                 f"{list(shape)}, which the checkpoint does not hold ({len(saved)} tensors, the "
                                 f"model {len(built)}); {fix}")
        if tuple(saved[name]) != shape:
            raise ShardwiseError(f"{cfg.source}: {model} cannot resume {checkpoint}: tensor {name!r} is "
                                 f"{list(shape)} in the model this config builds but {list(saved[name])} in the "
                                 f"checkpoint (the model's shape changed since it was saved); {fix}")
    extra = [k for k in saved if k not in built]
    if extra:
        raise ShardwiseError(f"{cfg.source}: {model} cannot resume {checkpoint}: the checkpoint holds tensor "
                             f"{extra[0]!r} {list(saved[extra[0]])}, which the model does not have ({len(extra)} "
                             f"such); {fix}")


def precision_note(run: RunSpec, checkpoint: Path, saved_precision: object = None) -> str | None:
    """What resuming does to the weights and AdamW moments when the checkpoint holds them in
    another dtype than this run's master dtype (DCP casts each tensor as it loads it): bf16-pure
    from a mixed-precision or fp32 checkpoint rounds the fp32 values to bf16 (the digits below
    bf16's resolution are dropped); the other way widens bf16 to fp32 exactly. None: same dtype."""
    import torch

    from shardwise.train.checkpoint.sharded import tensor_shapes

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    held = {d for k, (_, d) in tensor_shapes(checkpoint).items() if k.startswith("model.")}
    want = run.train.master_dtype
    if not held or {names.get(d) for d in held} == {want}:
        return None
    was = ", ".join(sorted(names.get(d, str(d)) for d in held))
    by = f" (precision {saved_precision})" if isinstance(saved_precision, str) else ""
    now = f"precision {run.config.precision}"
    if want == "bf16":
        return (f"{checkpoint} holds {was} weights and AdamW moments{by}; {now} loads them rounded to bf16, so the run "
                "continues from the rounded values (not the curve the checkpoint's precision would have given)")
    return (f"{checkpoint} holds {was} weights and AdamW moments{by}; {now} loads them widened to {want} (exactly) "
            f"and keeps {want} master weights from here on")


def check_saved_config(saved: dict, checkpoint: Path) -> None:
    """The manifest's config, as far as resuming reads it: sections are objects and the counts
    are integers (a manifest is no signature: `"micro_batch": "x" * ...` must not reach arithmetic)."""
    where = f"{checkpoint / 'manifest.json'}: field 'config"
    for name in ("model", "run", "strategy", "lora", "optimizer"):
        if saved.get(name) is not None and not isinstance(saved[name], dict):
            raise ShardwiseError(f"{where}.{name}': expected an object, got {type(saved[name]).__name__}")
    for section, key in (("run", "micro_batch"), ("run", "grad_accum"), ("run", "seed"), ("strategy", "tp")):
        v = (saved.get(section) or {}).get(key)
        if v is not None and type(v) is not int:
            raise ShardwiseError(f"{where}.{section}.{key}': expected an integer, got {v!r}")
    for section, key in (("model", "name"), ("model", "path"), ("optimizer", "name")):
        v = (saved.get(section) or {}).get(key)
        if v is not None and not isinstance(v, str):
            raise ShardwiseError(f"{where}.{section}.{key}': expected a string, got {v!r}")


# What each optimizer.name keeps per moment: a checkpoint holds its states in that form
_STATES = {"adamw": "fp32 moments", "adamw8bit": "torchao's 8-bit codes and scales",
           "adamw4bit": "torchao's 4-bit codes and scales", "paged_adamw8bit": "bitsandbytes' 8-bit codes and scales"}


def check_same_optimizer(cfg: TrainConfig, saved: dict, checkpoint: Path) -> None:
    """A checkpoint resumes with the optimizer.name it was trained with: its moments are that
    optimizer's (fp32, or one library's quantized codes and scales: shardwise.train.engines.
    low_bit), and another's would start from states it did not write. A manifest without the
    field was written by adamw, the only optimizer before the low-bit ones."""
    old = (saved.get("optimizer") or {}).get("name") or "adamw"
    new = cfg.optimizer.name
    if old != new:
        raise ShardwiseError(
            f"{cfg.source}: optimizer.name = {new!r}, but {checkpoint} was trained with {old!r} and holds its "
            f"optimizer states ({_STATES.get(old, 'another optimizer')}), not {new!r}'s "
            f"({_STATES.get(new, new)}); resume with optimizer.name: {old}, or start a fresh run in another "
            "checkpointing.output_dir")


def check_same_adapters(cfg: TrainConfig, saved: dict, checkpoint: Path) -> None:
    """A LoRA checkpoint holds adapters only: it resumes a run with the same adapters on the same
    base. Refuse full ↔ LoRA, another rank/targets/modules_to_save, and (for a base built from the
    seeded random init rather than weights on disk) another run.seed."""
    old, new = saved.get("lora"), cfg.lora.model_dump(mode="json") if cfg.lora is not None else None
    if (old is None) != (new is None):
        held = "LoRA adapters only" if old is not None else "a full fine-tuning state"
        raise ShardwiseError(f"{cfg.source}: lora is {'set' if new else 'not set'}, but {checkpoint} holds {held}; "
                             "resume it with the same lora section it was trained with")
    if old is None:
        return
    shape = ("rank", "target_modules", "modules_to_save", "quantization")
    diff = [k for k in shape if old.get(k) != new[k]]
    if diff:
        raise ShardwiseError(f"{cfg.source}: lora.{diff[0]} = {new[diff[0]]!r}, but {checkpoint} was trained with "
                             f"{old.get(diff[0])!r}; its adapters fit only that shape")
    random_base = cfg.model.path is None or cfg.model.random_init
    old_seed = (saved.get("run") or {}).get("seed")
    if random_base and old_seed != cfg.run.seed:
        raise ShardwiseError(f"{cfg.source}: run.seed = {cfg.run.seed}, but {checkpoint} trained adapters on the "
                             f"base built from seed {old_seed} (random init); resume with run.seed: {old_seed}")
