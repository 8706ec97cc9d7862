"""shardwise's own training YAML: the RunSpec `shardwise train` plans (shardwise.run.run_spec),
with `--set KEY=VALUE` applied as the trainer applies it (shardwise.config.load.load_config).
Plan and train share one config surface: the specs planned are the trainer's preflight's."""

from __future__ import annotations

from typing import Any

from shardwise.ingest.common import Context, Doc, Source, dotted, flatten

TOP = {"name", "model", "data", "strategy", "optimizer", "schedule", "precision", "run", "checkpointing", "logging",
       "hardware", "lora", "loss", "export"}
# Keys (dotted prefixes) that change the plan; the rest are the trainer's own business.
PLANNED = ("model", "data.kind", "data.sft.max_length", "data.sft.packing", "data.sft.packed_attention",
           "data.synthetic.seq_len", "strategy", "optimizer.weight_decay", "optimizer.fused", "optimizer.name",
           "optimizer.in_backward",
           "precision", "run.micro_batch", "run.grad_accum", "run.nproc", "run.compile", "checkpointing.activation",
           "checkpointing.offload",
           "hardware.gpu", "hardware.gpus_per_node", "hardware.profile", "hardware.host_memory_gb", "lora", "loss")
UNUSED = {"lora.alpha", "lora.save_merged", "model.trust_remote_code", "model.random_init"}


def is_shardwise(data: dict[str, Any]) -> bool:
    return bool(data) and set(data) <= TOP and bool(set(data) & {"strategy", "run", "model", "data"})


def _fill_placeholders(doc: Doc, sets: list[str], src: Source) -> list[str]:
    """`plan --emit`'s placeholders (the real weights, the training data) that no --set replaces:
    the trainer refuses them, the plan does not need them. The model's path left empty plans
    model.name (the catalog architecture); the data files, the bundled sample (what is planned is
    their length, data.sft.max_length)."""
    from shardwise.config.load import _placeholders, override_key

    given = {override_key(o) for o in sets}
    out = []
    for key, _ in _placeholders(doc.data):
        path = tuple(k for k in key if not isinstance(k, int))
        if path in given:
            continue
        value = "[]" if isinstance(key[-1], int) else ""
        assignment = f"{'.'.join(path)}={value}"
        if assignment not in out:
            out.append(assignment)
            src.notes.append(f"{'.'.join(path)}: a plan --emit placeholder; planned without it (--set {assignment})"
                             " — shardwise train still refuses it until it is replaced")
    return out


