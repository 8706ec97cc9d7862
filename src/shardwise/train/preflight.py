"""Checks that run once, before any rank starts: model source, data files, tokenizer, the
strategy against the world size, and the planner's memory check (refuse what will not fit).

The checks are ordered cheap first (torch is imported only to ask about CUDA for a CUDA run, and
about the CPU's 16-bit matrix multiply for a 16-bit CPU run),
so a bad config fails in a second with one message instead of N ranks each printing a
traceback; the one expensive step, tokenising the data once into the cache every rank loads,
comes last. The resume checks (the checkpoint `checkpointing.resume` names, against this config)
are shardwise.train.checkpoint.resume_checks's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shardwise.config.schema import TrainConfig
from shardwise.config.strategy import STRATEGY_NAMES
from shardwise.errors import ShardwiseError
from shardwise.numfmt import rate
from shardwise.run import RunSpec, run_spec, train_spec
from shardwise.specs import Strategy
from shardwise.specs.hardware import GIB
from shardwise.train.model.build import attention_note, check_model_source
from shardwise.train.model.lora import check_qlora
from shardwise.train.observe.trackers import check_installed


def check_launch(world_size: int, device: str, source: str = "<config>") -> None:
    """The world size and device the launch resolved to. `--nproc 0` or a negative count would
    otherwise reach the layout arithmetic (or spawn nothing and report success)."""
    if world_size < 1:
        raise ShardwiseError(f"{source}: world size {world_size}: expected at least 1 rank (--nproc N or "
                             "run.nproc with N >= 1; under a launcher, its WORLD_SIZE).")  # fmt: skip
    if device not in ("cpu", "cuda"):
        raise ShardwiseError(f"{source}: run.device resolved to {device!r}: expected 'cpu' or 'cuda'.")


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without CUDA); the one place preflight asks torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(cfg: TrainConfig, device: str, world_size: int) -> None:
    """`run.device: cuda` on a machine without CUDA (or with fewer GPUs than local ranks) fails
    here once, instead of as one traceback per rank from `torch.cuda.set_device`."""
    if device != "cuda":
        return
    n = cuda_device_count()
    if n == 0:
        if cfg.run.device != "cuda":
            # "auto" resolves to cuda only where CUDA exists: this caller plans a GPU run from
            # a CPU host (tests, benches), it does not launch one here.
            return
        raise ShardwiseError(
            f"{cfg.source}: run.device is 'cuda' but this machine has no usable CUDA device "
            "(torch.cuda.is_available() is False); set run.device: cpu or auto (e.g. --set run.device=cpu).")
    local = _local_ranks(world_size)
    if local > n:
        raise ShardwiseError(
            f"{cfg.source}: {local} ranks on this node need {local} CUDA devices, {n} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --nproc {n} or fewer.")


def native_half_matmul(dtype: str) -> bool:
    """Whether torch multiplies `dtype` ("bf16" | "fp16") matrices on this CPU with oneDNN's
    kernels (AVX-512 and newer); elsewhere (AVX2) it falls back to its reference loops."""
    import torch

    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()
                and (ops._is_mkldnn_bf16_supported() if dtype == "bf16" else ops._is_mkldnn_fp16_supported()))


def cpu_precision_note(run: RunSpec, native=native_half_matmul) -> str | None:
    """A 16-bit CPU run on a CPU whose 16-bit matrix multiply is torch's reference loop: said
    before it starts, with what to change (the loops' speed: shardwise.doctor.checks
    REFERENCE_LOOPS; a 1.36B LoRA step of 64 tokens per rank took 12 minutes, past the default
    run.timeout_s)."""
    from shardwise.doctor.checks import REFERENCE_LOOPS

    cfg = run.config
    if run.device != "cpu" or cfg.precision == "fp32":
        return None
    dtype = "fp16" if cfg.precision.startswith("fp16") else "bf16"
    if native(dtype):
        return None
    return (f"precision {cfg.precision!r} on a CPU without a native {dtype} matrix multiply (oneDNN needs AVX-512; "
            f"this one has {_cpu_capability()}): torch runs {dtype} products in its reference loops, {REFERENCE_LOOPS}; "
            "precision fp32 runs faster here, and run.timeout_s may need raising for a large model")


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _local_ranks(world_size: int) -> int:
    """Ranks this node runs: the launcher's LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE, else all
    of them (`--nproc` spawns locally)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), world_size)
    return world_size


