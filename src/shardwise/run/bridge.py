"""The one bridge between the trainer's YAML (`TrainConfig`) and the planner's specs.

`run_spec(cfg, world_size, device)` → `RunSpec` (ModelSpec, HardwareSpec, TrainSpec, Strategy
with every engine knob, ParallelLayout): what preflight plans, what the engines build, what
metrics divide by, and what `plan --emit` and the benches use. `to_config(...)` is its inverse:
the emitted `shardwise.yaml` is made by it, and `run_spec(to_config(specs))` gives the specs back.

Torch-free: the trainer's preflight and `shardwise plan` import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, get_args

from shardwise.config.load import validate
from shardwise.config.schema import LoraSection, ModelSection, OptimizerSection, TrainConfig
from shardwise.config.strategy import DDPKnobs, DeepSpeedKnobs, FSDPKnobs
from shardwise.errors import ShardwiseError
from shardwise.plan.recompute import RecomputeChoice
from shardwise.run import resolve
from shardwise.specs import HardwareSpec, ModelSpec, ParallelLayout, Strategy, TrainSpec
from shardwise.specs.pipeline import schedule_refusal

# DeepSpeed's 5e8-element default buckets allocate GBs per rank on CPU and slow tiny runs
# 3-5× (docs/reference.md "DeepSpeed defaults and their memory effect"); on CPU the trainer uses 1e6.
CPU_BUCKET_ELEMENTS = 1_000_000


def trainer_knobs(device: str) -> tuple[DeepSpeedKnobs, FSDPKnobs, DDPKnobs]:
    """The knobs a config gets when it leaves a field unset (None).

    DeepSpeed reduces gradients in fp32 (its default is the param dtype): parity with FSDP2's
    reduce_dtype=fp32 and DDP's fp32 grads; the planner counts the 4 bytes it costs.
    ZeRO-3's fetch unit is the planned one on every device. (CPU runs kept DeepSpeed's
    per-submodule unit while gloo ranks could abort in the interpreter's shutdown, more often
    with whole layers; every rank now ends through `os._exit`: shardwise.train.launch.rank.)
    """
    ds: dict[str, Any] = {"communication_data_type": "fp32"}
    if device == "cpu":
        ds |= {"reduce_bucket_size": CPU_BUCKET_ELEMENTS, "allgather_bucket_size": CPU_BUCKET_ELEMENTS,
               "prefetch_bucket_size": CPU_BUCKET_ELEMENTS}
    return DeepSpeedKnobs(**ds), FSDPKnobs(), DDPKnobs()


@dataclass(frozen=True)
class RunSpec:
    """One run, described once: the validated config and the planner's view of it."""

    config: TrainConfig
    device: str  # "cpu" | "cuda"
    model: ModelSpec
    hardware: HardwareSpec
    train: TrainSpec
    strategy: Strategy
    layout: ParallelLayout
    recompute: RecomputeChoice | None = None  # what `checkpointing: auto` became and why (plan/recompute.py); None where set

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @cached_property
    def engine_strategy(self) -> Strategy:
        """The strategy the engines run: `strategy`, or the DDP that FSDP2 with a one-rank shard
        group runs as (FSDPKnobs.single_rank; decided by the plan, as `plan` shows it)."""
        from shardwise.plan.evaluate import single_rank_runs_as

        return single_rank_runs_as(self.model, self.hardware, self.train, self.strategy) or self.strategy

    @cached_property
    def grad_sync(self):
        """FSDP2 under accumulation: whether the engine holds the unsharded grads between
        micro-batches (one reduce-scatter per step) or reduce-scatters every micro-batch, and
        why; None where there is no choice (not FSDP2, one micro-batch per step). The planner's
        decision (shardwise.plan.evaluate.fsdp_grad_sync) on the specs and memory preflight plans with."""
        from shardwise.plan.evaluate import fsdp_grad_sync

        return fsdp_grad_sync(self.model, self.hardware, self.train, self.engine_strategy)


