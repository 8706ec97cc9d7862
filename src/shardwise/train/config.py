"""TrainConfig: the typed YAML of `shardwise train`, validated before any process starts.

Errors name the file, the line, the dotted field, the value given and what is accepted.
`--set a.b=c` overrides are parsed as YAML scalars and applied before validation, so an
override is checked exactly like a line of the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from shardwise.config_fields import Finite, Int, NonBlank, Seed, bounded
from shardwise.data.config import MAX_LENGTH_CAP, DataConfig
from shardwise.errors import ShardwiseError, did_you_mean, user_error
from shardwise.safe_yaml import check_values, key_lines, line_of, parse_yaml, read_yaml
from shardwise.specs.strategy import STRATEGY_NAMES, DDPKnobs, DeepSpeedKnobs, FSDPKnobs
from shardwise.train.config_base import Section as _Section
from shardwise.train.config_export import (  # noqa: F401 - re-exported: the export section's names
    EXPORT_DTYPE_OF_PRECISION,
    SIZE_UNITS,
    ExportSection,
    shard_size_bytes,
)
from shardwise.train.config_logging import (  # noqa: F401 - re-exported: the logging section's names
    LEGACY_LOGGING_KEYS,
    TRACKER_NAMES,
    LoggingSection,
    MlflowSection,
    WandbSection,
)

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]


class ModelSection(_Section):
    name: str | None = Field("tiny-llama", description="catalog model built from its config with random init")
    path: NonBlank | None = Field(None, description="local HF directory (config.json + weights); overrides name")
    random_init: bool = Field(False, description="with `path`: build from its config.json, ignore weights")
    trust_remote_code: bool = Field(False, description="allow code shipped with the checkpoint to run")
    attention: Literal["eager", "sdpa"] = Field("sdpa", description="attention kernel")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if not self.name and not self.path:
            raise ValueError("give model.name (a catalog model) or model.path (a local HF directory)")
        return self


class SyntheticData(_Section):
    samples: Int = Field(256, gt=0, description="number of random sequences")
    seq_len: Int = Field(64, ge=4, le=MAX_LENGTH_CAP, description=f"tokens per sequence (at most {MAX_LENGTH_CAP:,})")
    seed: Seed = Field(1234, description="seed of the token and mask generator")


class SFTSection(DataConfig):
    """`data.sft`: the data pipeline's DataConfig, with the trainer's defaults for two fields, and
    the attention that keeps its packed documents apart (the trainer's, not the pipeline's)."""

    train_files: list[str] = Field(default_factory=list, description="JSON/JSONL/Parquet paths or globs "
                                   "(none: the bundled sample data)")
    seed: Seed | None = Field(None, description="shuffle seed (default: run.seed)")
    packed_attention: Literal["auto", "varlen", "flex", "dense"] = Field(
        "auto", description="how the documents of a row are kept apart: varlen (flash-attn's varlen kernel where "
        "installed, else one SDPA call per document), flex (FlexAttention's document block mask; CUDA), dense (a "
        "[B, 1, S, S] mask, full S² attention); auto: flash-attn, else flex on CUDA, else varlen; dense with "
        "eager attention (shardwise.train.packed_attention)")


class DataSection(_Section):
    kind: Literal["sft", "synthetic"] = Field("sft", description="SFT files or seeded random tokens")
    tokenizer: NonBlank | None = Field(None, description="local tokenizer dir (default: the bundled one)")
    sft: SFTSection = SFTSection()
    synthetic: SyntheticData = SyntheticData()


def _overrides(knobs: type[BaseModel], name: str) -> type[BaseModel]:
    """A config section with the fields of a planner knob class, each optional: None = the
    trainer's default for the device (shardwise.run.trainer_knobs). The fields, their types,
    bounds and descriptions are the planner's, so the two cannot drift; an int or float field
    takes the config's strict `Int` / `Finite` (no boolean, no NaN or Inf)."""
    strict = {int: Int, float: Finite}
    fields: dict[str, Any] = {
        k: (strict.get(f.annotation, f.annotation) | None,  # type: ignore[call-overload]
            Field(None, description=f.description, json_schema_extra=None,
                  **{m: getattr(c, m) for c in f.metadata for m in ("gt", "ge", "lt", "le")
                     if getattr(c, m, None) is not None}))
        for k, f in knobs.model_fields.items()
    }
    return create_model(name, __base__=_Section, **fields)