def check_weights(cfg: TrainConfig) -> None:
    """The weights files of a local `model.path` (not `random_init`) opened as rank 0 opens them:
    safetensors headers checked, `.bin` archives checked and read through torch's weights_only
    allow-list with their tensors mapped, not read (shardwise.train.model.weights_read.check_files).
    A bad file is refused here, naming it, instead of inside rank 0 after every rank started."""
    m = cfg.model
    if m.path is None or m.random_init:
        return
    from shardwise.train.model.weights_read import check_files

    try:
        check_files(m.path)
    except ShardwiseError as e:
        raise ShardwiseError(f"{cfg.source}: model.path {m.path!r}: {e}") from None


def check_data(cfg: TrainConfig) -> None:
    """The cheap part of the data check, before the planner runs: the tokenizer directory (a
    model directory's own tokenizer, or a clear refusal) and that every data file exists."""
    if cfg.data.kind == "synthetic":
        return
    from shardwise.data.formats import resolve_files
    from shardwise.train.sft_data import data_config, resolved_tokenizer_path

    resolved_tokenizer_path(cfg)
    dc = data_config(cfg)
    resolve_files(dc.train_files, where=f"{cfg.source}: data.sft.train_files")


def check_eval(cfg: TrainConfig) -> None:
    """`run.eval_every_steps` needs a validation split (data.sft.validation_files or
    data.sft.validation_fraction), and `checkpointing.save_best` needs evaluations; refused
    here, before any rank starts."""
    r, sft = cfg.run, cfg.data.sft
    if cfg.checkpointing.save_best is not None and r.eval_every_steps is None:
        raise ShardwiseError(f"{cfg.source}: checkpointing.save_best = {cfg.checkpointing.save_best!r} needs "
                             "evaluations: set run.eval_every_steps (and a validation split).")
    if r.eval_every_steps is None:
        return
    if cfg.data.kind != "sft":
        raise ShardwiseError(f"{cfg.source}: run.eval_every_steps = {r.eval_every_steps} needs a validation split, "
                             f"and data.kind {cfg.data.kind!r} has none; use data.kind: sft with "
                             "data.sft.validation_files or data.sft.validation_fraction, or unset run.eval_every_steps.")
    if not sft.validation_files and sft.validation_fraction == 0:
        raise ShardwiseError(f"{cfg.source}: run.eval_every_steps = {r.eval_every_steps} needs a validation split: "
                             "set data.sft.validation_files (files) or data.sft.validation_fraction (a fraction "
                             "of the training records, e.g. 0.05), or unset run.eval_every_steps.")
    if sft.validation_files:
        from shardwise.data.formats import resolve_files

        resolve_files(sft.validation_files, where=f"{cfg.source}: data.sft.validation_files")


def check_in_backward(run: RunSpec) -> None:
    """`optimizer.in_backward` (shardwise.train.engines._torch_common.InBackwardAdamW): refused,
    naming the field to change, where a parameter's update cannot run as soon as its gradient is
    final, or where it would save nothing (accumulation and fp16: TrainSpec refuses them, and the
    strategy's own refusal is Strategy.in_backward_refusal: for plan alike)."""
    cfg = run.config
    if not cfg.optimizer.in_backward:
        return
    where = f"{cfg.source}: optimizer.in_backward"
    engine = run.engine_strategy
    if cfg.optimizer.max_grad_norm:
        raise ShardwiseError(f"{where} updates each parameter as soon as its gradient is final, so nothing can clip "
                             f"by the global norm: set optimizer.max_grad_norm: 0 (it is {cfg.optimizer.max_grad_norm:g})")
    why = engine.in_backward_refusal(run.layout.dp)
    if why:
        raise ShardwiseError(f"{where}: {why} (strategy.name {cfg.strategy.name!r}, strategy.tp {run.layout.tp})")


