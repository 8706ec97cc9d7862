"""Export consolidated weights as a Hugging Face model directory: safetensors (one
`model.safetensors`, or `model-0000i-of-0000N.safetensors` shards with a
`model.safetensors.index.json`), `config.json` and the tokenizer, loadable by
`AutoModelForCausalLM.from_pretrained` (no code, no pickles: safetensors only).

The weights are written in `export.dtype` (default: the run's compute dtype), one shard at a
time: a shard's tensors are fetched (read from a checkpoint or a run's final weights, or a LoRA
run's base read from its files with the adapters merged in), cast, written and dropped before the
next, so the host holds about one shard beyond what it already had. A LoRA adapter is written
from the adapter tensors alone (PEFT's format; the base is built on the meta device only)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from shardwise import strict_json
from shardwise.config.schema import EXPORT_DTYPE_OF_PRECISION, TrainConfig
from shardwise.train.launch.host_alloc import large_allocations_returned

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# name -> (shape, dtype) of the tensors to write; a reader gives the named tensors (any float dtype)
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
Reader = Callable[[list[str]], dict[str, torch.Tensor]]
Progress = Callable[[], None] | None  # called as an export moves on (a watchdog's heartbeat)


def export_dir(cfg: TrainConfig) -> Path:
    """Where `save_final` puts the Hugging Face directory: `<output_dir>/model`."""
    return Path(cfg.checkpointing.output_dir) / "model"


def export_dtype(cfg: TrainConfig) -> torch.dtype:
    """`export.dtype`, `auto` being the dtype the run computes in (its `precision`)."""
    name = cfg.export.dtype
    return TORCH_DTYPES[EXPORT_DTYPE_OF_PRECISION[cfg.precision] if name == "auto" else name]


def export_hf(cfg: TrainConfig, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """Consolidated weights held in memory: through
    `write_hf`, so the cast copies are made one shard at a time, never of the whole model."""
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
    return write_hf(cfg, shapes, lambda names: {k: weights[k] for k in names}, out)


def write_hf(cfg: TrainConfig, shapes: Shapes, read: Reader, out: Path, progress: Progress = None) -> Path:
    """Write the Hugging Face directory under a temp name and rename it when complete: a killed
    export never leaves a directory that looks finished (shardwise.train.outputs.atomic_dir).

    The shards are planned from the shapes alone by huggingface_hub's splitter (the one
    transformers' save_pretrained uses: names in order, a new file when the next tensor would
    pass `export.max_shard_size`, a larger tensor in a file of its own, one `model.safetensors`
    and no index when all fit in one). Then per shard: `read` its tensors, cast them to the
    export dtype, refuse NaN/Inf (also an fp32 value that overflows fp16), `save_file`, drop.
    `progress` is called after each read group and each shard written: a long export keeps
    telling the run's watchdog (shardwise.train.launch.watchdog) that it moves on."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    from shardwise.train.outputs import atomic_dir

    dtype = export_dtype(cfg)
    hf_config = _hf_config(cfg, dtype)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    # Tied weights appear under two names and safetensors refuses shared storage: keep one
    # name, as transformers' own save_pretrained does (the tie is restored on load).
    names = {k: v for k, v in shapes.items() if not (tied and k == "lm_head.weight")}
    itemsize = torch.empty((), dtype=dtype).element_size()
    split = split_state_dict_into_shards_factory(
        names, get_storage_size=lambda s: _numel(s[0]) * itemsize,
        filename_pattern="model{suffix}.safetensors", max_shard_size=cfg.export.max_shard_bytes)
    need = sum(_numel(shape) * itemsize for shape, _ in names.values())
    with atomic_dir(out) as tmp, disk_full_is(out, need, tmp):
        for filename, keys in split.filename_to_tensors.items():
            shard: dict[str, torch.Tensor] = {}
            for group in _groups(keys, names, cfg.export.max_shard_bytes // 2):
                shard |= _cast(read(group), group, dtype)
                if progress is not None:
                    progress()
            refuse_nonfinite(shard, out, dtype)
            save_file(shard, str(tmp / filename), metadata={"format": "pt"})
            del shard
            if progress is not None:
                progress()
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / INDEX_FILE).write_text(strict_json.dumps(index, indent=2, sort_keys=True) + "\n")
        (tmp / "config.json").write_text(strict_json.dumps(hf_config, indent=2) + "\n")
        _copy_tokenizer(cfg, tmp)
        _umask_modes(tmp)
    return out


