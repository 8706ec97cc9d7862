"""A local checkpoint's weights read into each rank's part of the model, never a full copy per rank.

Where the checkpoint is safetensors (`model.safetensors`, or shards named by
`model.safetensors.index.json`) and `model.random_init` is off, `build_model` builds the model
without weights and the engine fills it after placing it:

- DDP, DeepSpeed ZeRO-0/1/2, FSDP2: the model is built on the meta device (buffers, e.g. RoPE's
  `inv_freq`, are computed for real: accelerate's `init_empty_weights(include_buffers=False)`),
  LoRA adapters are injected and cast there (frozen base in the compute dtype, trainable in the
  master dtype: fp32, bf16 under bf16-pure; bf16-pure casts a full model's parameters too),
  the engine places it (FSDP2 shards the meta parameters), then `materialize` allocates each
  rank's part (`to_empty`) and `torch.distributed.checkpoint.load` with its
  `HuggingFaceStorageReader` reads every tensor's slice for that part straight from the
  safetensors files (`get_slice`: a rank reads only its rows) into the parameter's own dtype.
- DeepSpeed ZeRO-3: the model is built inside `deepspeed.zero.Init` (each module partitioned as it
  is constructed, in the dtype DeepSpeed trains it in), then `load_zero3` fills the partitions
  chunk by chunk: `GatheredParameters(chunk, modifier_rank=0)`, rank 0 copying the chunk's
  tensors from the files, DeepSpeed re-partitioning on exit (its documented recipe for weights
  into a `zero.Init` model).

Parameters the checkpoint does not hold (LoRA adapters) are initialised on CPU from the run's seed
before placement (`Pending.initial`), identically on every rank and engine, and copied into each
rank's part afterwards. A `.bin` checkpoint (pickles cannot be read by slices) takes the same
paths with rank 0 reading each tensor and broadcasting it (shardwise.train.model.weights_read).
`random_init` and the catalog's random models are built whole from their config, seeded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.plan.load import ZERO3_CHUNK_BYTES as _PLANNED_CHUNK
from shardwise.train.launch.host_alloc import large_allocations_returned
from shardwise.train.model.weights_read import (
    bin_files,
    copy_full,
    load_broadcast,
    load_safetensors,
    safetensors_files,
)

# Bytes of full tensors gathered on every rank at a time while ZeRO-3 partitions are filled: the
# planner's figure (one fact, priced and used).
ZERO3_CHUNK_BYTES = int(_PLANNED_CHUNK)


def weights_format(path: str | Path) -> str | None:
    """"safetensors", "bin" (PyTorch pickles, read through torch's weights_only allow-list) or None."""
    if safetensors_files(path) is not None:
        return "safetensors"
    return "bin" if bin_files(path) is not None else None


def sharded_load(run: Any) -> bool:
    """Whether `build_model(run)` defers the weights to the engine (see the module docstring)."""
    cfg = run.config.model
    return cfg.path is not None and not cfg.random_init and weights_format(cfg.path) is not None


def zero3(run: Any) -> bool:
    s = run.engine_strategy
    return s.engine == "deepspeed" and (s.zero_stage or 0) == 3


@dataclass
class Pending:
    """What a model built without weights still needs: the files to read, and the CPU values of
    what they do not hold (adapters) and of the buffers (`to_empty` discards both)."""

    path: Path
    format: str = "safetensors"  # or "bin"
    initial: dict[str, Any] = field(default_factory=dict)  # fqn -> full CPU tensor
    buffers: dict[str, Any] = field(default_factory=dict)  # fqn -> CPU tensor


PENDING_ATTR = "_shardwise_pending"


def pending(model: Any) -> Pending | None:
    return getattr(model, PENDING_ATTR, None)


def meta_model(run: Any, attn_implementation: str) -> Any:
    """The run's HF model with meta parameters (fp32) and real buffers, from the checkpoint's config.
    Tied weights are tied again after the build: `init_empty_weights` re-registers every parameter
    it sees assigned (a new meta Parameter), so transformers' own tying inside `from_config` leaves
    lm_head a tensor of its own, which the files (holding the embedding only) never fill."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = run.config.model
    hf_cfg = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation=attn_implementation,
                                                 trust_remote_code=cfg.trust_remote_code)
    model.tie_weights()
    return model


def defer(model: Any, run: Any) -> Any:
    """Record what `materialize` needs on a meta-built model (after any adapters were injected
    and initialised on CPU: `lora.init_adapters`), and move those adapters to meta too, so that the
    engine places one uniform meta model."""
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
    buffers = {n: b for n, b in model.named_buffers()}
    import torch

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type != "meta":
                module._parameters[name] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    path = Path(run.config.model.path)
    setattr(model, PENDING_ATTR, Pending(path, weights_format(path) or "safetensors", init, buffers))
    return model


def materialize(module: Any, device: Any) -> None:
    """Allocate this rank's part of a meta-built model on `device`, restore its buffers, read the
    checkpoint into it and copy in the initial values of what the checkpoint does not hold.
    Collective (DCP plans the read on all ranks): every rank calls it."""
    import torch

    todo = pending(module)
    if todo is None:
        return
    ties = _ties(module)
    module.to_empty(device=device)
    for owner, name, (first, first_name) in ties:  # to_empty gave each holder a Parameter of its own
        owner._parameters[name] = first._parameters[first_name]
    own_buffers = dict(module.named_buffers())
    with torch.no_grad(), large_allocations_returned():
        for name, value in todo.buffers.items():
            if name in own_buffers:
                own_buffers[name].copy_(value)
        (load_broadcast if todo.format == "bin" else load_safetensors)(module, todo.path)
        params = dict(module.named_parameters())
        for name, full in todo.initial.items():
            copy_full(params[name], full)
    delattr(module, PENDING_ATTR)


def _ties(module: Any) -> list[tuple[Any, str, tuple[Any, str]]]:
    """(module, name, (module, name) of its first holder) for every parameter held under a second
    name (a tied lm_head): `to_empty` replaces each holder's Parameter with a new one, which
    would untie them and leave the second never filled (the files hold the first only)."""
    first: dict[int, tuple[Any, str]] = {}
    out = []
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) in first and first[id(p)] != (mod, name):
                out.append((mod, name, first[id(p)]))
            else:
                first.setdefault(id(p), (mod, name))
    return out


def checkpoint_weights(path: str | Path) -> tuple[str | None, float]:
    """(weights format, bytes of the largest weights file) of a checkpoint directory: what its
    load phase is planned from; (None, 0) where it has no weights (built from its config)."""
    fmt = weights_format(path)
    files = (safetensors_files(path) if fmt == "safetensors" else bin_files(path)) if fmt else []
    return fmt, float(max((f.stat().st_size for f in files or []), default=0))


def run_weights(run: Any) -> tuple[str | None, float]:
    """checkpoint_weights of the run's model.path; (None, 0) for a model built from its config."""
    cfg = run.config.model
    return checkpoint_weights(cfg.path) if cfg.path is not None and not cfg.random_init else (None, 0.0)


def planned_load(run: Any) -> Any:
    """The planner's load phase (shardwise.plan.load) for this run as it will load: its path,
    device and the checkpoint's largest file. Torch-free (preflight runs it before any rank)."""
    from shardwise.plan.load import load_path, load_phase
    from shardwise.train.launch.fork import planned_forked

    fmt, largest = run_weights(run)
    per_node = max(1, min(run.world_size, run.hardware.gpus_per_node))
    return load_phase(run.model, run.train, run.engine_strategy, run.layout, per_node, device=run.device,
                      path=load_path(run.engine_strategy, fmt), max_file_bytes=float(largest),
                      forked=planned_forked())