def check_precision(run: RunSpec) -> None:
    """`precision: bf16-pure` (bf16 weights, gradients and AdamW states, no fp32 master copy) runs
    with the torch engines (DDP, FSDP2), whose optimizer updates the module's own parameters.
    DeepSpeed's bf16, as shardwise runs it, keeps an fp32 master copy of the weights, and fp32
    AdamW states, inside its optimizer: refused there, naming the field, rather than run as
    bf16-mixed under the name. (DeepSpeed's own `bf16.bf16_master_weights_and_grads` with
    `bf16_optimizer_states`, ZeRO-1 to 3, is not wired in: the canonical checkpoint of its
    partitions and the plan's DeepSpeed model states are fp32 masters.)
    FSDP2 reduce-scatters bf16-pure's gradients in their own dtype (no MixedPrecisionPolicy, as
    planned): an explicit `strategy.fsdp.reduce_dtype: fp32` would not be honoured, so it is
    refused too."""
    cfg = run.config
    if cfg.precision != "bf16-pure":
        return
    if run.engine_strategy.engine == "deepspeed":
        raise ShardwiseError(
            f"{cfg.source}: precision 'bf16-pure' keeps no fp32 copy of the weights, but DeepSpeed's bf16 keeps fp32 "
            f"master weights and AdamW states in its optimizer as shardwise runs it (strategy.name "
            f"{cfg.strategy.name!r}); use precision bf16-mixed with this strategy, or an fsdp or ddp strategy for "
            "bf16-pure")
    if cfg.strategy.fsdp.reduce_dtype == "fp32" and run.strategy.engine == "fsdp2":
        raise ShardwiseError(
            f"{cfg.source}: strategy.fsdp.reduce_dtype 'fp32' is mixed precision's setting: under precision "
            "'bf16-pure' the gradients are bf16 and FSDP2 reduce-scatters them in bf16 (no MixedPrecisionPolicy); "
            "remove strategy.fsdp.reduce_dtype, or use precision bf16-mixed for an fp32 reduce")


def check_low_bit(run: RunSpec) -> None:
    """A low-bit `optimizer.name` (shardwise.train.engines.low_bit): refused, naming the field,
    where the trainer cannot run it (Strategy.low_bit_refusal: `to_config` and the planner ask it too), and its
    library imported here (a missing or broken install is one message, not a traceback per rank)."""
    cfg = run.config
    name = cfg.optimizer.name
    if name == "adamw":  # torch's own (and no torch import for the check)
        return
    why = run.engine_strategy.low_bit_refusal(name, run.device)
    if why:
        raise ShardwiseError(f"{cfg.source}: optimizer.name {name!r}: {why} (strategy.name {cfg.strategy.name!r}, "
                             f"strategy.tp {run.layout.tp}, run.device {run.device!r}); or set optimizer.name: adamw")
    from shardwise.train.engines.low_bit import optimizer_class

    optimizer_class(name, cfg.source)


def prepare_data(run: RunSpec) -> Path | None:
    """The expensive part, last, once: the tokenizer against the model's vocabulary, then the
    files parsed, validated, templated, tokenised and packed into the data cache every rank
    (and a resume) loads. Under torchrun/srun every rank calls this; one builds, the rest wait
    on the cache's file lock. None for synthetic data."""
    if run.config.data.kind == "synthetic":
        return None
    from shardwise.train.sft_data import prepare_sft

    return prepare_sft(run)