@contextmanager
def disk_full_is(out: Path, need: int, tmp: Path) -> Iterator[None]:
    """An export's write that finds the disk (or quota) full raises OutOfSpaceError (exit 74)
    naming `out`, the bytes the export needs and those free at the failure (measured before the
    temp directory `tmp` is removed). Out of space: ENOSPC/EDQUOT anywhere in the exception's
    causes, safetensors' "No space left on device" (its Rust error has no errno), or less free than
    the export needs. Anything else passes through unchanged."""
    try:
        yield
    except Exception as e:
        from shardwise.errors import NonFiniteError, OutOfSpaceError
        from shardwise.train.checkpoint.save_failure import causes, free_bytes, space_errno
        from shardwise.train.outputs import size_text

        if isinstance(e, (NonFiniteError, OutOfSpaceError)):
            raise
        free = free_bytes(tmp if tmp.exists() else out.parent)
        full = space_errno([], e) or any("No space left" in str(x) or "os error 28" in str(x) for x in causes(e))
        if not (full or free < need):
            raise
        raise OutOfSpaceError(
            f"{out}: the export ran out of disk space (it needs about {size_text(need)}, {size_text(free)} were "
            f"free on {out.parent}); nothing was exported and the checkpoints are intact. Free space and export "
            f"the last checkpoint with `shardwise export`. ({type(e).__name__}: {str(e).strip()[:200]})",
            path=str(out), need_bytes=need, free_bytes=free) from e


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _groups(keys: list[str], shapes: Shapes, budget: int) -> list[list[str]]:
    """A shard's keys in reads of at most `budget` source bytes (a larger tensor alone): the fp32
    tensors read from a checkpoint are half a shard at a time beside the shard's cast copies."""
    out: list[list[str]] = [[]]
    size = 0
    for k in keys:
        shape, dtype = shapes[k]
        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if out[-1] and size + n > budget:
            out.append([])
            size = 0
        out[-1].append(k)
        size += n
    return [g for g in out if g]


def _cast(tensors: dict[str, torch.Tensor], keys: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Own contiguous copies in `dtype` (safetensors refuses tensors sharing storage, and a
    caller's tensors are never aliased into the file), each source dropped once copied: a
    shard read from a checkpoint goes from fp32 to the export dtype without both whole copies."""
    out = {}
    for k in keys:
        t = tensors.pop(k)
        out[k] = t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        del t
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
    for f in [*d.rglob("*.safetensors"), *d.rglob("*.safetensors.index.json")]:
        if f.is_file() and not f.is_symlink():
            f.chmod(mode)


@large_allocations_returned()  # each streamed tensor from 1 MiB up is returned when freed
def export_checkpoint(checkpoint: Path, out: Path, merged: bool = False, overrides: tuple[str, ...] = (),
                      trust_remote_code: bool = False) -> Path:
    """A Hugging Face directory from any shardwise checkpoint, on one process and without the
    world size or engine that wrote it: the fp32 master weights (`model.*`) in `export.dtype`,
    the config the run was trained with, and its tokenizer. A LoRA checkpoint (adapters only)
    exports as a PEFT adapter, or with `merged` as the base with the adapters merged in.
    `overrides` are `export.*` assignments (`export.dtype=fp32`) applied to the run's config.
    Whether a base model's own code may run is the caller's `trust_remote_code`, never the
    manifest's (whoever can write a checkpoint directory can write its manifest)."""
    from shardwise.train.checkpoint.sharded import read_manifest

    manifest = read_manifest(checkpoint)
    cfg = _checkpoint_config(manifest["config"], checkpoint / "manifest.json", overrides)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"trust_remote_code": trust_remote_code})})
    if cfg.lora is not None and cfg.model.path:  # the base is rebuilt from model.path: refuse its code first
        from shardwise.train.model.build import check_model_source

        check_model_source(cfg.model, str(checkpoint / "manifest.json"),
                           opt_in="pass --trust-remote-code to shardwise export")
    if cfg.lora is not None:  # adapters only: small
        return export_lora(cfg, read_model_weights(checkpoint), out, merged=merged)
    if merged:
        raise ValueError(f"{checkpoint} is a full fine-tuning checkpoint: it has no adapters to merge; "
                         "export it without --merged")
    return export_dcp(cfg, checkpoint, out)


