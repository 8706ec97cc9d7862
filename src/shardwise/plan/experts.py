"""Expert parallelism (EP) of MoE models, planned (shardwise train runs none): what one rank of an
expert-parallel group holds, sends and computes. Pure functions; memory, comm and timing call them.

The layout planned is the engines' common one: the `ep` ranks of a group are borrowed from the
data-parallel ranks, and each holds num_experts / ep routed experts of every MoE layer, whole or
split over TP as the dense layers are (Megatron-Core's expert tensor parallelism defaults to tp).
Attention, router, shared experts, embeddings and norms stay data-parallel as before.
- Megatron-Core (NVIDIA/Megatron-LM@d98e8a6, megatron/core/parallel_state.py:870-890): the expert
  grid is ETP × EP × EDP × PP, expert_data_parallel_size = world / (ETP·EP·PP): expert gradients
  are reduced over the dp/ep expert-data-parallel ranks, the rest over dp (`--expert-model-parallel-size`).
- torchtitan (pytorch/torchtitan@b5bcd76, torchtitan/distributed/parallel_dims.py:188-191, 282):
  ep divides dp_shard·cp·tp; the routed experts are `Shard(0)` on the ep mesh and fully_shard over
  efsdp = dp_shard·cp·tp / ep (models/common/MOE_SHARDING.md). Its newer layout can also borrow TP
  ranks for EP (experts then not TP-split): not planned here, ep divides the data-parallel degree.
- DeepSpeed-MoE: `deepspeed.moe.layer.MoE(ep_size=...)` in the model's code (not ds_config.json);
  expert parameters form their own optimizer groups, reduced and ZeRO-partitioned over the
  expert-data-parallel group (dp / ep ranks).

Per MoE layer and micro-batch a rank sends its tokens' top-k copies to the experts' ranks
(dispatch) and receives the outputs back (combine): two all-to-alls in forward, two in backward
(the gradients of both), two more when full checkpointing replays the forward (torchtitan's
selective policy saves the all-to-all outputs: torchtitan/distributed/activation_checkpoint.py:63,
so no replay). Each moves tokens·k·h·c bytes of which (ep − 1)/ep leave the rank (Megatron's
`MoEAlltoAllTokenDispatcher`, torchtitan's token_dispatcher.py `all_to_all_single`). They sit on the
critical path: the next GEMM needs their output (Megatron's `--overlap-moe-expert-parallel-comm`
can hide them across micro-batches; not planned).

What backward keeps of the dispatch (plan.activations.moe_saved, unchanged): per routed copy the
received input of the expert GEMMs (c·h), their gate_up output, activation and product (4c·I'),
and the combined output back on the token's rank (c·h), with the routing weight and indices: the
same bytes as without EP when routing is balanced (a rank runs tokens·k copies either way, its
own without EP, the group's with it). The send buffers of the all-to-all are not saved (its
backward is the reverse all-to-all of the gradient).

Load imbalance (`Strategy.ep_load_imbalance`, default 1.0): the busiest rank receives that factor
times the balanced tokens·k; its expert GEMMs and its all-to-all bytes are scaled by it (the step
waits for it). For an engine that drops tokens past a capacity, the capacity factor bounds it
(Megatron `--moe-expert-capacity-factor`, DeepSpeed-MoE `capacity_factor`). Activation memory is
planned balanced.
"""

from __future__ import annotations

from shardwise.errors import ShardwiseError
from shardwise.plan.pipeline import PipelineRank
from shardwise.specs.hardware import HardwareSpec
from shardwise.specs.layout import ParallelLayout
from shardwise.specs.model import ModelSpec
from shardwise.specs.strategy import Strategy
from shardwise.specs.train import TrainSpec


def local_experts(model: ModelSpec, ep: int) -> int:
    """Routed experts of each MoE layer one rank holds: num_experts / ep."""
    if model.num_experts % ep:
        raise ShardwiseError(f"ep {ep} must divide the {model.num_experts} routed experts (num_experts) of {model.name}")
    return model.num_experts // ep


def rank_model(model: ModelSpec, ep: int) -> ModelSpec:
    """`model` as one expert-parallel rank holds its parameters: num_experts / ep routed experts per
    MoE layer (and a router of that many outputs: E·h per layer, ≤ 0.02% of the catalog MoE models'
    parameters, so counted at the local share). For parameter counts only (memory's model
    states, the data-parallel traffic): its active parameters and FLOPs are not read."""
    if ep == 1:
        return model
    e = local_experts(model, ep)
    return ModelSpec(**(model.model_dump() | {"num_experts": e, "experts_per_token": min(model.experts_per_token, e)}))


def moe_layers_of(model: ModelSpec, rank: PipelineRank) -> int:
    """MoE layers among a pipeline rank's decoder layers."""
    moe = model.moe_layers
    return sum(1 for i in rank.layers if moe[i])


def expert_params(model: ModelSpec, rank: PipelineRank, tp: int) -> float:
    """Routed-expert parameters of a pipeline rank's layers on one TP rank, all experts (3·E·I'·h
    per MoE layer: gate, up, down)."""
    return 3 * model.num_experts * model.expert_width * model.hidden_size * moe_layers_of(model, rank) / tp


def state_shards(n: int, psi_full: float, psi_held: float) -> float:
    """The shard count that gives the per-rank size of the sharded states from the held ψ: dense
    parameters are sharded over the n ranks of the shard group, a rank's num_experts/ep experts
    over the n/ep ranks left (efsdp, the expert-data-parallel group), so a rank's shard is
    dense/n + (experts/ep)/(n/ep) = (dense + experts)/n = ψ_full/n. Returned as n·ψ_held/ψ_full,
    so that ψ_held / it = ψ_full / n; n where nothing is sharded (n = 1)."""
    if n <= 1 or psi_full <= 0:
        return n
    return n * psi_held / psi_full