def check_data_size(run: RunSpec, cache: Path | None) -> int:
    """The data fills one global batch: every optimizer step takes run.micro_batch ×
    run.grad_accum × ranks distinct samples (synthetic sequences, or packed rows of the data
    cache that `prepare_data` just built; each rank gets `rows // ranks` of them per epoch).
    Fewer would fail inside every rank (`samples cannot feed N ranks`, `fewer than one global
    batch`) or repeat rows within one step. Returns the number of samples."""
    cfg = run.config
    r = cfg.run
    world = run.layout.dp  # data-parallel ranks: a TP group reads one batch
    per_rank = r.micro_batch * r.grad_accum
    need = per_rank * world
    ranks = f"{world} data-parallel rank{'s' if world != 1 else ''}" if run.layout.tp > 1 else \
        f"{world} rank{'s' if world != 1 else ''}"
    batch = f"one global batch of {need} sequences (run.micro_batch {r.micro_batch} × run.grad_accum {r.grad_accum} × {ranks})"
    if cache is None:
        n = cfg.data.synthetic.samples
        if n < need:
            raise ShardwiseError(f"{cfg.source}: data.synthetic.samples = {n} cannot fill {batch}; raise "
                                 f"data.synthetic.samples to at least {need} or lower run.micro_batch / "
                                 "run.grad_accum")
        return n
    from shardwise.data import load_dataset

    n = len(load_dataset(cache))
    sft = cfg.data.sft
    what = (f"data.sft (train_files {sft.train_files or ['<bundled sample>']}, max_length {sft.max_length}, "
            f"packing {sft.packing}) gives {n} {'packed ' if sft.packing else ''}row{'s' if n != 1 else ''}")
    if n // world == 0:
        raise ShardwiseError(f"{cfg.source}: {what}, which cannot feed {world} ranks (each rank needs at least one "
                             "row per epoch); add data, lower data.sft.max_length, or use fewer ranks")
    usable = n // world * world  # the sampler drops the tail that does not divide among the ranks
    if usable < need:
        raise ShardwiseError(f"{cfg.source}: {what} ({usable} usable on {world} ranks), fewer than {batch}: "
                             f"every step would repeat rows; add data, lower data.sft.max_length, or lower "
                             f"run.micro_batch / run.grad_accum (at most {max(1, usable // world)} sequences per rank "
                             "per step)")
    return n


@dataclass(frozen=True)
class MemoryCheck:
    planned_bytes: float
    capacity_bytes: float
    fits: bool
    gpu: str


def check_memory(run: RunSpec, force: bool = False) -> MemoryCheck:
    """The planner's verdict for this run (the same specs the engines build); refuses a
    non-fitting plan with the nearest one that fits."""
    from shardwise.plan.evaluate import memory_as_run

    cfg = run.config
    enabled = cfg.hardware.check_memory if cfg.hardware.check_memory is not None else run.device == "cuda"
    plan = memory_as_run(run.model, run.hardware, run.train, run.strategy)
    result = MemoryCheck(plan.gpu.total, plan.capacity_bytes, plan.fits, cfg.hardware.gpu)
    if plan.fits or not enabled or force:
        return result
    hint = nearest_fit(run)
    raise ShardwiseError(
        f"{cfg.source}: predicted not to fit: strategy {run.strategy.name!r}, micro_batch {cfg.run.micro_batch}, "
        f"seq_len {run.train.seq_len}, activation checkpointing {run.train.checkpointing!r}"
        + (" (auto)" if run.recompute else "") + " needs "
        f"{plan.gpu.required / GIB:.1f} GiB per GPU (model states {plan.gpu.model_states / GIB:.1f}, "
        f"activations {(plan.gpu.activations + plan.gpu.logits) / GIB:.1f}) of "
        f"{plan.usable_bytes / GIB:.1f} GiB usable on {cfg.hardware.gpu}. "
        f"Nearest that fits: {hint}. Use --force to run anyway."
    )


def single_gpu_note(run: RunSpec) -> str | None:
    """On one GPU a sharding strategy shards nothing and still pays its engine's hooks and copies
    (docs/reference.md "One-rank shard groups"). FSDP2 then runs as DDP where the plan says so
    (FSDPKnobs.single_rank): the note says it did, with both plans. Otherwise it says so, with
    the plan's numbers, when DDP fits and is planned faster."""
    from shardwise.plan.evaluate import evaluate

    s = run.strategy
    if run.layout.tp > 1:
        if s.engine == "deepspeed":
            return (f"{s.name} with tp {run.layout.tp}: DeepSpeed's AutoTP over {run.layout.tp} ranks, ZeRO over "
                    f"{run.layout.dp} data-parallel rank(s), planned as such (the embedding, lm_head, norms and "
                    "logits whole on every TP rank, no sequence parallelism)")
        if run.layout.dp == 1:
            return (f"{s.name} with tp {run.layout.tp} on {run.world_size} ranks: tensor parallelism alone (one "
                    "data-parallel rank: no fully_shard), planned as such")
        return None
    if run.engine_strategy is not s:  # FSDP2 with a one-rank shard group runs as DDP: say so
        pinned = s.model_copy(update={"fsdp": s.fsdp.model_copy(update={"single_rank": "fsdp"})})
        ddp, kept = (evaluate(run.model, run.hardware, run.train, x) for x in (s, pinned))
        return (f"{s.name} with a shard group of one rank shards nothing: it runs as ddp (no fully_shard casts "
                f"and copies), planned {ddp.memory.gpu.total / GIB:.1f} GiB and "
                f"{rate(ddp.time.tokens_per_s_per_gpu)} tokens/s vs fully_shard's {kept.memory.gpu.total / GIB:.1f} GiB "
                f"and {rate(kept.time.tokens_per_s_per_gpu)} (strategy.fsdp.single_rank: fsdp keeps fully_shard)")
    if run.device != "cuda" or run.world_size != 1 or not s.shards_optimizer or not s.trainable:
        return None
    mine = evaluate(run.model, run.hardware, run.train, s).time.tokens_per_s_per_gpu
    ddp = evaluate(run.model, run.hardware, run.train, Strategy.from_name("ddp", ddp=s.ddp))
    theirs = ddp.time.tokens_per_s_per_gpu
    if not ddp.memory.fits or theirs < 1.05 * mine:
        return None
    return (f"{s.name} on one GPU shards nothing; ddp fits ({ddp.memory.gpu.total / GIB:.1f} GiB) and is planned "
            f"{theirs / mine:.2f}x faster ({rate(theirs)} vs {rate(mine)} tokens/s): --set strategy.name=ddp")