DeepSpeedSection = _overrides(DeepSpeedKnobs, "DeepSpeedSection")
FSDPSection = _overrides(FSDPKnobs, "FSDPSection")
DDPSection = _overrides(DDPKnobs, "DDPSection")


class StrategySection(_Section):
    name: str = Field("fsdp", description=f"one of {', '.join(STRATEGY_NAMES)}")
    shard_group: Int | None = Field(None, gt=0, description="fsdp-hybrid: ranks per shard group (default: a node)")
    tp: Int = Field(1, gt=0, description="tensor-parallel degree (sequence parallel on; FSDP2 strategies; "
                                         "world size = data-parallel degree × tp)")
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection,  # type: ignore[valid-type]
                                        description="ZeRO knobs (shardwise.specs.DeepSpeedKnobs)")
    fsdp: FSDPSection = Field(default_factory=FSDPSection,  # type: ignore[valid-type]
                              description="FSDP2 knobs (shardwise.specs.FSDPKnobs)")
    ddp: DDPSection = Field(default_factory=DDPSection,  # type: ignore[valid-type]
                            description="DDP knobs (shardwise.specs.DDPKnobs)")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        key = v.strip().lower()
        if key not in STRATEGY_NAMES:
            raise ValueError(f"unknown strategy {v!r}. {did_you_mean(key, STRATEGY_NAMES)}")
        return key


# Above 0, finite and at most MAX_LR. AdamW moves each weight by about lr a step, so any rate
# that trains is far below 1; up to MAX_LR a diverging run ends as a non-finite loss (exit 3,
# what tests/train/test_faults_e2e.py provokes with 1e6), while past fp32's range (3.4e38) the
# optimizer's lr tensor overflows with a traceback in every rank (1e300 did).
MAX_LR = 1e6
LR_WHY = ("AdamW moves each weight by about lr a step: any rate that trains is far below 1, and far larger "
          "ones overflow the optimizer's fp32 arithmetic")
# torch.optim.AdamW refuses a beta outside [0, 1) (inside every rank, with a traceback).
Beta = Annotated[Finite, bounded(ge=0, lt=1, why="torch.optim.AdamW's range: a moment's decay rate")]


class OptimizerSection(_Section):
    name: Literal["adamw"] = "adamw"
    lr: Annotated[Finite, bounded(gt=0, le=MAX_LR, why=LR_WHY)] = Field(
        1e-4, description=f"peak learning rate (above 0, at most {MAX_LR:g})")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW's moment decay rates, each in [0, 1)")
    eps: Finite = Field(1e-8, gt=0)
    weight_decay: Finite = Field(0.0, ge=0, description="set explicitly: torch AdamW's default is 0.01")
    max_grad_norm: Finite = Field(1.0, ge=0, description="global-norm clipping; 0 disables")
    fused: bool | None = Field(None, description="fused AdamW; None = on CUDA only")

    def fused_on(self, device: str) -> bool:
        """Whether AdamW runs torch's fused kernel on `device`: `fused` where set, else on CUDA
        only. The engines build it (train/engines/_torch_common.build_adamw) and the plan prices
        it (run.bridge.optimizer_impl) from this one rule."""
        return self.fused if self.fused is not None else device == "cuda"


class ScheduleSection(_Section):
    kind: Literal["cosine", "linear", "constant", "warmup_decay"] = "cosine"
    warmup_steps: Int = Field(0, ge=0)
    min_lr_ratio: Finite = Field(0.0, ge=0, le=1, description="final lr / peak lr (cosine, linear)")


# Bounds of the run's sizes (each stated in its field's description): far above any real run, low enough that a
# typo (an extra three zeros, `1e9`) is refused before a rank starts instead of growing for minutes
# on a CPU run (no memory check there) or overflowing inside every rank.
MAX_MICRO_BATCH = 4096  # sequences per rank per forward
MAX_GRAD_ACCUM = 65536  # micro-batches per optimizer step
# A week: a finite timeout that datetime.timedelta, gloo and NCCL accept (with the collective backstop's
# margin added, shardwise.train.launch.COLLECTIVE_MARGIN_S); inf or 1e30 overflowed in every rank.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# At least a second: the process-group rendezvous, the weights' broadcast and a checkpoint's
# collectives take longer than that on a healthy machine; a shorter timeout fails healthy runs.
MIN_TIMEOUT_S = 1.0
TIMEOUT_WHY = (f"process-group init and collective timeout: under {MIN_TIMEOUT_S:g} s fails healthy runs, "
               f"above {MAX_TIMEOUT_S:.0f} s = 7 days overflows in the ranks")