def seq_len(cfg: TrainConfig) -> int:
    return cfg.data.synthetic.seq_len if cfg.data.kind == "synthetic" else cfg.data.sft.max_length


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The planner's ModelSpec of the configured model: `model.name` as shardwise.catalog.get_model
    resolves a name (a catalog key or Hugging Face id; another id's config.json from the Hugging
    Face cache or Hub), or `model.path`'s config.json."""
    if cfg.model.path is None:
        from shardwise.catalog import get_model

        return get_model(cfg.model.name or "")
    return ModelSpec.from_hf_config(cfg.model.path)


def optimizer_impl(cfg: TrainConfig, device: str) -> str:
    """The AdamW kernel the engines build (train/engines/_torch_common.py `build_adamw`, and
    DeepSpeed's `torch_adam` + `fused`): fused where asked (default: on CUDA), else torch's
    choice for the device — foreach on CUDA, the for-loop on CPU. Optimizer offload steps on
    the host (DeepSpeedCPUAdam): nothing on the GPU."""
    return _adamw_impl(cfg.optimizer.fused_on(device), device)


def _adamw_impl(fused: bool, device: str) -> str:
    if fused:
        return "fused"
    return "foreach" if device == "cuda" else "forloop"


def compiled(cfg: TrainConfig, device: str) -> bool:
    """Whether the trainer compiles the decoder layers (shardwise.train.model.compile): the planner
    prices and saves them as fused kernels (`TrainSpec.fused_kernels`)."""
    try:
        engine = Strategy.from_name(cfg.strategy.name).engine
    except ShardwiseError as e:
        raise ShardwiseError(f"{cfg.source}: strategy: {e}") from None
    return resolve.compile_enabled(cfg, device, engine)


