"""TrainConfig: the one schema of a run. The training YAML, its `--set` overrides, `plan`'s flags
and the planner's specs (through shardwise.run) are all read from these sections. Every field has
one default, stated here; an unknown key is an error."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    create_model,
    field_validator,
    model_validator,
)

from shardwise.config.base import Section as _Section
from shardwise.config.data import MAX_LENGTH_CAP, DataConfig
from shardwise.config.fields import Finite, Int, NonBlank, Seed, bounded
from shardwise.config.strategy import STRATEGY_NAMES, CPImpl, DDPKnobs, DeepSpeedKnobs, FSDPKnobs, PPSchedule
from shardwise.errors import did_you_mean

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"]
PRECISION_WHY = (
    "the dtypes of weights, gradients and AdamW states, and of the compute. bf16-mixed / fp16-mixed: fp32 master "
    "weights, gradients and states, computed in 16 bits (fp16 with loss scaling); fp32: fp32 throughout; "
    "bf16-pure (torchtune's default): weights, gradients and AdamW states all bf16, no fp32 copy, about half "
    "bf16-mixed's model-state memory, but an update smaller than bf16's resolution (about 1/256 of the weight) "
    "is rounded away and lost; DDP and FSDP2 only (DeepSpeed keeps fp32 master weights)")


class ModelSection(_Section):
    name: str | None = Field("tiny-llama", description="catalog model or Hugging Face id, built from its config "
                             "with random init")
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
        "eager attention (shardwise.train.model.packed_attention)")


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
    pp: Int = Field(1, gt=0, description="pipeline-parallel degree (fsdp strategies; decoder layers split into "
                                         "stages; world size = data-parallel degree × tp × pp)")
    pp_schedule: PPSchedule = Field("1f1b", description="pipeline schedule: gpipe, 1f1b or interleaved-1f1b "
                                                        "(torch.distributed.pipelining); its micro-batches are "
                                                        "run.grad_accum's")
    pp_virtual_stages: Int = Field(1, gt=0, description="stages per pipeline rank (interleaved-1f1b: 2 or more)")
    cp: Int = Field(1, gt=0, description="context-parallel degree: each sequence split over cp GPUs of its "
                                         "data-parallel group (planned only: shardwise train runs cp 1)")
    cp_impl: CPImpl = Field("auto", description="how context parallelism exchanges keys and values: torch "
                                                "(torch's context_parallel; torchtitan, accelerate), ring (p2p "
                                                "ring; Megatron-Core, ring-flash-attn), allgather (Llama 3's; "
                                                "ring-flash-attn varlen), ulysses (all-to-all; DeepSpeed) or "
                                                "auto (the engine's own)")
    cp_load_balance: bool = Field(True, description="context parallelism cuts each sequence into 2·cp chunks, "
                                                    "two a rank, balancing causal attention (torch, Megatron); "
                                                    "off: cp consecutive chunks (axolotl)")
    ep: Int = Field(1, gt=0, description="expert-parallel degree of a MoE model: each MoE layer's routed experts split "
                                         "over ep ranks borrowed from the data-parallel ones (ep divides num_experts "
                                         "and the data-parallel degree); planned only, shardwise train refuses ep > 1")
    ep_load_imbalance: Finite = Field(1.0, ge=1.0, description="with ep > 1: tokens the busiest expert-parallel rank "
                                      "receives over the balanced share (1.0 balanced; an engine that drops tokens: "
                                      "its capacity factor)")
    etp: Int | None = Field(None, gt=0, description="with ep > 1 beside tp: the TP ranks each routed expert is split "
                            "over, 1 (whole experts; expert parallelism may borrow the TP ranks) or tp "
                            "(Megatron's --expert-tensor-parallel-size); unset: Megatron's tp, torchtitan's 1 "
                            "(planned only)")
    ep_overlap: bool = Field(False, description="with ep > 1: the dispatch/combine all-to-alls of one micro-batch "
                             "overlapped with another's compute (Megatron's --overlap-moe-expert-parallel-comm; under "
                             "pp > 1 with virtual stages only; planned only)")
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


# AdamW with its two moments kept as fp32 tensors, or block-quantized (docs/training.md, "Low-bit
# optimizer states"): the names the planner prices (shardwise.plan.optimizer.LOW_BIT_STATE_BYTES).
OptimizerName = Literal["adamw", "adamw8bit", "adamw4bit", "paged_adamw8bit"]


class OptimizerSection(_Section):
    name: OptimizerName = Field(
        "adamw", description="adamw: torch's AdamW, fp32 moments; adamw8bit / adamw4bit: torchao's AdamW8bit / "
        "AdamW4bit, each moment 8-bit (4-bit) codes with one fp32 scale per 256 (128) elements, under fsdp or ddp "
        "(pip install torchao); paged_adamw8bit: bitsandbytes' PagedAdamW8bit, 8-bit moments in CUDA unified "
        "memory, under ddp on CUDA. Not with DeepSpeed (its engine owns the optimizer) nor tensor parallelism")
    lr: Annotated[Finite, bounded(gt=0, le=MAX_LR, why=LR_WHY)] = Field(
        1e-4, description=f"peak learning rate (above 0, at most {MAX_LR:g})")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW's moment decay rates, each in [0, 1)")
    eps: Finite = Field(1e-8, gt=0)
    weight_decay: Finite = Field(0.0, ge=0, description="set explicitly: torch AdamW's default is 0.01")
    max_grad_norm: Finite = Field(1.0, ge=0, description="global-norm clipping; 0 disables")
    fused: bool | None = Field(None, description="fused AdamW; None = on CUDA only")
    in_backward: bool = Field(False, description="each parameter's AdamW step runs in backward as soon as its "
                              "gradient is final, which is then freed (no step holds every gradient); needs "
                              "max_grad_norm 0, grad_accum 1, an fsdp strategy or one ddp rank, no fp16")

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
# margin added, shardwise.train.launch.rank.COLLECTIVE_MARGIN_S); inf or 1e30 overflowed in every rank.
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
    activation: Literal["auto", "none", "full"] = Field(
        "auto", description="activation checkpointing per layer; auto: none where the run's plan fits the device "
        "without it, else full (the choice is printed)")
    offload: bool = Field(False, description="the tensors saved for backward move to host memory in forward and "
                          "come back in backward (with activation: full, only each layer's kept input); the last "
                          "decoder layer's and the output layer's stay on the device (docs/training.md)")
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
    dropout: Finite = Field(0.0, ge=0, lt=1, description="dropout on each adapter's input (PEFT lora_dropout; 0: "
                           "runs are reproducible across world sizes; above 0 each adapted linear keeps the dropped "
                           "input and its mask for backward)")
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
    """`loss:` — how the next-token cross-entropy is computed (shardwise.train.model.loss). Both give
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