# Ranks spawned on one node (run.nproc): above any node's GPUs or cores, low enough that a typo is
# not a fork bomb.
MAX_LOCAL_RANKS = 1024


class RunSection(_Section):
    steps: Int = Field(100, gt=0, description="optimizer steps")
    micro_batch: Int = Field(4, gt=0, le=MAX_MICRO_BATCH, description="sequences per rank per forward "
                             f"(at most {MAX_MICRO_BATCH})")
    grad_accum: Int = Field(1, gt=0, le=MAX_GRAD_ACCUM, description="micro-batches per optimizer step "
                            f"(at most {MAX_GRAD_ACCUM})")
    seed: Seed = Field(0, description="seed of the initial weights, the adapters and the data order "
                       "(0 to 2**32 - 1)")
    nproc: Int = Field(1, gt=0, le=MAX_LOCAL_RANKS, description="local ranks to launch (ignored under "
                       f"torchrun/deepspeed/srun; at most {MAX_LOCAL_RANKS})")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    timeout_s: Annotated[Finite, bounded(ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S, why=TIMEOUT_WHY)] = Field(600.0,
                             description="process-group init and collective timeout; a rank that makes no "
                             "progress for this long fails the job with a message naming it (finite, "
                             f"{MIN_TIMEOUT_S:.0f} s to {MAX_TIMEOUT_S:.0f} s = 7 days)")
    nonfinite_patience: Int = Field(0, ge=0, description="consecutive steps with a NaN/Inf loss or grad norm "
                                    "tolerated before the run stops (fp16 overflow steps the scaler skips "
                                    "do not count)")
    compile: bool | None = Field(None, description="torch.compile each decoder layer (regional, as torchtitan "
                                 "does) under fsdp* and ddp; None = on for CUDA, off on CPU")
    compile_backend: NonBlank = Field("inductor", description="torch.compile backend (inductor; aot_eager or eager "
                                 "to debug a compile problem)")
    eval_every_steps: Int | None = Field(None, gt=0, description="evaluate the validation split (data.sft."
                                         "validation_files or validation_fraction) every N optimizer steps and "
                                         "after the last one; null: no evaluation")
    eval_batches: Int | None = Field(None, gt=0, description="validation rows each evaluation reads, in global "
                                     "batches (run.micro_batch × run.grad_accum × ranks rows, the training "
                                     "global batch) from the split's start; null: the whole split")


class CheckpointingSection(_Section):
    activation: Literal["none", "full"] = Field("none", description="activation checkpointing per layer")
    output_dir: NonBlank = Field("runs/shardwise", description="metrics, TensorBoard, checkpoints and exports go here")
    save_final: bool = Field(False, description="write consolidated weights (safetensors) at the end")
    save_every_steps: Int | None = Field(None, gt=0, description="sharded checkpoint every N optimizer steps")
    save_every_minutes: Finite | None = Field(30.0, gt=0, description="sharded checkpoint every N minutes of "
                                             "training (checked at step boundaries; null: only save_every_steps)")
    keep_last: Int = Field(2, ge=1, description="published checkpoints kept; older ones are deleted")
    save_best: Literal["eval_loss"] | None = Field(None, description="eval_loss: save a checkpoint at every "
                                                   "evaluation and keep the one with the lowest eval loss "
                                                   "besides the keep_last newest (checkpoints/best.json names it)")
    save_on_interrupt: bool = Field(True, description="SIGTERM/SIGUSR1: checkpoint at the next step boundary, "
                                    "then exit with code 75")
    resume: NonBlank | None = Field(None, description="'latest' (newest complete checkpoint under output_dir) or a "
                               "checkpoint directory; same as `shardwise train --resume`")
    overwrite: bool = Field(False, description="a fresh run into an output_dir that holds an earlier run's "
                            "checkpoints or exported model removes them first (refused otherwise); same as "
                            "`shardwise train --overwrite`")


