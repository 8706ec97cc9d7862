"""Export consolidated weights as a Hugging Face model directory: `model.safetensors`,
`config.json` and the tokenizer, loadable by `AutoModelForCausalLM.from_pretrained` (no code,
no pickles: safetensors only)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from shardwise.train.config import TrainConfig


def export_dir(cfg: TrainConfig) -> Path:
    """Where `save_final` puts the Hugging Face directory: `<output_dir>/model`."""
    return Path(cfg.checkpointing.output_dir) / "model"


def export_hf(cfg: TrainConfig, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """Write the directory under a temp name and rename it when complete: a killed export
    never leaves a directory that looks finished (shardwise.train.outputs.atomic_dir)."""
    from safetensors.torch import save_file

    from shardwise.train.outputs import atomic_dir

    hf_config = _hf_config(cfg)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    # Tied weights appear under two names and safetensors refuses shared storage: keep one
    # name, as transformers' own save_pretrained does (the tie is restored on load).
    tensors = {k: v.contiguous().clone() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    refuse_nonfinite(tensors, out)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _copy_tokenizer(cfg, tmp)
        _umask_modes(tmp)
    return out


def _umask() -> int:
    """This process's umask, read without changing it (Linux /proc), else by setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _umask_modes(d: Path) -> None:
    """safetensors (and PEFT through it) create their files 0600 (a temp file renamed); give them
    the mode every other exported file has, 0666 less the umask (0644 under the usual 022)."""
    mode = 0o666 & ~_umask()
    for f in d.rglob("*.safetensors"):
        if f.is_file() and not f.is_symlink():
            f.chmod(mode)


def export_checkpoint(checkpoint: Path, out: Path, merged: bool = False) -> Path:
    """A Hugging Face directory from any shardwise checkpoint, on one process and without the
    world size or engine that wrote it: the fp32 master weights (`model.*`), the config the
    run was trained with, and its tokenizer. A LoRA checkpoint (adapters only) exports as a
    PEFT adapter, or with `merged` as the base with the adapters merged in."""
    from shardwise.train.checkpoint import read_manifest, read_tensors, tensor_shapes
    from shardwise.train.config import TrainConfig

    manifest = read_manifest(checkpoint)
    cfg = TrainConfig.model_validate({**manifest["config"], "source": str(checkpoint / "manifest.json")})
    keys = [k for k in tensor_shapes(checkpoint) if k.startswith("model.")]
    weights = {k.removeprefix("model."): v for k, v in read_tensors(checkpoint, keys).items()}
    if cfg.lora is not None:
        return export_lora(cfg, weights, out, merged=merged)
    if merged:
        raise ValueError(f"{checkpoint} is a full fine-tuning checkpoint: it has no adapters to merge; "
                         "export it without --merged")
    return export_hf(cfg, weights, out)


