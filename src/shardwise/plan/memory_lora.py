"""Model states of a LoRA/QLoRA run per engine (pure, no torch): the frozen base stored as the
engine stores parameters, the trainable adapters (and `modules_to_save` copies) with the engine's
full treatment. Checked per part against a census of the real engines on 2 gloo ranks
(tests/accuracy/test_measured_memory.py, the `-lora` and `-qlora` variants)."""

from __future__ import annotations

from dataclasses import replace

from shardwise.plan.breakdown import HostBreakdown, MemoryBreakdown
from shardwise.plan.fp8 import linear_share
from shardwise.plan.lora import (
    adapter_params_per_layer,
    adapter_tensors,
    linear_weight_params,
    trainable_params,
)
from shardwise.plan.optimizer import optimizer_bytes, optimizer_temp
from shardwise.plan.pipeline import PipelineRank
from shardwise.plan.stage import (
    Replica,
    fsdp_gathered_at_loss,
    fsdp_gathered_linears,
    fsdp_gathered_params,
    fsdp_units,
    persistent_params,
    whole_model,
    zero3_gathered,
)
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec


def lora_states(r: Replica) -> tuple[MemoryBreakdown, HostBreakdown]:
    """LoRA/QLoRA (plan/lora.py counts the adapters A; `modules_to_save` adds trainable copies):
    the frozen base B is stored as the engine stores parameters and never gets grads or optimizer
    state; the trainable A get the engine's full treatment. Measured per rank on 2 gloo ranks
    (tests/accuracy/test_measured_memory.py, `-lora` variants; trainer: shardwise.train.model.lora):
    - DDP: base in the compute dtype c, adapters fp32 (c·B + 4A), fp32 grads and AdamW of A;
    - DeepSpeed casts the whole module to c (adapters too: c·(B + A)), fp32 master of A/N,
      grads of A in c (stage 0 whole, 1 whole under accumulation, 2-3 A/N); stage 3 partitions
      base and adapters alike (persistent small tensors whole) with its reduce bucket, and
      offload_param moves every partition to the host, the frozen base's too;
    - FSDP2 shards both, each in its stored dtype: (c·B + 4A)/N, grads 4A/N, AdamW A/N.
    Under pure bf16 the torch engines keep the adapters, their grads and AdamW in bf16 too (the
    master dtype w). QLoRA's base linears are NF4 (`base_bytes`)."""
    model, train, s, layout, psi, n, per_node = r.model, r.train, r.strategy, r.layout, r.psi, r.n, r.per_node
    c = train.compute_bytes
    a = trainable_params(model, train, layout.tp, rank=r.rank)
    base = base_bytes(model, train, layout, psi, r.rank)  # frozen base, whole, as stored
    os_ = optimizer_bytes(train)
    temp = optimizer_temp(train, a, a)
    layer = model.params_per_layer / layout.tp
    host = HostBreakdown()
    w = train.master_bytes  # the adapters' dtype in the torch engines
    if s.engine == "deepspeed":
        stage, ds = s.zero_stage, s.ds
        w = c
        base_w = base * w / c  # DeepSpeed keeps the module in the compute dtype
        if stage == 3:
            # small tensors stay whole on every rank, base and adapters alike (QLoRA never runs here)
            frozen_persist = persistent_params(model, ds.param_persistence_threshold, layout.tp)
            persist = frozen_persist + sum(e * k * len(r.rank.layers) for e, k in adapter_tensors(model, train, layout.tp)
                                           if e < ds.param_persistence_threshold)
            whole = w * persist
            mem = MemoryBreakdown(
                params=whole + (base_w + w * a) / n, grads=w * a / n, master_params=4 * a / n,
                optimizer_states=os_ * a / n, step_buffers=4 * a / n + temp / n,
                engine_buffers=ds.reduce_bucket_size * w, gathered_params=w * zero3_gathered(model, train, ds, layout, r.rank),
                grads_persist=True)
        else:
            whole_grads = stage == 0 or (stage == 1 and train.grad_accum > 1)
            master = (4 * a if w != 4 else 0.0) if stage == 0 else 4 * a / n
            mem = MemoryBreakdown(
                params=base_w + w * a, grads=w * a if whole_grads else w * a / n, master_params=master,
                optimizer_states=os_ * a / max(1, n if stage else 1), step_buffers=master + temp / max(1, n if stage else 1),
                grads_persist=train.grad_accum > 1)
        if s.offload_optimizer:  # per node, as plan/memory.py books the host (every rank's share)
            host = HostBreakdown(grads=4 * a / n * per_node, master_params=4 * a / n * per_node,
                                 optimizer_states=os_ * a / n * per_node)
            mem = replace(mem, master_params=0.0, optimizer_states=0.0, step_buffers=0.0)
        if stage == 3 and s.offload_params:
            # offload_param puts every partition on the host, frozen or not: zero.Init (which the
            # engine runs on a module built outside it, parameter_offload.py
            # `_convert_to_zero_parameters`, remote_device = offload_param.device) allocates each
            # `ds_tensor` on remote_device unless `ds_persist`; requires_grad only decides
            # quantisation (partition_parameters.py `_partition_param`). The trainable partitions
            # then move into a flat CPU buffer (stage3.py `_create_param_groups_fp16_flat_cpu_memory`,
            # `_move_to_flat_buffer`). deepspeedai/DeepSpeed@edaa7221267243c7be7fb49c5d5f5c4fb97b4641.
            # On the GPU stay the persistent tensors, whole, and the frozen ones' partitions.
            mem = replace(mem, params=whole + w * frozen_persist / n)
            host = replace(host, params=(base_w + w * a - w * frozen_persist) / n * per_node)
        return mem, host
    if s.engine == "fsdp2":
        reduce = s.fsdp.reduce_bytes(c) if train.mixed_precision else w
        units = fsdp_units(model, s, layout, r.rank, psi, r.layers, layer)
        gathered = fsdp_gathered_params(s, c, psi, units)
        at_loss = fsdp_gathered_at_loss(s, train, c, psi, units)
        if train.base_quant == "nf4":  # the layers' NF4 linears are gathered as stored (nf4_gathered_saving)
            held_lin, held_lin_at_loss = fsdp_gathered_linears(s, *linear_share(model, r.rank, layout.tp))
            gathered -= nf4_gathered_saving(c) * held_lin
            at_loss -= nf4_gathered_saving(c) * held_lin_at_loss
        mem = MemoryBreakdown(
            params=(base + w * a) / n, grads=w * a / n, optimizer_states=os_ * a / n, step_buffers=temp / n,
            gathered_params=gathered, grad_buffers=(c + reduce) * adapter_params_per_layer(model, train) / layout.tp,
            held_grads=reduce * a if train.grad_accum > 1 and s.fsdp.reduce_every_micro_batch is False else 0.0,
            grads_persist=train.grad_accum > 1 and s.fsdp.reduce_every_micro_batch is not False,
            gathered_free_at_loss=max(0.0, gathered - at_loss))
        if s.offload_params:  # per node, as plan/memory.py books the host (every rank's share)
            host = HostBreakdown(params=mem.params * per_node, grads=mem.grads * per_node,
                                 optimizer_states=mem.optimizer_states * per_node)
            mem = replace(mem, params=0.0, grads=0.0, optimizer_states=0.0, step_buffers=0.0)
        return mem, host
    wrapped = s.ddp.wrapped(layout.dp_replicate)  # one replica: no DDP wrapper, no buckets
    view = wrapped and s.ddp.gradient_as_bucket_view  # DDP: buckets hold the adapters' grads only
    return MemoryBreakdown(
        params=base + w * a, grads=w * a, optimizer_states=os_ * a, step_buffers=temp,
        engine_buffers=w * a if wrapped and not view else 0, grads_persist=view or train.grad_accum > 1,
    ), host