# --- logging: how often and where a run reports (the console, metrics.jsonl, the trackers)

# The experiment trackers `logging.trackers` may list (shardwise.train.observe.trackers opens them).
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")
# The keys `logging.trackers` replaced, still read (a checkpoint's manifest records them) and
# rewritten into the new ones; `shardwise train` says so (LoggingSection.deprecation).
LEGACY_LOGGING_KEYS = ("tensorboard", "wandb", "wandb_project")


class WandbSection(_Section):
    """`logging.wandb`: Weights & Biases options (used when `wandb` is in logging.trackers)."""

    project: str = Field("shardwise", min_length=1, description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user); null: WANDB_ENTITY, else the "
                               "logged-in user's default")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="online; offline (the run is written under `dir` only, `wandb sync` uploads it "
        "later); disabled; null: WANDB_MODE, else online")
    dir: NonBlank | None = Field(None, description="directory W&B writes its run files under (a wandb/ folder); "
                            "null: WANDB_DIR, else checkpointing.output_dir")
    group: str | None = Field(None, description="W&B group; null: the run's lineage, so a resumed run is "
                              "grouped with the run it continues")
    tags: list[str] = Field(default_factory=list, description="W&B tags of the run")


class MlflowSection(_Section):
    """`logging.mlflow`: MLflow options (used when `mlflow` is in logging.trackers)."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (http://host:5000, databricks, sqlite:///mlflow.db, file:/dir); "
        "null: MLFLOW_TRACKING_URI, else a file store in checkpointing.output_dir/mlruns")
    experiment: str = Field("shardwise", min_length=1, description="MLflow experiment (created when missing)")
    tags: dict[str, str] = Field(default_factory=dict, description="MLflow tags of the run")


class LoggingSection(_Section):
    # 10: torchtitan's metrics.log_freq default
    every: Int = Field(10, gt=0, description="log every N steps: the losses and gradient norms reach the host "
                       "once per N steps (a step does not wait for the device in between) and the progress line "
                       "gets every N-th step; metrics.jsonl and the trackers get every step's record (written "
                       "then)")
    every_seconds: Finite | None = Field(60.0, gt=0, description="also log once this many seconds passed since "
                                        "the last logged step (whichever of every / every_seconds comes first): "
                                        "a batch log shows progress however slow a step is; null: steps only")
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        "auto", description="auto: a rich progress bar on a terminal, plain timestamped lines (never redrawn or "
        "cut) when stdout is not one (sbatch, nohup, a pipe); bar, lines, off force one (true = auto, "
        "false = off)")
    trackers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description=f"experiment trackers that get metrics.jsonl's records (train and eval), the run config "
        f"and the plan: any of {', '.join(TRACKER_NAMES)} ([] for none); wandb and mlflow need "
        "pip install 'shardwise[tracking]'")
    wandb: WandbSection = Field(default_factory=WandbSection, description="Weights & Biases options")
    mlflow: MlflowSection = Field(default_factory=MlflowSection, description="MLflow options")
    # the deprecated keys this section was written with (set by _legacy_keys; not a field)
    _legacy: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("progress", mode="before")
    @classmethod
    def _progress_bool(cls, v: Any) -> Any:
        return {True: "auto", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("trackers")
    @classmethod
    def _known_trackers(cls, v: list[str]) -> list[str]:
        names = [t.strip().lower() for t in v]
        for t in names:
            if t not in TRACKER_NAMES:
                raise ValueError(f"unknown tracker {t!r}. {did_you_mean(t, TRACKER_NAMES)}")
        twice = sorted({t for t in names if names.count(t) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once")
        return names

    @model_validator(mode="wrap")
    @classmethod
    def _legacy_keys(cls, data: Any, handler: Any) -> LoggingSection:
        data, legacy = _translate_legacy(data)
        section = handler(data)
        section._legacy = legacy
        return section

    def deprecation(self, where: str) -> str | None:
        """The note `shardwise train` prints when the config used the old keys: what they were
        read as, in the new spelling to write instead."""
        if not self._legacy:
            return None
        new = f"logging.trackers: [{', '.join(self.trackers)}]"
        if "wandb_project" in self._legacy:
            new += f" and logging.wandb.project: {self.wandb.project}"
        old = ", ".join(f"logging.{k}" for k in self._legacy)
        return (f"{where}: {old} {'is' if len(self._legacy) == 1 else 'are'} deprecated; this run uses {new} "
                "(where both are given, the new keys win); write that instead, the old keys will be removed")


def _translate_legacy(data: Any) -> tuple[Any, tuple[str, ...]]:
    """`logging` as written before `trackers` (tensorboard: bool, wandb: bool, wandb_project)
    rewritten into trackers + logging.wandb.project. The new keys win where both are given (a
    `--set logging.trackers=[...]` over a file with the old keys means what it says)."""
    if not isinstance(data, dict):
        return data, ()
    legacy = tuple(k for k in LEGACY_LOGGING_KEYS
                   if k in data and (k != "wandb" or isinstance(data[k], bool)))
    if not legacy:
        return data, ()
    data = dict(data)
    tensorboard = data.pop("tensorboard", True)
    wandb = data.pop("wandb") if "wandb" in legacy else False
    for key, value in (("tensorboard", tensorboard), ("wandb", wandb)):
        if not isinstance(value, bool):
            raise ValueError(f"logging.{key} = {value!r}: expected true or false (deprecated key: use "
                             "logging.trackers: [tensorboard, wandb, mlflow])")
    data.setdefault("trackers", [name for name, on in (("tensorboard", tensorboard), ("wandb", wandb)) if on])
    if "wandb_project" in data:
        project = data.pop("wandb_project")
        data["wandb"] = {"project": project, **(data.get("wandb") or {})}
    return data, legacy


# --- export: the dtype and the largest safetensors file of an exported Hugging Face directory

# `export.dtype: auto`: the dtype the run computes in (bf16-mixed trains in bf16, so its model is used in bf16;
# bf16-pure's weights are bf16 already).
EXPORT_DTYPE_OF_PRECISION = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "fp32", "bf16-pure": "bf16"}
SIZE_UNITS = "units TB, GB, MB, KB: powers of 1000, as Hugging Face's max_shard_size"


def shard_size_bytes(value: int | str) -> int:
    """`export.max_shard_size` in bytes: an int (bytes) or "5GB"/"500MB"/"2.5GB" parsed by
    huggingface_hub's parse_size_to_int, the parser transformers' save_pretrained uses."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        from huggingface_hub.serialization._base import parse_size_to_int

        try:
            n = parse_size_to_int(value)
        except (ValueError, OverflowError):  # "nanGB", "infGB"
            raise ValueError(f"expected bytes (an int) or a size like '5GB' or '500MB' ({SIZE_UNITS}), "
                             f"got {value!r}") from None
    else:
        raise ValueError(f"expected bytes (an int) or a size like '5GB' or '500MB' ({SIZE_UNITS}), "
                         f"got {value!r}")
    if n <= 0:
        raise ValueError(f"expected a size above 0 bytes, got {value!r} ({n} bytes)")
    return n