def refuse_nonfinite(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """No export holds NaN/Inf weights (NonFiniteError: exit 3, nothing written)."""
    from shardwise.errors import NonFiniteError
    from shardwise.train.checkpoint import nonfinite_tensors

    bad = nonfinite_tensors(tensors)
    if bad:
        raise NonFiniteError(f"{out}: refusing to export non-finite weights ({len(bad)} of {len(tensors)} "
                             f"tensors, e.g. {bad[0]}); nothing was written")


def is_adapter_weight(name: str) -> bool:
    """What a LoRA run trains: PEFT's adapter matrices and `modules_to_save` copies."""
    return ".lora_" in name or ".modules_to_save." in name


def export_final(cfg: TrainConfig, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """`checkpointing.save_final`: the consolidated weights of a full run, or a LoRA run's
    adapter (and, with `lora.save_merged`, the merged model in `<out>-merged`)."""
    if cfg.lora is None:
        return export_hf(cfg, weights, out)
    adapters = {k: v for k, v in weights.items() if is_adapter_weight(k)}
    if cfg.lora.save_merged:
        export_lora(cfg, adapters, out.with_name(out.name + "-merged"), merged=True)
    return export_lora(cfg, adapters, out, merged=False)


def export_lora(cfg: TrainConfig, adapters: dict[str, torch.Tensor], out: Path, merged: bool) -> Path:
    """Through PEFT: the base is rebuilt as training built it (local weights, or the seeded random
    init), in fp32 and unquantised (QLoRA adapters merge into the full-precision base, as PEFT's
    own merge does), wrapped by `peft.get_peft_model` with the run's LoraConfig, and the trained
    adapters are loaded into it (every one, nothing else). Then `save_pretrained` writes PEFT's
    adapter format (adapter_config.json + adapter_model.safetensors), or `merge_and_unload`
    gives the merged weights, written as a Hugging Face model directory."""
    from shardwise.train.outputs import atomic_dir

    refuse_nonfinite(adapters, out)
    pm = _peft_with(cfg, adapters)
    if merged:
        weights = {k: v.detach() for k, v in pm.merge_and_unload().state_dict().items()}
        return export_hf(cfg, weights, out)
    with atomic_dir(out) as tmp:
        pm.save_pretrained(str(tmp), safe_serialization=True)
        _copy_tokenizer(cfg, tmp)
        _umask_modes(tmp)
    return out


def _peft_with(cfg: TrainConfig, adapters: dict[str, torch.Tensor]):
    from shardwise.run import run_spec
    from shardwise.train.lora import peft_model
    from shardwise.train.model import build_model

    assert cfg.lora is not None
    # the base alone, on this process: one CPU rank (the strategy only has to be valid there)
    base_cfg = cfg.model_copy(update={
        "lora": None, "strategy": cfg.strategy.model_copy(update={"name": "ddp", "shard_group": None}),
        "checkpointing": cfg.checkpointing.model_copy(update={"activation": "none"}),
        "run": cfg.run.model_copy(update={"device": "cpu"})})
    base = build_model(run_spec(base_cfg, 1, "cpu", environ={}))  # fp32, unquantised
    pm = peft_model(cfg.lora, base)
    if cfg.model.path:
        pm.peft_config["default"].base_model_name_or_path = str(Path(cfg.model.path).resolve())
    state = {f"base_model.model.{k}": v for k, v in adapters.items()}
    expected = {n for n, p in pm.named_parameters() if p.requires_grad}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"the checkpoint's adapters do not match lora: {cfg.lora.model_dump(mode='json')} "
                         f"({len(missing)} missing, e.g. {sorted(missing)[:1]}; {len(unexpected)} unexpected, "
                         f"e.g. {sorted(unexpected)[:1]})")
    pm.load_state_dict(state, strict=False)
    return pm


def _hf_config(cfg: TrainConfig) -> dict:
    """The model's own config.json (local checkpoint) or the catalog shape's transformers config."""
    if cfg.model.path:
        return json.loads((Path(cfg.model.path) / "config.json").read_text())
    from transformers import AutoConfig

    from shardwise.run import model_spec

    spec = model_spec(cfg)
    # for_model instantiates a built-in config class (CONFIG_MAPPING): it loads no code and takes no
    # trust_remote_code (a keyword would be stored as a field of the exported config.json).
    return AutoConfig.for_model(**spec.to_hf_dict()).to_dict() | {"torch_dtype": "float32"}


def _copy_tokenizer(cfg: TrainConfig, out: Path) -> None:
    """The tokenizer the model was trained with (data.tokenizer, else the model directory's own,
    else the bundled one: shardwise.train.sft_data.resolved_tokenizer_path), so the directory
    is self-contained. Only tokenizer files: a model directory's config.json is not copied over
    the exported one."""
    if cfg.data.kind != "sft":
        return
    from shardwise.data import tokenizer_files
    from shardwise.train.sft_data import resolved_tokenizer_path

    src = Path(resolved_tokenizer_path(cfg))
    for f in tokenizer_files(src):
        dest = out / f.relative_to(src)  # keeps additional_chat_templates/ a directory
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