class LoraSection(_Section):
    """`lora:` — parameter-efficient fine-tuning through PEFT (`peft.inject_adapter_in_model`):
    the base model is frozen (kept in the compute dtype), adapters train in fp32. Absent or
    null: full fine-tuning."""

    rank: Int = Field(16, gt=0, description="adapter rank r")
    alpha: Finite | None = Field(None, gt=0, description="scaling numerator (the update is alpha/r · B·A); "
                                "default 2 × rank")
    dropout: Finite = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (0: runs are "
                           "reproducible across world sizes)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (PEFT's rule: the name or its last components), "
        "or 'all-linear': every linear of the decoder layers (not lm_head)")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained in full beside the "
                                       "adapters and saved with them, e.g. [lm_head, embed_tokens]")
    quantization: Literal["none", "nf4"] = Field("none", description="nf4: QLoRA, the frozen base in 4-bit NF4 "
                                                 "(bitsandbytes; CUDA only)")
    save_merged: bool = Field(False, description="checkpointing.save_final also writes the merged model "
                              "(base + adapters, safetensors) beside the adapter")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list):
            if not v:
                raise ValueError("empty list: give module names (e.g. [q_proj, v_proj]) or 'all-linear'")
            if "all-linear" in v:
                raise ValueError("'all-linear' is a value of its own, not a module name in a list")
            bad = [t for t in v if not t.strip() or any(c.isspace() for c in t)]
            if bad:
                raise ValueError(f"module names without spaces expected, got {bad!r}")
        return v

    @property
    def scale_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class LossSection(_Section):
    """`loss:` — how the next-token cross-entropy is computed (shardwise.train.loss). Both give
    the same loss and gradients (fp32 log-softmax, the same normalisation); they differ in
    memory and bytes moved. The planner plans the one set here (`cross_entropy`, `ce_chunk`)."""

    implementation: Literal["chunked", "standard"] = Field(
        "chunked", description="chunked: lm_head and the loss fused over chunks of tokens, no [tokens, vocab] "
        "fp32 logits (gradients computed in forward); standard: HF's logits, upcast to fp32 whole")
    chunk_tokens: Int = Field(1024, gt=0, description="chunked: tokens per chunk; one chunk's fp32 working set "
                              "is 8·vocab bytes per token")


class HardwareSection(_Section):
    gpu: str = Field("a100-80g", description="catalog GPU the memory check plans for")
    gpus_per_node: Int | None = Field(
        None, gt=0, description="ranks per node (default: the launcher's LOCAL_WORLD_SIZE, else all ranks)")
    check_memory: bool | None = Field(None, description="planner OOM check; None = on for CUDA, off for CPU")
    profile: NonBlank | None = Field(None, description="hardware profile JSON measured on these GPUs "
                                "(`shardwise calibrate`); replaces the catalog's rates in the plan")
    host_memory_gb: Finite | None = Field(
        None, gt=0, le=1e6, allow_inf_nan=False,
        description="host RAM per node (GB) the preflight checks the weight load against (default: MemAvailable "
                    "of /proc/meminfo on the launching node)")
    machine: str | None = Field(
        None, min_length=1, description="the hardware spec the plan uses (`shardwise doctor --write FILE`): GPU, "
        "links, NICs, host RAM; `auto` reads the launching node as `shardwise doctor` does; `gpu`, when set too, "
        "overrides its GPU")


class TrainConfig(_Section):
    name: str = "run"
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    strategy: StrategySection = StrategySection()
    optimizer: OptimizerSection = OptimizerSection()
    schedule: ScheduleSection = ScheduleSection()
    precision: Precision = "bf16-mixed"
    run: RunSection = RunSection()
    checkpointing: CheckpointingSection = CheckpointingSection()
    logging: LoggingSection = LoggingSection()
    hardware: HardwareSection = HardwareSection()
    lora: LoraSection | None = Field(None, description="LoRA/QLoRA adapters (null: full fine-tuning)")
    loss: LossSection = Field(default_factory=LossSection, description="cross-entropy implementation")
    export: ExportSection = Field(default_factory=ExportSection, description="exported weights: dtype, shard size")
    source: str = Field("<config>", exclude=True, description="file the config came from (errors)")

    def resolved_device(self) -> str:
        if self.run.device != "auto":
            return self.run.device
        import torch  # only when asked: validation stays torch-free

        return "cuda" if torch.cuda.is_available() else "cpu"


