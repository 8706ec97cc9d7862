"""What a running engine actually uses, read back from the engine objects (not from our config):
bucket sizes, shard group, precision, gradient reduce dtype, resharding, activation
checkpointing. Set beside the RunSpec the planner saw, any disagreement between "what was
planned" and "what runs" shows as a differing key (tests/run/test_run_bridge.py).

`measure_settings(cases)` builds each case's engine on 2 CPU ranks (gloo; `world=1` for one) through the trainer's
path (TrainConfig -> run bridge -> build_model -> build_engine) and returns both views per rank.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch

from shardwise import strict_json

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def planned_settings(run) -> dict[str, Any]:
    """The memory- and time-relevant settings the planner assumed for `run` (plan/memory.py and
    plan/timing.py read these)."""
    from shardwise.plan.timing import zero3_hooked_modules

    s, lay, t = run.engine_strategy, run.layout, run.train
    out: dict[str, Any] = {
        "engine": s.engine, "dp_shard": lay.dp_shard, "dp_replicate": lay.dp_replicate,
        "compute_dtype": t.compute_dtype, "activation_checkpointing": t.checkpointing != "none",
    }
    if s.engine == "deepspeed":
        k, stage = s.ds, s.zero_stage
        out |= {"zero_stage": stage, "reduce_bucket_size": k.reduce_bucket_size,
                "allgather_bucket_size": k.allgather_bucket_size, "overlap_comm": k.overlap(stage),
                "contiguous_gradients": k.contiguous_gradients,
                "reduce_dtype": {"auto": t.compute_dtype}.get(k.communication_data_type, k.communication_data_type)}
        if stage == 3:
            out |= {"prefetch_bucket_size": k.prefetch_bucket_size, "max_live_parameters": k.max_live_parameters,
                    "max_reuse_distance": k.max_reuse_distance,
                    "param_persistence_threshold": k.param_persistence_threshold,
                    "fetch_unit": k.zero3_unit(run.model.params_per_layer / s.tp),
                    "zero3_hooked_modules": zero3_hooked_modules(run.model, k, s.tp)}
    elif s.engine == "fsdp2":
        mixed = t.mixed_precision  # fp32 and bf16-pure: no policy, reduced in the parameters' dtype
        # the first decoder layer, the last and the root (Strategy.resharding: the root under "all")
        out |= {"reshard_after_forward": s.reshards_layer(last=run.model.num_layers == 1),
                "root_reshard_after_forward": s.reshards_root, "last_layer_reshard_after_forward": s.reshards_layer(last=True),
                "param_dtype": t.compute_dtype,
                "reduce_dtype": ("fp32" if s.fsdp.reduce_dtype == "fp32" else t.compute_dtype) if mixed else t.master_dtype,
                "cpu_offload": s.offload_params or s.offload_optimizer}
    else:
        out["ddp_wrapper"] = s.ddp.wrapped(lay.dp_replicate)
        if out["ddp_wrapper"]:
            out |= {"bucket_cap_bytes": int(s.ddp.bucket_cap_mb * 2**20),
                    "gradient_as_bucket_view": s.ddp.gradient_as_bucket_view}
    return out


def _fetch_unit(module) -> str:
    """What ZeRO-3 hooked: "layer" when the decoder layers carry its forward hooks and nothing
    inside them does, "module" when their submodules do too."""
    from shardwise.train.model.hf import decoder_layers

    layers = decoder_layers(module)
    inner = [m for layer in layers for m in layer.modules() if m is not layer and m._forward_pre_hooks]
    if all(layer._forward_pre_hooks for layer in layers) and not inner:
        return "layer"
    return "module" if inner else "none"


def engine_settings(engine) -> dict[str, Any]:
    """The same keys as `planned_settings`, read from the live engine."""
    module = engine.module
    from shardwise.train.model.hf import checkpointing_enabled

    out: dict[str, Any] = {"activation_checkpointing": checkpointing_enabled(module)}
    if engine.name == "deepspeed":
        ds = engine.ds
        stage = ds.zero_optimization_stage()
        comm = ds.communication_data_type
        out |= {"engine": "deepspeed", "zero_stage": stage, "dp_shard": 1 if stage == 0 else ds.dp_world_size,
                "dp_replicate": ds.dp_world_size if stage == 0 else 1,
                "compute_dtype": "bf16" if ds.bfloat16_enabled() else "fp16" if ds.fp16_enabled() else "fp32",
                "reduce_bucket_size": ds.zero_reduce_bucket_size(),
                "allgather_bucket_size": ds.zero_allgather_bucket_size(), "overlap_comm": ds.zero_overlap_comm(),
                "contiguous_gradients": ds.zero_contiguous_gradients(),
                "reduce_dtype": DTYPE_NAMES[comm]}
        if stage == 3:
            out |= {"prefetch_bucket_size": ds.zero_prefetch_bucket_size(),
                    "max_live_parameters": ds.zero_max_live_parameters(),
                    "max_reuse_distance": ds.zero_max_reuse_distance(),
                    "param_persistence_threshold": ds.zero_param_persistence_threshold(),
                    "fetch_unit": _fetch_unit(module),
                    "zero3_hooked_modules": sum(1 for m in module.modules() if m._forward_pre_hooks)}
    elif engine.name == "fsdp2":
        from shardwise.train.model.hf import decoder_layers

        layer = decoder_layers(module)[0]._get_fsdp_state()._fsdp_param_group
        last = decoder_layers(module)[-1]._get_fsdp_state()._fsdp_param_group
        root = module._get_fsdp_state()._fsdp_param_group
        mesh = layer.mesh_info.mesh
        shape = dict(zip(mesh.mesh_dim_names or ("dp_shard",), mesh.shape, strict=True))
        mp = layer.mp_policy
        param = layer.fsdp_params[0]
        out |= {"engine": "fsdp2", "dp_shard": shape.get("dp_shard", 1), "dp_replicate": shape.get("dp_replicate", 1),
                "compute_dtype": DTYPE_NAMES[mp.param_dtype or param.sharded_param.dtype],
                "reshard_after_forward": layer.post_forward_mesh_info is not None,
                "root_reshard_after_forward": root.post_forward_mesh_info is not None,
                "last_layer_reshard_after_forward": last.post_forward_mesh_info is not None,
                "param_dtype": DTYPE_NAMES[mp.param_dtype or param.sharded_param.dtype],
                "reduce_dtype": DTYPE_NAMES[mp.reduce_dtype or mp.param_dtype or param.sharded_param.dtype],
                "cpu_offload": type(layer.offload_policy).__name__ == "CPUOffloadPolicy"}
    else:
        from shardwise.train.engines._torch_common import autocast

        ddp = engine.ddp
        ctx = autocast(engine.run, engine.env)  # the context forward_backward runs under
        out |= {"engine": "ddp", "dp_shard": 1,
                "dp_replicate": ddp.process_group.size() if ddp is not None else engine.env.world_size,
                # no autocast: the module's own dtype (fp32, or bf16 under bf16-pure)
                "compute_dtype": DTYPE_NAMES[getattr(ctx, "fast_dtype", None) or next(module.parameters()).dtype],
                "ddp_wrapper": ddp is not None}
        if ddp is not None:
            out |= {"bucket_cap_bytes": ddp.bucket_bytes_cap, "gradient_as_bucket_view": ddp.gradient_as_bucket_view}
    return out


def settings_config(case: str, world: int | None = None):
    """`<strategy>[:bf16][:ckpt][:sg1][:module][:fully_shard][:stock]` -> the TrainConfig of a 2-rank
    settings check (module: ZeRO-3 hooks every submodule, DeepSpeed's default, instead of the
    planned decoder-layer unit; sg1: fsdp-hybrid with one-rank shard groups, which run as DDP unless
    fully_shard pins FSDP2's `single_rank: fsdp`; stock: FSDP2 as stock fully_shard runs, every
    decoder layer resharded after forward; wrap: DDP keeps its wrapper with one replica)."""
    from shardwise.bench.worker import BATCH, BENCH_MODEL, SEQ, WORLD
    from shardwise.config.schema import TrainConfig

    name, *flags = case.split(":")
    return TrainConfig.model_validate({
        "model": {"name": BENCH_MODEL},
        "data": {"kind": "synthetic", "synthetic": {"seq_len": SEQ}},
        "strategy": {"name": name, "shard_group": 1 if "sg1" in flags else None,
                     "deepspeed": {"fetch_unit": "module"} if "module" in flags else {},
                     "fsdp": ({"single_rank": "fsdp"} if "fully_shard" in flags else {})
                     | ({"reshard_after_forward": "all"} if "stock" in flags else {}),
                     "ddp": {"wrap_one_rank": True} if "wrap" in flags else {}},
        "precision": "bf16-mixed" if "bf16" in flags else "fp32",
        "checkpointing": {"activation": "full" if "ckpt" in flags else "none"},
        "run": {"micro_batch": BATCH, "device": "cpu", "nproc": world or WORLD},
        "logging": {"progress": False, "trackers": []},
    })


def _rank_main(rank: int, cases: list[str], out_dir: str, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    from shardwise import quiet
    from shardwise.train.engines import build_engine
    from shardwise.train.engines.base import DistEnv
    from shardwise.train.model.build import build_model
    from shardwise.train.preflight import preflight

    torch.set_num_threads(1)
    quiet.apply()  # the trainer's warning policy; `--verbose` / SHARDWISE_VERBOSE=1 shows every warning
    os.chdir(out_dir)  # preflight creates each case's (relative, default) output_dir: keep it out of the caller's cwd
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in cases:
            try:
                # the trainer's own start-up: preflight (the plan) then the engine on the same run
                run, _ = preflight(settings_config(case, world), world, "cpu")
                engine = build_engine(build_model(run), run, DistEnv(rank=rank, world_size=world, local_rank=rank))
                result = {"planned": planned_settings(run), "running": engine_settings(engine)}
                engine.close()
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {e}"}
            Path(out_dir, f"{case}.rank{rank}.json").write_text(strict_json.dumps(result))
            gc.collect()
            gc.freeze()  # what is left (imports, earlier cases) out of the next case's collections
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_settings(cases: list[str], timeout_s: float = 300.0, world: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """Each case's planned and running settings on `world` CPU ranks (default: the bench's 2)."""
    from shardwise.bench.worker import WORLD, spawn_ranks

    world = world or WORLD
    return spawn_ranks(_rank_main, cases, timeout_s, world=world, extra=(world,))