def export_dcp(cfg: TrainConfig, path: Path, out: Path, progress: Progress = None) -> Path:
    """The `model.*` tensors of a DCP directory (a checkpoint, or a run's final weights) through
    `write_hf`, read shard by shard (`read_tensors` of one read group's keys): the host holds a
    read group's fp32 tensors (twice while DCP copies each item into ours), the shard's cast
    copies and safetensors' bytes of them, never the model (tests/train/test_final_export.py)."""
    from shardwise.train.checkpoint.sharded import read_tensors, tensor_shapes

    shapes = {k.removeprefix("model."): v for k, v in tensor_shapes(path).items() if k.startswith("model.")}

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        got = read_tensors(path, [f"model.{k}" for k in names])
        return {k.removeprefix("model."): v for k, v in got.items()}

    return write_hf(cfg, shapes, read, out, progress)


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every `model.*` tensor of a DCP directory at once (a LoRA run's adapters: small)."""
    from shardwise.train.checkpoint.sharded import read_tensors, tensor_shapes

    keys = [k for k in tensor_shapes(path) if k.startswith("model.")]
    return {k.removeprefix("model."): v for k, v in read_tensors(path, keys).items()}


def _checkpoint_config(raw: dict, source: Path, overrides: tuple[str, ...]) -> TrainConfig:
    """The run's TrainConfig from its manifest, with `--set export.*` applied (only those: the
    model, data and training of a checkpoint are what they were)."""
    import copy

    from shardwise.config.load import apply_override, validate
    from shardwise.errors import ShardwiseError

    raw = copy.deepcopy(raw)
    for o in overrides:
        key = o.split("=", 1)[0].strip()
        if not key.startswith("export.") or key == "export.":
            raise ShardwiseError(f"--set {o!r}: only export.* settings can be changed when exporting a "
                                 "checkpoint (export.dtype=auto|bf16|fp16|fp32, export.max_shard_size=5GB); "
                                 "the model and training are the checkpoint's")
        apply_override(raw, o)
    return validate(raw, str(source) + (" (after the --set overrides)" if overrides else ""))


def refuse_nonfinite(tensors: dict[str, torch.Tensor], out: Path, dtype: torch.dtype | None = None) -> None:
    """No export holds NaN/Inf weights (NonFiniteError: exit 3, nothing written). With `dtype`
    the tensors are the cast ones: a finite fp32 weight beyond fp16's range is refused too."""
    from shardwise.errors import NonFiniteError
    from shardwise.train.checkpoint.sharded import nonfinite_tensors

    bad = nonfinite_tensors(tensors)
    if bad:
        what = f" in {HF_DTYPE_NAMES.get(dtype, dtype)}" if dtype is not None and dtype != torch.float32 else ""
        of = " of a shard" if dtype is not None else ""
        raise NonFiniteError(f"{out}: refusing to export non-finite weights{what} ({len(bad)} of {len(tensors)} "
                             f"tensors{of}, e.g. {bad[0]}); nothing was written")


def is_adapter_weight(name: str) -> bool:
    """What a LoRA run trains: PEFT's adapter matrices and `modules_to_save` copies."""
    return ".lora_" in name or ".modules_to_save." in name


@large_allocations_returned()
def export_final(cfg: TrainConfig, weights: Path, out: Path, progress: Progress = None) -> Path:
    """`checkpointing.save_final`: the final weights of a run (a DCP directory:
    shardwise.train.export.final_weights) streamed shard by shard, or a LoRA run's adapter (and, with
    `lora.save_merged`, the merged model in `<out>-merged`). `progress`: as `write_hf`'s."""
    if cfg.lora is None:
        return export_dcp(cfg, weights, out, progress)
    adapters = {k: v for k, v in read_model_weights(weights).items() if is_adapter_weight(k)}
    if cfg.lora.save_merged:
        export_lora(cfg, adapters, out.with_name(out.name + "-merged"), merged=True, progress=progress)
    return export_lora(cfg, adapters, out, merged=False)


def export_lora(cfg: TrainConfig, adapters: dict[str, torch.Tensor], out: Path, merged: bool,
                progress: Progress = None) -> Path:
    """A LoRA run's adapters (`<module>.lora_A.default.weight`, ..., as the run names them) as
    PEFT's adapter directory, or with `merged` as the base with the adapters merged in. No base
    weight is built or read for the adapter: PEFT's own `PeftModel` is built on the meta device
    (names, shapes and each adapter's scaling, nothing allocated) and its `save_pretrained` writes
    the given tensors (`state_dict=`) under PEFT's key names, with adapter_config.json from the
    run's LoraConfig and the tokenizer. The merged model streams (`_export_merged`). Issues no
    collective: one process writes, whatever world size trained the adapters."""
    from shardwise.train.outputs import atomic_dir

    refuse_nonfinite(adapters, out)
    run = _one_process_run(cfg)
    pm = _meta_peft_model(cfg, run, adapters)
    if merged:
        return _export_merged(cfg, run, pm, adapters, out, progress)
    need = sum(int(v.numel()) * v.element_size() for v in adapters.values())
    state = {f"base_model.model.{k}": v for k, v in adapters.items()}
    with atomic_dir(out) as tmp, disk_full_is(out, need, tmp):
        # save_embedding_layers=False: the base's embeddings are frozen, equal to the base's own
        # (PEFT's "auto" would copy them in when an embedding is a target, at the vocabulary's size).
        pm.save_pretrained(str(tmp), safe_serialization=True, state_dict=state, save_embedding_layers=False)
        _copy_tokenizer(cfg, tmp)
        _umask_modes(tmp)
    return out


def _one_process_run(cfg: TrainConfig):
    """The run's RunSpec on one CPU process (the strategy only has to be valid there)."""
    from shardwise.run import run_spec

    one = cfg.model_copy(update={
        "strategy": cfg.strategy.model_copy(update={"name": "ddp", "shard_group": None}),
        "checkpointing": cfg.checkpointing.model_copy(update={"activation": "none"}),
        "run": cfg.run.model_copy(update={"device": "cpu"})})
    return run_spec(one, 1, "cpu", environ={})


def _meta_peft_model(cfg: TrainConfig, run, adapters: dict[str, torch.Tensor]):
    """`peft.get_peft_model` around the run's base built on the meta device, with the run's
    LoraConfig: refuses adapters that are not exactly the ones it trains (names and shapes)."""
    from shardwise.train.model.build import meta_base
    from shardwise.train.model.lora import peft_model

    assert cfg.lora is not None
    with torch.device("meta"):
        pm = peft_model(cfg.lora, meta_base(run))
    if cfg.model.path:
        pm.peft_config["default"].base_model_name_or_path = str(Path(cfg.model.path).resolve())
    expected = {n.removeprefix("base_model.model."): tuple(p.shape)
                for n, p in pm.named_parameters() if p.requires_grad}
    missing, unexpected = expected.keys() - adapters.keys(), adapters.keys() - expected.keys()
    wrong = sorted(f"{k} {tuple(adapters[k].shape)} vs {expected[k]}" for k in expected.keys() & adapters.keys()
                   if tuple(adapters[k].shape) != expected[k])
    if missing or unexpected or wrong:
        raise ValueError(f"the checkpoint's adapters do not match lora: {cfg.lora.model_dump(mode='json')} "
                         f"({len(missing)} missing, e.g. {sorted(missing)[:1]}; {len(unexpected)} unexpected, "
                         f"e.g. {sorted(unexpected)[:1]}; {len(wrong)} of another shape, e.g. {wrong[:1]})")
    return pm


def _export_merged(cfg: TrainConfig, run, pm, adapters: dict[str, torch.Tensor], out: Path,
                   progress: Progress = None) -> Path:
    """The base with the adapters merged in, through `write_hf` one read group at a time: each
    base tensor is read alone, a LoRA target's as `W + scaling · (B @ A)` in fp32 (the delta of
    PEFT's `get_delta_weight`, with the layer's own `scaling` and `fan_in_fan_out`, added in
    place by `addmm_`), a `modules_to_save` module's as its trained copy. The host holds the output
    shard, one read group and one fp32 tensor beyond them, never the model. The base is read
    from `model.path`'s files (shardwise.train.model.weights_read.TensorFiles, one tensor at a time,
    unquantised: a QLoRA run merges into the full-precision base, as PEFT's own merge does); a
    catalog model or `model.random_init` (a seeded random init, no files) is rebuilt whole on
    this process as training built it."""
    from shardwise.errors import ShardwiseError
    from shardwise.train.model.weights import weights_format
    from shardwise.train.model.weights_read import TensorFiles, check_keys, model_keys

    base = pm.get_base_model()
    groups = model_keys(base)  # checkpoint key -> the (meta) tensors it fills; adapters left out
    replaced = _modules_to_save(adapters)
    merges = _lora_merges(base, adapters)
    path = cfg.model.path
    if path is not None and not cfg.model.random_init and weights_format(path) is not None:
        files = TensorFiles(path)
        tied = bool(getattr(base.config, "tie_word_embeddings", False))
        verdict = check_keys(groups, files.shape, tied, Path(path))
        if verdict:
            raise ShardwiseError(verdict)
        source = files.get
        names = [k for k in groups if files.shape(k) is not None]  # a tied lm_head the files lack
    else:
        built = _built_base(cfg).state_dict()
        source, names = built.__getitem__, [k for k in groups if k in built]
    shapes = {k: (tuple(groups[k][0][1].shape), torch.float32) for k in names}
    del groups

    def merged_tensor(key: str) -> torch.Tensor:
        if key in replaced:
            return replaced[key]
        w = source(key)
        if key not in merges:
            return w
        a, b, scale, transposed = merges[key]
        w = w.to(dtype=torch.float32, copy=True)
        if transposed:  # the delta is (B @ A)^T: fan_in_fan_out weights and embeddings
            return w.addmm_(a.t().float(), b.t().float(), alpha=scale)
        return w.addmm_(b.float(), a.float(), alpha=scale)

    unused = (merges.keys() | replaced.keys()) - set(names)
    if unused:
        raise ValueError(f"the adapters of {sorted(unused)[:3]} have no base weight to merge into")
    return write_hf(cfg, shapes, lambda keys: {k: merged_tensor(k) for k in keys}, out, progress)


def _lora_merges(base, adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]]:
    """Base checkpoint key -> (A, B, scaling, transposed) of every LoRA layer of the meta-built
    PeftModel's base: `scaling` is the layer's own (lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    from peft.tuners.lora import LoraLayer

    from shardwise.train.model.lora import ADAPTER_NAME
    from shardwise.train.model.weights_read import checkpoint_key

    out = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER_NAME not in module.scaling:
            continue
        scale = float(module.scaling[ADAPTER_NAME])
        if ADAPTER_NAME in module.lora_A:
            a, b = (adapters[f"{name}.lora_{x}.{ADAPTER_NAME}.weight"] for x in "AB")
            transposed = bool(getattr(module, "fan_in_fan_out", False))
        elif ADAPTER_NAME in module.lora_embedding_A:
            a, b = (adapters[f"{name}.lora_embedding_{x}.{ADAPTER_NAME}"] for x in "AB")
            transposed = True  # PEFT's Embedding: delta = (B @ A)^T
        else:
            continue
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"{name}: a LoRA layer of {type(module).__name__} cannot be merged here (2-D A and B "
                             f"expected, got {tuple(a.shape)} and {tuple(b.shape)})")
        key = checkpoint_key(f"{name}.base_layer.weight")
        assert key is not None
        out[key] = (a, b, scale, transposed)
    return out


def _modules_to_save(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base checkpoint key -> the trained copy of a `modules_to_save` module's tensor."""
    from shardwise.train.model.weights_read import checkpoint_key

    return {key: v for k, v in adapters.items()
            if ".modules_to_save." in k and (key := checkpoint_key(k)) is not None}