# --- loading (the YAML safety rules: shardwise.safe_yaml) -----------------------------------


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """`a.b.c=value`: value parsed as YAML (so `1e-4`, `true`, `[1, 2]` get their types)."""
    if "=" not in assignment:
        raise ShardwiseError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set strategy.name=zero3")
    value = assignment.split("=", 1)[1]
    parts = list(override_key(assignment))
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ShardwiseError(f"--set {assignment!r}: {p!r} is a value, not a section")
        node = nxt
    if not value.strip():
        node[parts[-1]] = None
        return
    try:  # the file's own bounded reader: depth, values, integer digits, duplicate keys
        node[parts[-1]] = parse_yaml(value, Path("<value>"))[1]
    except ShardwiseError as e:
        short = assignment if len(assignment) <= 80 else assignment[:80] + "..."
        raise ShardwiseError(f"--set {short!r}: {re.sub(r'^<value>(:[0-9]+)?: ', '', str(e))}") from None


# What `plan --emit` writes where only the user knows the value (the real model weights, the
# training files): a string starting with this is refused by `load_config`, naming the field.
PLACEHOLDER = "<FILL IN"


def _placeholders(raw: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """(key path, value) of every string that is a `plan --emit` placeholder."""
    found = []
    stack = [(path, raw)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, str) and v.startswith(PLACEHOLDER):
            found.append((p, v))
        elif isinstance(v, dict):
            stack.extend(((*p, k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend(((*p, i), x) for i, x in enumerate(v))
    return sorted(found, key=lambda f: [str(x) for x in f[0]])


def validate(
    raw: dict[str, Any], source: str = "<config>", lines: dict[tuple, int] | None = None,
    overrides: dict[tuple, str] | None = None,
) -> TrainConfig:
    """`overrides`: the key paths `--set` gave, each with its assignment (errors there name it)."""
    try:
        return TrainConfig.model_validate({**raw, "source": source})
    except ValidationError as exc:
        raise user_error(exc, source, model=TrainConfig, lines=lines, header="invalid config",
                         overrides=overrides) from None


def override_key(assignment: str) -> tuple[str, ...]:
    """The key path of a `--set a.b.c=value` assignment; an empty key or an empty part of one
    (`run..steps`, `.run.steps`, `run.steps.`) is refused, naming the assignment."""
    key = assignment.split("=", 1)[0].strip()
    parts = tuple(key.split("."))
    if not all(p.strip() for p in parts):
        raise ShardwiseError(f"--set {assignment!r}: key {key!r} has an empty part; expected dotted field names "
                             "such as run.steps (--set run.steps=100)")
    return parts


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read, override and validate a YAML config; every failure is a ShardwiseError."""
    path = Path(path)
    node, raw = read_yaml(path)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ShardwiseError(f"{path}: expected a mapping of sections at the top, got {type(raw).__name__}")
    for o in overrides:
        try:
            apply_override(raw, o)
        except RecursionError:  # an override's value is YAML too: as deep as a file can be
            raise ShardwiseError(f"--set {o[:60]!r}...: value nested too deeply to read (expected a scalar "
                                 "or a short list).") from None  # fmt: skip
    check_values(raw, f"{path} (after the --set overrides)")  # ... and gets the same alias budget
    lines = key_lines(node) if node is not None else {}
    holes = _placeholders(raw)
    if holes:
        out = []
        for key, value in holes:
            field = ".".join(str(x) for x in key if not isinstance(x, int))
            example = "'[VALUE, ...]'" if isinstance(key[-1], int) else "VALUE"
            out.append((line_of(lines, key), f"{path}:{line_of(lines, key)}: field {field!r} = {value!r}: replace it "
                        f"in the file, or pass --set {field}={example}"))  # fmt: skip
        raise ShardwiseError(f"{path}: placeholder values (written by `shardwise plan --emit`) to replace before "
                             "training:\n  " + "\n  ".join(m for _, m in sorted(out)))  # fmt: skip
    return validate(raw, str(path), lines, overrides={override_key(o): o for o in overrides})