def nearest_fit(run: RunSpec) -> str:
    """Fewest changes first: checkpointing, then smaller micro-batches (same global batch via
    accumulation), then other strategies (least offload first, the table's order) with the
    same engine knobs."""
    from shardwise.plan.evaluate import memory_as_run

    cfg, s = run.config, run.strategy
    mb, ga = cfg.run.micro_batch, cfg.run.grad_accum
    options: list[tuple[str, Strategy, dict]] = [
        ("--set checkpointing.activation=full", s, {"checkpointing": "full"})
    ]
    m = mb
    while m > 1:
        m //= 2
        k = mb // m
        for ck in ("none", "full"):
            options.append(
                (
                    f"--set run.micro_batch={m} --set run.grad_accum={ga * k}"
                    + (" --set checkpointing.activation=full" if ck == "full" else ""),
                    s,
                    {"micro_batch": m, "grad_accum": ga * k, "checkpointing": ck},
                )
            )
    for name in STRATEGY_NAMES:
        if name in (s.name, "fsdp-hybrid"):
            continue
        other = Strategy.from_name(name, ds=s.ds, fsdp=s.fsdp, ddp=s.ddp)
        for ck in ("none", "full"):
            options.append(
                (
                    f"--set strategy.name={name}"
                    + (" --set checkpointing.activation=full" if ck == "full" else ""),
                    other,
                    {"checkpointing": ck},
                )
            )
    for text, strat, over in options:
        try:
            p = memory_as_run(run.model, run.hardware, train_spec(cfg, run.device, **over), strat)
        except ShardwiseError:
            continue
        if p.fits:
            return f"{text} ({p.gpu.total / GIB:.1f} GiB)"
    return (
        "none of checkpointing, smaller micro-batches or other strategies (use more GPUs or a smaller model)"
    )


def preflight(cfg: TrainConfig, world_size: int, device: str, force: bool = False) -> tuple[RunSpec, MemoryCheck]:
    """All user-facing checks; raises ShardwiseError naming the file/field/value. Returns the
    run's specs (what every rank builds) and the planner's memory verdict."""
    check_launch(world_size, device, cfg.source)
    check_device(cfg, device, world_size)
    check_model_source(cfg.model, cfg.source)
    check_weights(cfg)
    check_qlora(cfg, device)
    check_installed(cfg)  # the packages logging.trackers needs
    check_data(cfg)
    check_eval(cfg)
    try:
        from shardwise.train.launch.fork import planned_forked

        # CPU ranks' host plan as they will start (forked or exec'd), as check_host_memory plans it
        run = run_spec(cfg, world_size, device, forked=planned_forked())
    except ShardwiseError as e:  # a combination the specs refuse: name the file it came from
        raise e if str(e).startswith(cfg.source) else ShardwiseError(f"{cfg.source}: {e}") from None
    note = attention_note(run)  # refuses an SDPA request the architecture cannot run
    if note:
        print(f"shardwise: {note}")
    from shardwise.train.model.loss_support import check_run

    check_run(run)  # refuses the chunked cross-entropy where the model changes its logits
    check_in_backward(run)
    check_precision(run)
    note = cpu_precision_note(run)
    if note:
        print(f"shardwise: {note}")
    check_low_bit(run)
    if run.recompute is not None:  # `checkpointing: auto`, decided as the plan decides it (shardwise.plan.recompute)
        print(f"shardwise: {run.recompute.line()}")
    memory = check_memory(run, force)
    if run.grad_sync is not None:  # the plan's choice, which the FSDP2 engine runs (shardwise.plan.grad_sync)
        print(f"shardwise: {run.grad_sync.line()}")
    from shardwise.train.host_memory import check_host_memory

    check_host_memory(run, force)
    note = single_gpu_note(run)
    if note:
        print(f"shardwise: {note}")
    check_output_space(run, existing_checkpoints=_lineage_checkpoints(cfg))
    check_data_size(run, prepare_data(run))
    return run, memory