def dp_moved_share(model: ModelSpec, strategy: Strategy, layout: ParallelLayout, rank: PipelineRank,
                   psi_held: float) -> float:
    """The share of a rank's held parameters ψ_held whose data-parallel collectives move bytes:
    all of them, but where the expert-data-parallel group is one rank (dp = ep: every rank holds
    experts no other rank holds) the experts' gathers and reductions are over nobody. Where it is
    larger the experts' collectives run over dp/ep ranks, priced on the data-parallel group's link
    and ring (an upper bound: (g − 1)/g of a smaller group)."""
    ep = strategy.ep
    if ep <= 1 or layout.dp > ep or psi_held <= 0:
        return 1.0
    return max(0.0, 1.0 - expert_params(model, rank, layout.tp) / ep / psi_held)


def check_ep(model: ModelSpec, strategy: Strategy, layout: ParallelLayout) -> None:
    """What the planner refuses beside the layout's checks (ParallelLayout.check_model)."""
    ep = strategy.ep
    if ep > 1 and layout.tp > 1:
        raise ShardwiseError(
            f"ep {ep} with tp {layout.tp}: expert parallelism is planned without tensor parallelism (the token "
            "exchange between expert-TP and EP ranks is engine-specific: Megatron's ETP, torchtitan's EP over TP "
            "ranks); plan ep with tp 1")


def a2a_bytes(model: ModelSpec, train: TrainSpec, ep: int, load: float = 1.0) -> float:
    """Bytes one rank sends in one all-to-all (a dispatch or a combine) of one MoE layer and
    micro-batch: its tokens' k routed copies of h elements in the compute dtype, the (ep − 1)/ep
    of them bound for other ranks, × `load` on the busiest rank."""
    if ep <= 1:
        return 0.0
    c, h, k = train.compute_bytes, model.hidden_size, model.experts_per_token
    return train.tokens_per_micro_batch * k * h * c * (ep - 1) / ep * load


def a2a_per_layer(train: TrainSpec) -> int:
    """All-to-alls per MoE layer and micro-batch: dispatch and combine in forward, their gradients
    in backward, and the forward's two again under full checkpointing (the selective policy saves
    their outputs)."""
    return 4 + (2 if train.checkpointing == "full" else 0)


def a2a_step(model: ModelSpec, train: TrainSpec, strategy: Strategy, rank: PipelineRank) -> tuple[float, int]:
    """(bytes one GPU of pipeline rank `rank` sends in all-to-alls per optimizer step, their
    launches): a2a_bytes × a2a_per_layer × its MoE layers × grad_accum micro-batches."""
    ep = strategy.ep
    if ep <= 1:
        return 0.0, 0
    calls = a2a_per_layer(train) * moe_layers_of(model, rank) * train.grad_accum
    return a2a_bytes(model, train, ep, strategy.ep_load_imbalance) * calls, calls


def ep_ranks_per_node(ep: int, tp: int, gpus_per_node: int) -> int:
    """EP ranks inside one node: the group's ranks are adjacent after TP's (Megatron's tp-cp-ep-dp
    order, torchtitan's [..., efsdp, ep] sparse mesh), so a node holds gpus_per_node / tp of them."""
    return max(1, min(ep, gpus_per_node // max(tp, 1)))


def a2a_time(volume: float, ep: int, hw: HardwareSpec, tp: int = 1) -> float:
    """Seconds the all-to-alls that send `volume` bytes from one GPU take on the wire. Of what a
    rank sends, (p − 1)/(ep − 1) goes to the p − 1 peers in its node over the intra link and the
    rest through its share of the node's NICs (network.nic_bytes_per_s_per_gpu: NIC bandwidth ×
    NICs / GPUs per node), both at once: the slower bounds it. Their launches' latency is the
    critical path's (CommBreakdown.blocking_calls, timing.step_time)."""
    if ep <= 1 or volume <= 0:
        return 0.0
    p = ep_ranks_per_node(ep, tp, hw.gpus_per_node)
    intra = volume * (p - 1) / (ep - 1) / hw.intra.bus_bytes_per_s
    inter = 0.0
    if p < ep:
        nic = hw.inter_node_bytes_per_s / hw.gpus_per_node  # network.nic_bytes_per_s_per_gpu (network imports comm, which imports this)
        inter = volume * (ep - p) / (ep - 1) / nic
    return max(intra, inter)


def a2a_link(ep: int, tp: int, hw: HardwareSpec) -> str:
    """"intra" when the EP group fits in a node, else "inter"."""
    return "intra" if ep_ranks_per_node(ep, tp, hw.gpus_per_node) >= ep else "inter"


def expert_gemms(model: ModelSpec, tp: int, ep: int = 1) -> list[tuple[float, float, float]]:
    """(k, n, share of a rank's tokens) of one MoE layer's routed-expert linears on one rank, at
    the width kernels.layer_gemms prices them: E/ep local experts, each of which gets k·ep/E of
    the tokens a rank routes (the group's tokens·k spread over E experts, E/ep of them here): the
    same work as E experts with k/E each, in fewer, taller GEMMs (weights read once per expert)."""
    e, k = model.num_experts, model.experts_per_token
    h, i = model.hidden_size, model.intermediate_size / tp
    share = k * ep / e
    return [(h, i, share), (h, i, share), (i, h, share)] * (e // ep)