def read(doc: Doc, ctx: Context) -> Source:
    from shardwise.config.load import load_config
    from shardwise.config.strategy import STRATEGY_NAMES, DDPKnobs, DeepSpeedKnobs, FSDPKnobs
    from shardwise.run import run_spec

    src = Source("shardwise", doc.path, family=STRATEGY_NAMES)
    cfg = load_config(doc.path, [*_fill_placeholders(doc, ctx.sets, src), *ctx.sets])
    world = ctx.given.get("gpus", cfg.run.nproc)
    device = ctx.given.get("device", cfg.run.device if cfg.run.device in ("cpu", "cuda") else "cuda")
    # expert and context parallelism are planned only (shardwise train refuses them, run.bridge):
    # the rest of the run is planned as the trainer plans it, with strategy.ep / ep_load_imbalance /
    # etp as --ep / --ep-load-imbalance / --etp (plan/experts.py) and strategy.cp / cp_impl / cp_load_balance
    # as --cp / --cp-impl / --cp-load-balance (plan/context.py)
    no_ep = {"ep": 1, "ep_load_imbalance": 1.0, "etp": None, "ep_overlap": False}
    ep = {k: getattr(cfg.strategy, k) for k in no_ep}
    if ep != no_ep:
        cfg = cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update=no_ep)})
    cp = {k: getattr(cfg.strategy, k) for k in ("cp", "cp_impl", "cp_load_balance")}
    if cp != {"cp": 1, "cp_impl": "auto", "cp_load_balance": True}:
        cfg = cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update={"cp": 1, "cp_impl": "auto",
                                                                                  "cp_load_balance": True})})
    run = run_spec(cfg, world, device, environ={})
    t, hw, s = run.train, run.hardware, run.strategy
    v = src.values
    if ep != no_ep:
        v |= {k: x for k, x in ep.items() if x is not None}
        etp = f" --etp {ep['etp']}" if ep["etp"] is not None else ""
        overlap = " --ep-overlap" if ep["ep_overlap"] else ""
        src.read.append(("strategy.ep", f"--ep {ep['ep']} --ep-load-imbalance {ep['ep_load_imbalance']}{etp}{overlap} "
                                        "(planned only: shardwise train refuses expert parallelism)"))
    if cp != {"cp": 1, "cp_impl": "auto", "cp_load_balance": True}:
        v |= cp
        src.read.append(("strategy.cp", f"--cp {cp['cp']} --cp-impl {cp['cp_impl']}"
                         + ("" if cp["cp_load_balance"] else " --no-cp-load-balance")
                         + " (planned only: shardwise train refuses context parallelism)"))
    if cfg.model.path is not None:
        v["model_config"] = cfg.model.path
    else:
        v["model"] = cfg.model.name
    v |= {"device": device, "gpu": cfg.hardware.gpu, "gpus": world, "gpus_per_node": hw.gpus_per_node,
          "profile": cfg.hardware.profile, "host_memory_gb": cfg.hardware.host_memory_gb,
          "seq_len": t.seq_len, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "precision": t.precision,
          "optimizer": t.optimizer, "attention": t.attention,
          "packed_attention": t.packed_attention, "lora_rank": t.lora_rank, "lora_targets": ",".join(t.lora_targets),
          "lora_modules_to_save": ",".join(t.lora_modules_to_save), "lora_dropout": t.lora_dropout,
          "qlora": t.base_quant == "nf4",
          "cross_entropy": t.cross_entropy, "optimizer_impl": t.optimizer_impl, "weight_decay": t.weight_decay,
          "optimizer_in_backward": t.optimizer_in_backward, "activation_offload": t.activation_offload, "fused_kernels": t.fused_kernels, "fused_norm": t.fused_norm, "expandable_segments": t.expandable_segments,
          "strategy": [s.name]}
    # "auto" decided per row on the plan's hardware, as the trainer decides it on the run's
    v["checkpointing"] = "auto" if cfg.checkpointing.activation == "auto" else t.checkpointing
    if t.cross_entropy == "chunked":
        v["ce_chunk"] = t.ce_chunk
    if s.tp > 1:  # FSDP2 x TP (DTensor) or ZeRO-1/2 x AutoTP, planned as the trainer runs it
        v["tp"] = s.tp
    if s.pp > 1:  # FSDP2 stages under the schedule the trainer runs (run_spec refused any it does not)
        v |= {"pp": s.pp, "pp_schedule": s.pp_schedule}
        if s.pp_virtual_stages > 1:
            v["pp_virtual_stages"] = s.pp_virtual_stages
    for sec, knobs, cls in (("ds", s.ds, DeepSpeedKnobs), ("fsdp", s.fsdp, FSDPKnobs), ("ddp", s.ddp, DDPKnobs)):
        default = cls()
        src.knobs[sec] = {k: x for k, x in knobs.model_dump().items() if x != getattr(default, k)}
    if s.shard_group is not None:
        src.shard_group = s.shard_group
    for key, value in flatten(doc.data).items():
        d = dotted(key)
        if d in ("strategy.ep", "strategy.ep_load_imbalance", "strategy.etp", "strategy.ep_overlap") and v.get("ep") is not None:
            continue  # read above, as --ep
        if d in ("strategy.cp", "strategy.cp_impl", "strategy.cp_load_balance") and v.get("cp") is not None:
            continue  # read above, as --cp
        if d in UNUSED or not any(d == p or d.startswith(p + ".") for p in PLANNED):
            src.ignored.append((d, "the trainer's setting; no change to memory or time"))
        else:
            src.read.append((d, f"{value!r} (the trainer's RunSpec)"))
    for o in ctx.sets:
        src.read.append((f"--set {o}", "applied as shardwise train applies it"))
    if "gpus" not in ctx.given:
        src.notes.append(f"planned on run.nproc = {cfg.run.nproc} GPU(s); pass --gpus for more nodes")
    src.notes.append(f"planned as the trainer plans it on {'CPU' if device == 'cpu' else 'CUDA'} (run.device, compile "
                     f"and packed attention resolved for {'CPU ranks' if device == 'cpu' else 'a GPU'})")
    src.keys_of = lambda st: {"strategy.name": st.strategy, "run.micro_batch": st.micro_batch,
                              "run.grad_accum": st.grad_accum,
                              "checkpointing.activation": st.checkpointing if st.checkpointing in ("none", "auto")
                              else "full"}
    src.saver_keys = _saver_keys
    return src


def _saver_keys(t) -> dict[str, Any]:
    """The training YAML's keys for the memory savers `t` (a TrainSpec) has on."""
    out: dict[str, Any] = {}
    if t.optimizer_in_backward:  # nothing may wait for every gradient: no clipping by the global norm
        out |= {"optimizer.in_backward": True, "optimizer.max_grad_norm": 0.0}
    if t.activation_offload:
        out["checkpointing.offload"] = True
    if t.optimizer != "adamw":
        out["optimizer.name"] = t.optimizer
    if t.precision == "bf16-pure":
        out["precision"] = "bf16-pure"
    return out