def output_bytes(run: RunSpec, existing_checkpoints: int = 0) -> tuple[int, str]:
    """The most disk this run's outputs hold at once beyond what is already there, and how it
    adds up. A save publishes checkpoint N+1 before it prunes beyond `keep_last`, so at its peak
    a lineage holds keep_last + 1 checkpoints (of 12 bytes per trained parameter: fp32 weights
    and AdamW's two moments; a LoRA run saves its adapters only); `existing_checkpoints` of the
    resumed lineage already count. The export is written beside the old one before it is
    replaced: its full size (fp32, 4 bytes per parameter; a LoRA adapter, and the merged model
    with lora.save_merged), and, when no checkpoint of the last step is saved, the fp32 weights
    the export streams from (4 bytes per trained parameter, removed after)."""
    from shardwise.train.outputs import checkpoint_bytes, size_text

    cfg = run.config
    cp = cfg.checkpointing
    saves = cp.save_every_steps is not None or cp.save_every_minutes is not None or cp.save_on_interrupt
    if run.train.lora_rank:
        from shardwise.plan.lora import trainable_params

        trained = int(trainable_params(run.model, run.train))
    else:
        trained = run.model.params
    held = max(1, cp.keep_last + 1 - existing_checkpoints) if saves else 0
    ckpt = held * checkpoint_bytes(trained)
    export = staged = 0
    if cp.save_final:
        export = 4 * trained
        if cfg.lora is not None and cfg.lora.save_merged:
            export += 4 * run.model.params
        # no checkpoint of the last step to export from: the fp32 weights are staged beside the
        # checkpoints for the export, then removed (shardwise.train.export.final_weights)
        last_saved = cp.save_every_steps is not None or cp.save_every_minutes is not None or (
            cp.save_best is not None and cfg.run.eval_every_steps is not None)
        staged = 0 if last_saved else 4 * trained
    how = (f"{held} checkpoint(s) of {size_text(checkpoint_bytes(trained))} (keep_last {cp.keep_last} + the one "
           f"being written{f', less {existing_checkpoints} already there' if existing_checkpoints else ''}; 12 "
           f"bytes per trained parameter) + export {size_text(export)}"
           + (f" + the final weights staged for it {size_text(staged)}" if staged else ""))
    return ckpt + export + staged, how


def _lineage_checkpoints(cfg: TrainConfig) -> int:
    """Checkpoints a `--resume latest` run continues next to (they are on disk already)."""
    if cfg.checkpointing.resume != "latest":
        return 0
    from shardwise.train.checkpoint.directory import checkpoints_dir, published
    from shardwise.train.checkpoint.lineage import read_lineage

    lin = read_lineage(cfg.checkpointing.output_dir)
    root = checkpoints_dir(cfg.checkpointing.output_dir)
    return len(published(root, lin.lineage)) if lin is not None else len(published(root))


def check_output_space(run: RunSpec, existing_checkpoints: int = 0) -> None:
    """The output dir is a directory (created if missing), writable, and has room for what the
    run will hold at its peak (`output_bytes`): found in a second, before the data cache is built
    in it and hours before the first save."""
    from shardwise.train.outputs import check_output_dir

    need, how = output_bytes(run, existing_checkpoints)
    check_output_dir(run.config.checkpointing.output_dir, need,
                     where=f"{run.config.source}: checkpointing.output_dir", how=how)