def base_bytes(model: ModelSpec, train: TrainSpec, layout: ParallelLayout, psi: float,
               rank: PipelineRank | None = None) -> float:
    """The frozen base of a LoRA run as one rank's replica (of pipeline rank `rank`, default the
    whole model at pp 1) stores it: Ψ in the compute dtype,
    or for QLoRA (`base_quant` nf4) the decoder layers' linear weights in bitsandbytes NF4 —
    4 bits plus a double-quantised scale per 64-element block (8-bit absmax, and one fp32
    scale per 256 blocks: 0.5 + 1/64 + 4/(64·256) bytes per weight; Dettmers et al. 2023) —
    and everything else (embeddings, norms, lm_head, biases) in the compute dtype."""
    c = train.compute_bytes
    if train.base_quant == "none":
        return c * psi
    quantized = linear_weight_params(model, layout.tp, rank=whole_model(model, layout, rank))
    return c * (psi - quantized) + NF4_BYTES * quantized


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def nf4_gathered_saving(c: int) -> float:
    """Bytes fewer per NF4 base weight that a sharded QLoRA all-gathers and holds unsharded: the
    4-bit data and its scales travel as stored, not dequantised to the compute dtype (torchao's
    NF4Tensor, which torchtune shards with FSDP2, gathers its quantized_data, scalers and
    quantization factors in `fsdp_pre_all_gather`, pytorch/ao torchao/dtypes/nf4tensor.py; FSDP-QLoRA
    flattens bitsandbytes' packed uint8 storage, `bnb_4bit_quant_storage`, into the FSDP flat
    parameter), and each layer dequantises one weight at a time in its forward."""
    return c - NF4_BYTES