def _model_type(cfg: TrainConfig) -> str:
    """The configured model's family: the catalog's, or config.json's `model_type` (read, not
    built: a missing or bad file is refused by the model checks, not here)."""
    if cfg.model.path is None:
        from shardwise.catalog import get_model

        return get_model(cfg.model.name or "").family
    import json

    try:
        doc = json.loads((Path(cfg.model.path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return "hf"
    return str(doc.get("model_type", "hf")) if isinstance(doc, dict) else "hf"


def packed_attention(cfg: TrainConfig, device: str, family: str | None = None) -> str:
    """What keeps the documents of an SFT row apart in this run (`data.sft.packed_attention`
    resolved for the device and model: shardwise.run.resolve.packed_attention), planned and built.
    `family`: the model's, when the caller holds its spec (else read from the config)."""
    return resolve.packed_attention(cfg.data.sft.packed_attention, data_kind=cfg.data.kind, device=device,
                   attention=cfg.model.attention, family=family or _model_type(cfg), precision=cfg.precision,
                   source=cfg.source)


def train_spec(cfg: TrainConfig, device: str = "cuda", *, family: str | None = None, **overrides: Any) -> TrainSpec:
    fields = {
        "optimizer_impl": optimizer_impl(cfg, device),
        # the allocator setting the ranks inherit from this process's environment
        "expandable_segments": any("expandable_segments:true" in os.environ.get(k, "").lower()
                                   for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")),
        "seq_len": seq_len(cfg),
        "micro_batch": cfg.run.micro_batch,
        "grad_accum": cfg.run.grad_accum,
        "precision": cfg.precision,
        "optimizer": cfg.optimizer.name,
        "checkpointing": cfg.checkpointing.activation,
        "attention": cfg.model.attention,
        "packed_attention": packed_attention(cfg, device, family),
        "fused_kernels": compiled(cfg, device),
        "cross_entropy": cfg.loss.implementation,
        "ce_chunk": cfg.loss.chunk_tokens,
        "weight_decay": cfg.optimizer.weight_decay,
        "optimizer_in_backward": cfg.optimizer.in_backward,
        "activation_offload": cfg.checkpointing.offload,
    }
    if cfg.lora is not None:
        t = cfg.lora.target_modules
        fields |= {"lora_rank": cfg.lora.rank, "lora_targets": ("all-linear",) if t == "all-linear" else tuple(t),
                   "lora_modules_to_save": tuple(cfg.lora.modules_to_save), "base_quant": cfg.lora.quantization,
                   "lora_dropout": cfg.lora.dropout}
    return TrainSpec(**(fields | overrides))


def trainer_defaults(device: str, family: str, *, lora: bool) -> dict[str, Any]:
    """The TrainSpec fields `shardwise train` runs when the YAML leaves every field at the schema's
    default (with a `lora:` section at its defaults where `lora`), on `device`, for a model of
    `family`: what `shardwise plan` plans for each run flag not given. The compile decision is
    left per strategy (`compiled_engines`), as the trainer makes it per engine."""
    cfg = TrainConfig(lora=LoraSection() if lora else None)
    return train_spec(cfg, device, family=family).model_dump() | {
        "compiled_engines": resolve.COMPILED_ENGINES if device == "cuda" else ()}


def strategy(cfg: TrainConfig, device: str) -> Strategy:
    """Strategy with every knob: the config's values, the trainer's defaults where unset."""
    s = cfg.strategy
    defaults = trainer_knobs(device)
    sections = (s.deepspeed, s.fsdp, s.ddp)
    ds, fsdp, ddp = (
        d.model_copy(update={k: v for k, v in sec.model_dump().items() if v is not None})
        for d, sec in zip(defaults, sections, strict=True)
    )
    kw: dict[str, Any] = {"ds": ds, "fsdp": fsdp, "ddp": ddp}
    if s.shard_group is not None:
        kw["shard_group"] = s.shard_group
    if s.tp != 1:
        kw["tp"] = s.tp
    if s.pp != 1:
        kw |= {"pp": s.pp, "pp_schedule": s.pp_schedule, "pp_virtual_stages": s.pp_virtual_stages}
    elif s.pp_virtual_stages != 1:
        kw["pp_virtual_stages"] = s.pp_virtual_stages  # refused by Strategy: it needs pp > 1
    if s.cp != 1 or s.cp_impl != "auto" or not s.cp_load_balance:
        kw |= {"cp": s.cp, "cp_impl": s.cp_impl, "cp_load_balance": s.cp_load_balance}
    if s.ep != 1 or s.ep_load_imbalance != 1.0 or s.etp is not None or s.ep_overlap:
        # refused here, before any rank starts: the planner prices expert parallelism
        # (shardwise.plan.experts), the trainer runs no MoE dispatch
        raise ShardwiseError(f"{cfg.source}: strategy.ep {s.ep}: expert parallelism is planned only (shardwise plan "
                             "--ep); shardwise train runs none. Set strategy.ep to 1 (and drop "
                             "strategy.ep_load_imbalance, strategy.etp and strategy.ep_overlap) to train")
    try:
        return Strategy.from_name(s.name, **kw)
    except ShardwiseError as e:
        raise ShardwiseError(f"{cfg.source}: strategy: {e}") from None


def gpus_per_node(cfg: TrainConfig, world_size: int, environ: dict[str, str] | None = None) -> int:
    """Ranks per node: the config's, else the launcher's LOCAL_WORLD_SIZE (torchrun, deepspeed),
    SLURM_NTASKS_PER_NODE (srun), else every rank on one node (`--nproc` spawns locally)."""
    if cfg.hardware.gpus_per_node is not None:
        return cfg.hardware.gpus_per_node
    return launcher_ranks_per_node(world_size, environ)


def launcher_ranks_per_node(world_size: int, environ: dict[str, str] | None = None) -> int:
    """Ranks per node as the launcher says: LOCAL_WORLD_SIZE (torchrun, deepspeed),
    SLURM_NTASKS_PER_NODE (srun), else every rank on one node."""
    e = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = e.get(key, "")
        if value.isdigit() and int(value) > 0:
            return min(int(value), world_size)
    return world_size


def _hardware(cfg: TrainConfig, world_size: int, per_node: int) -> HardwareSpec:
    """The planned hardware: `hardware.machine` (a doctor spec file, or `auto`: this node read
    now) with `hardware.gpu` overriding its GPU where set, else the catalog GPU `hardware.gpu`."""
    from shardwise.catalog import build_hardware

    h = cfg.hardware
    gpu = h.gpu if "gpu" in h.model_fields_set or h.machine is None else None
    if h.machine is None:
        return build_hardware(gpu=h.gpu, gpus=world_size, gpus_per_node=per_node)
    if h.machine.strip().lower() == "auto":
        from shardwise.doctor import machine_hardware

        spec = machine_hardware()
        if spec.gpu is None and gpu is None:  # no GPU here (a CPU run): the catalog GPU it names
            return build_hardware(gpu=h.gpu, gpus=world_size, gpus_per_node=per_node)
    else:
        from shardwise.specs.machine import load_machine

        spec = load_machine(h.machine)  # relative to the cwd, like the data paths
    return spec.hardware(gpus=world_size, gpus_per_node=per_node, gpu=gpu)


def run_spec(cfg: TrainConfig, world_size: int, device: str, *, environ: dict[str, str] | None = None,
             model: ModelSpec | None = None, recompute: RecomputeChoice | None = None,
             forked: bool | None = None) -> RunSpec:
    """The run `cfg` describes on `world_size` ranks of `device`; refuses impossible layouts
    with the config file in the message. `model`: the spec of the configured model when the
    caller already holds it (`plan --emit` of a config.json: its path in the emitted config is
    the user's to fill in, so nothing is read back from it). `recompute`: what `checkpointing: auto`
    was decided to be by the launcher that checked the run (its ranks keep it, whatever the node's
    memory says once they run); else it is decided here (`decided_checkpointing`; `forked`: whether
    CPU ranks are forked, as shardwise.plan.host_cpu.cpu_rank_memory takes it)."""

    per_node = gpus_per_node(cfg, world_size, environ)
    model = model or model_spec(cfg)
    strat = strategy(cfg, device)
    if strat.cp > 1:
        raise ShardwiseError(f"{cfg.source}: strategy.cp {strat.cp}: context parallelism is planned only "
                             f"(shardwise plan --cp {strat.cp}); shardwise train runs cp 1")
    profile = None
    if cfg.hardware.profile:  # its own errors name the profile file (relative to the cwd, like the data paths)
        from shardwise.specs.profile import load_profile

        profile = load_profile(cfg.hardware.profile, device=device)
    try:
        hw = _hardware(cfg, world_size, per_node)
        if profile is not None:
            hw = profile.apply(hw)
        layout = ParallelLayout.for_strategy(strat, world_size, per_node)
        layout.check_model(model)
    except ShardwiseError as e:
        what = (f"strategy.name {strat.name!r}" + (f" with strategy.tp {strat.tp}" if strat.tp > 1 else "")
                + (f" with strategy.pp {strat.pp}" if strat.pp > 1 else ""))
        raise ShardwiseError(f"{cfg.source}: {what} cannot run on {world_size} rank(s): {e}") from None
    why = schedule_refusal(strat.pp, strat.pp_schedule, strat.pp_virtual_stages, cfg.run.grad_accum, model.num_layers)
    if why:
        raise ShardwiseError(f"{cfg.source}: strategy.pp_schedule / run.grad_accum: {why}")
    run = RunSpec(config=cfg, device=device, model=model, hardware=hw, train=train_spec(cfg, device, family=model.family),
                  strategy=strat, layout=layout)
    run = decided_checkpointing(run, recompute, forked)
    resolve.check_tensor_parallel(run)
    resolve.check_pipeline(run)
    resolve.check_fsdp_units(run)
    return run


def decided_checkpointing(run: RunSpec, decided: RecomputeChoice | None = None,
                          forked: bool | None = None) -> RunSpec:
    """`run` with `checkpointing: auto` decided as the planner decides it (plan/recompute.py): on
    CUDA from the GPU plan the memory preflight checks (plan.evaluate.checkpointing_choice), on
    CPU from the host plan of the node's ranks against its memory (`hardware.host_memory_gb`,
    else MemAvailable: plan.host_cpu.cpu_checkpointing_choice); `decided`: already decided (by
    the launcher, for its ranks)."""
    if run.train.checkpointing != "auto":
        return run
    if decided is not None:
        choice = decided
    elif run.device == "cpu":
        from shardwise.plan.host_cpu import cpu_checkpointing_choice
        from shardwise.run.host import node_memory

        have = node_memory(run.config.hardware.host_memory_gb, "hardware.host_memory_gb")
        choice = cpu_checkpointing_choice(run.model, run.hardware, run.train, run.strategy,
                                          have[0] if have else None, forked)
    else:
        from shardwise.plan.evaluate import checkpointing_choice

        choice = checkpointing_choice(run.model, run.hardware, run.train, run.strategy)
    return replace(run, train=run.train.model_copy(update={"checkpointing": choice.checkpointing}), recompute=choice)


# --- the inverse: specs -> TrainConfig -----------------------------------------------------


def _knob_overrides(knobs: Any, default: Any) -> dict[str, Any]:
    """Only what differs from the trainer's default: the config stays in its normal form."""
    return {k: v for k, v in knobs.model_dump().items() if v != getattr(default, k)}


def _set_packed_attention(raw: dict[str, Any], train: TrainSpec, model: ModelSpec, attention: str, precision: str,
                          device: str) -> None:
    """`data.sft.packed_attention` for the planned kernel, where the base's choice would not run
    it (none, a plan without documents, keeps the base's)."""
    sft = raw["data"]["sft"]
    if train.packed_attention == "none":
        return
    runs = resolve.packed_attention(sft.get("packed_attention", "auto"), data_kind="sft", device=device, attention=attention,
                   family=model.family, precision=precision)
    if runs != train.packed_attention:
        sft["packed_attention"] = {"flash_varlen": "varlen", "sdpa_varlen": "varlen"}.get(
            train.packed_attention, train.packed_attention)


def to_config(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, strategy: Strategy, *,
              base: TrainConfig | None = None, device: str = "cuda") -> tuple[TrainConfig, list[str]]:
    """The TrainConfig that runs these specs, and notes on what the trainer cannot run as planned.

    Sections the specs do not describe (optimizer values, schedule, data files, logging, output)
    come from `base` (default: TrainConfig's defaults). Where the plan used a setting the trainer
    does not offer (bf16-pure under DeepSpeed, selective checkpointing, flash attention, SGD/8-bit Adam),
    the nearest accepted value is written and the difference is returned as a note: a silently
    different run would make the plan's numbers lie.
    """
    from shardwise import catalog

    if not strategy.trainable:
        raise ShardwiseError(
            f"the trainer runs data parallelism, pipeline parallelism with FSDP2 (no offload), and tensor "
            f"parallelism (no offload) with FSDP2 through DTensor or with ZeRO-1/2 through DeepSpeed's AutoTP; "
            f"{strategy.name} has tp {strategy.tp}, pp {strategy.pp}, TP scheme {strategy.tp_scheme.name}"
            + (f", cp {strategy.cp} (context parallelism is planned only)" if strategy.cp > 1 else ""))
    train = train.for_engine(strategy.engine)
    notes: list[str] = []
    if strategy.zero_impl == "megatron":
        notes.append("planned Megatron-Core's distributed optimizer (--zero-impl megatron: an fp32 gradient buffer "
                     "the size of the model); the trainer and the DeepSpeed JSON run DeepSpeed's ZeRO-1: plan it with "
                     "--zero-impl deepspeed")
    precision = train.precision
    if precision == "bf16-pure" and strategy.engine == "deepspeed":
        # the trainer refuses bf16-pure there (shardwise.train.preflight.check_precision)
        notes.append(f"planned bf16-pure; the trainer runs {strategy.name} in bf16-mixed (DeepSpeed's bf16 keeps fp32 "
                     "master weights: more memory), or pick an fsdp or ddp strategy for bf16-pure")
        precision = "bf16-mixed"
    activation = {"none": "none", "full": "full", "selective": "full", "auto": "auto"}[train.checkpointing]
    if train.checkpointing == "selective":
        notes.append("planned selective checkpointing; the trainer offers full (less memory, more recompute)")
    attention = train.attention
    if attention not in get_args(ModelSection.model_fields["attention"].annotation):  # a kernel only planned
        notes.append(f"planned {attention} attention; the trainer uses sdpa (same O(seq) memory with its flash kernel)")
        attention = "sdpa"
    optimizer = train.optimizer
    if optimizer == "sgd":
        notes.append(f"planned optimizer {train.optimizer!r}; the trainer (and the DeepSpeed JSON) use AdamW")
        optimizer = "adamw"
    else:
        from shardwise.plan.evaluate import single_rank_runs_as

        engine = single_rank_runs_as(model, hw, train, strategy) or strategy
        why = engine.low_bit_refusal(optimizer, device)
        if why:
            notes.append(f"planned optimizer {optimizer!r}, which the trainer does not run here: {why}; "
                         "it runs AdamW (fp32 states)")
            optimizer = "adamw"

    b = base or TrainConfig(name=f"{model.name}-{strategy.name}")
    raw = b.model_dump(exclude={"source"})
    if base is None:
        if model.name in catalog.model_names():
            # a catalog name builds that architecture with random weights; real SFT wants `path`
            raw["model"] |= {"name": model.name, "path": None}
        else:
            raw["model"] |= {"name": None, "path": f"/path/to/{model.name}"}
        raw["run"] |= {"nproc": hw.gpus_per_node, "device": device}
        raw["checkpointing"]["output_dir"] = f"runs/{model.name}-{strategy.name}"
        raw["hardware"]["check_memory"] = True
        # DeepSpeed's WarmupDecayLR (linear warmup) is what ds_config.json carries too
        raw["schedule"]["kind"] = "warmup_decay"
    raw["model"]["attention"] = attention
    if raw["data"]["kind"] == "synthetic":
        raw["data"]["synthetic"]["seq_len"] = train.seq_len
    else:
        raw["data"]["sft"]["max_length"] = train.seq_len
        _set_packed_attention(raw, train, model, attention, precision, device)
    knobs = trainer_knobs(device)
    raw["strategy"] = {
        "name": strategy.name,
        "shard_group": strategy.shard_group,
        "tp": strategy.tp,
        "pp": strategy.pp,
        "pp_schedule": strategy.pp_schedule,
        "pp_virtual_stages": strategy.pp_virtual_stages,
        "deepspeed": _knob_overrides(strategy.ds, knobs[0]),
        "fsdp": _knob_overrides(strategy.fsdp, knobs[1]),
        "ddp": _knob_overrides(strategy.ddp, knobs[2]),
    }
    raw["precision"] = precision
    if train.optimizer_impl != _adamw_impl(OptimizerSection().fused_on(device), device):  # not the default
        raw["optimizer"]["fused"] = train.optimizer_impl == "fused"
        if train.optimizer_impl == "forloop" and device == "cuda":
            notes.append("planned a for-loop AdamW step; on CUDA the trainer runs foreach unless fused")
    raw["run"] |= {"micro_batch": train.micro_batch, "grad_accum": train.grad_accum}
    raw["optimizer"]["weight_decay"] = train.weight_decay  # its optimizer groups are in the plan
    raw["optimizer"]["name"] = optimizer
    if train.optimizer_in_backward:  # not clipped by the global norm: nothing waits for every gradient
        raw["optimizer"] |= {"in_backward": True, "max_grad_norm": 0.0}
    # fused kernels = compiled decoder layers; the DeepSpeed engines run eagerly here
    compiles = strategy.engine in resolve.COMPILED_ENGINES
    current = raw["run"].get("compile")
    resolved = (device == "cuda" if current is None else bool(current)) and compiles
    if resolved != (train.fused_kernels and compiles):  # else the config already says it (None stays None)
        raw["run"]["compile"] = train.fused_kernels and compiles
    if train.fused_kernels and not compiles:
        notes.append("planned fused kernels (torch.compile); the trainer runs DeepSpeed's engines eagerly")
    if train.fused_norm and not (train.fused_kernels and compiles):
        notes.append("planned a fused RMSNorm kernel; the trainer runs HF's eager RMSNorm unless its layers are "
                     "compiled (run.compile)")
    if train.fused_mlp:
        notes.append("planned a fused SwiGLU/GeGLU kernel (Liger's); the trainer runs HF's eager MLP, which saves "
                     "act(gate) too")
    raw["checkpointing"]["activation"] = activation
    if train.activation_offload:
        raw["checkpointing"]["offload"] = True
    raw["loss"] = {"implementation": "standard" if train.cross_entropy == "standard" else "chunked",
                   "chunk_tokens": train.ce_chunk}
    kernel = {"fused": "Liger's fused linear cross-entropy", "inplace": "flash-attn's in-place cross-entropy",
              "chunked-output": "torchtune's chunked-output cross-entropy"}
    if train.cross_entropy in kernel:
        notes.append(f"planned {kernel[train.cross_entropy]}; the trainer runs its chunked one "
                     f"(lm_head and the loss fused per {train.ce_chunk} tokens): plan it with cross_entropy chunked")
    if train.lora_rank:
        lora = dict(raw.get("lora") or {})
        targets = train.lora_targets
        lora |= {"rank": train.lora_rank, "modules_to_save": list(train.lora_modules_to_save),
                 "dropout": train.lora_dropout,
                 "target_modules": "all-linear" if targets == ("all-linear",) else list(targets),
                 "quantization": train.base_quant}
        raw["lora"] = lora
    else:
        raw["lora"] = None
    raw["hardware"] |= {"gpu": hw.gpu.name, "gpus_per_node": hw.gpus_per_node if hw.nodes > 1 else
                        raw["hardware"]["gpus_per_node"]}
    return validate(raw, source=b.source), notes


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """`cfg` as the YAML mapping `load_config` reads back to an equal TrainConfig: every field,
    except unset engine knobs (None = the trainer's default), data.sft fields at their default, and
    strategy.tp / pp / ep at 1 (with pp 1, the pipeline schedule at its default too)."""
    raw = cfg.model_dump(mode="json", exclude={"source"})
    raw["strategy"] = {k: ({kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v)
                       for k, v in raw["strategy"].items()}
    at_default = {"tp": 1, "pp": 1, "ep": 1, "ep_load_imbalance": 1.0}
    if cfg.strategy.pp == 1:  # a pipeline's schedule is written out: it says what its stages run
        at_default |= {"pp_schedule": "1f1b", "pp_virtual_stages": 1}
    raw["strategy"] = {k: v for k, v in raw["strategy"].items()
                       if v not in ({}, None) and not (k in at_default and v == at_default[k])}
    raw["data"]["sft"] = cfg.data.sft.model_dump(mode="json", exclude_defaults=True)
    return raw