class ExportSection(_Section):
    """`export:` — the Hugging Face directory written by `checkpointing.save_final`, `shardwise export`
    and a LoRA run's merged model (shardwise.train.export.hf_dir.write_hf)."""

    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="dtype of the exported weights; auto = the run's compute dtype (precision "
        "bf16-mixed and bf16-pure: bf16, fp16-mixed: fp16, fp32: fp32); the checkpoint keeps the master weights "
        "(fp32; bf16 under bf16-pure)")
    max_shard_size: int | str = Field(
        "5GB", description="largest safetensors file: bytes, or a size like '5GB'/'500MB' (TB, GB, MB, KB: "
        "powers of 1000); more weights than this are split into model-0000i-of-0000N.safetensors with a "
        "model.safetensors.index.json; a tensor larger than it gets a file of its own")

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _size(cls, v: object) -> object:
        shard_size_bytes(v)  # type: ignore[arg-type]  # refuses anything but an int or a size string
        return v

    @property
    def max_shard_bytes(self) -> int:
        return shard_size_bytes(self.max_shard_size)


class TrainConfig(_Section):
    name: str = "run"
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    strategy: StrategySection = StrategySection()
    optimizer: OptimizerSection = OptimizerSection()
    schedule: ScheduleSection = ScheduleSection()
    precision: Precision = Field("bf16-mixed", description=PRECISION_WHY)
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