def _built_base(cfg: TrainConfig):
    """A base without weight files (the catalog's, or `model.random_init`), as training builds
    it: seeded random init, fp32, on this process (no file is read: no collective)."""
    from shardwise.train.model.build import build_model

    return build_model(_one_process_run(cfg.model_copy(update={"lora": None})))


def _hf_config(cfg: TrainConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The model's own config.json (local checkpoint) or the catalog shape's transformers config,
    with the exported dtype (`dtype`, and the `torch_dtype` older transformers read) and
    `architectures` (the causal-LM class transformers maps the model_type to, when the config
    does not name one): what from_pretrained and serving stacks (vLLM, TGI) look for."""
    if cfg.model.path:
        from shardwise.specs.hf_config import read_config_json

        out = read_config_json(cfg.model.path)[0]
    else:
        from transformers import AutoConfig

        from shardwise.run import model_spec

        spec = model_spec(cfg)
        # for_model instantiates a built-in config class (CONFIG_MAPPING): it loads no code and takes no
        # trust_remote_code (a keyword would be stored as a field of the exported config.json).
        out = AutoConfig.for_model(**spec.to_hf_dict()).to_dict()
    if not out.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(out.get("model_type", ""))
        if arch:
            out["architectures"] = [arch]
    name = HF_DTYPE_NAMES[dtype]
    return out | {"dtype": name, "torch_dtype": name}


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
