"""Expert parallelism (EP) of MoE models, planned (shardwise train runs none): what one rank of an
expert-parallel group holds, sends and computes. Pure functions; memory, comm and timing call them.

The layout planned is the engines' common one: each of the `ep` ranks of a group holds
num_experts / ep routed experts of every MoE layer, split over `etp` TP ranks (Strategy.expert_tp,
1 or tp). At etp = tp the experts are split as the dense layers are and the EP ranks are borrowed
from the data-parallel ones (ep divides dp); at etp = 1 each expert is whole on its rank and EP may
borrow the TP ranks too (ep·etp divides dp·tp). Attention, router, shared experts, embeddings and
norms stay as before (data-parallel, TP-split).
- Megatron-Core (NVIDIA/Megatron-LM@d98e8a6, megatron/core/parallel_state.py:870-890): the expert
  grid is ETP × EP × EDP × PP, expert_data_parallel_size = world / (ETP·EP·PP): expert gradients
  are reduced over the dp·tp/(ep·etp) expert-data-parallel ranks, the rest over dp
  (`--expert-model-parallel-size`, `--expert-tensor-parallel-size`, default tp: training/arguments.py:587).
- torchtitan (pytorch/torchtitan@b5bcd76, torchtitan/distributed/parallel_dims.py:188-191, 282):
  ep divides dp_shard·cp·tp; the routed experts are `Shard(0)` on the ep mesh (whole: etp 1) and
  fully_shard over efsdp = dp_shard·cp·tp / ep (models/common/MOE_SHARDING.md).
- DeepSpeed-MoE: `deepspeed.moe.layer.MoE(ep_size=...)` in the model's code (not ds_config.json);
  expert parameters form their own optimizer groups, reduced and ZeRO-partitioned over the
  expert-data-parallel group (dp / ep ranks).

Per MoE layer and micro-batch a rank sends its tokens' top-k copies to the experts' ranks
(dispatch) and receives the outputs back (combine): two all-to-alls in forward, two in backward
(the gradients of both), two more when full checkpointing replays the forward (torchtitan's
selective policy saves the all-to-all outputs: torchtitan/distributed/activation_checkpoint.py:63,
so no replay). Each moves tokens·k·h·c bytes of which (ep − 1)/ep leave the rank (Megatron's
`MoEAlltoAllTokenDispatcher`, torchtitan's token_dispatcher.py `all_to_all_single`). They sit on the
critical path: the next GEMM needs their output, unless Megatron's
`--overlap-moe-expert-parallel-comm` (Strategy.ep_overlap) hides them behind another micro-batch's
compute (`a2a_hidden`).

Beside TP both engines keep the MoE layer's tokens sequence-parallel: each TP rank routes and
sends its tokens/tp (Megatron-Core refuses MoE with TP without `--sequence-parallel`:
moe/moe_layer.py:636; torchtitan's EP with SP keeps the input `Shard(1)`). At etp = tp
Megatron's dispatcher then all-gathers the received copies over the expert-TP group and
reduce-scatters the experts' output back (token_dispatcher.py:741-746 `dispatch_postprocess`,
`combine_preprocess`): k × the dense MLP's sequence-parallel pair, in its place
(`moe_tp_pairs`). Megatron's default `allgather` dispatcher moves the dense pair instead; the
alltoall dispatcher is the one its EP recipes run, and is what is planned under ep > 1.

What backward keeps of the dispatch (plan.activations.moe_saved; at etp 1 beside TP, the copies
of the rank's own tokens/tp): per routed copy the received input of the expert GEMMs (c·h), their
gate_up output, activation and product (4c·I'), and the combined output back on the token's rank
(c·h), with the routing weight and indices (transformers' grouped_mm experts, also for Megatron's
TEGroupedMLP, which keeps less: not planned apart), the
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


def rank_model(model: ModelSpec, strategy: Strategy) -> ModelSpec:
    """`model` as one expert-parallel rank holds its parameters: num_experts / ep routed experts per
    MoE layer, split over etp of the tp ranks, counted as (num_experts / ep)·(tp / etp) experts that
    the parameter counts split over tp as they split the dense layers (the same bytes per rank);
    the router of that many outputs (E·h per layer, ≤ 0.02% of the catalog MoE models'
    parameters) is counted at that share. For parameter counts only (memory's model states, the
    data-parallel traffic): its active parameters, FLOPs and routing (DeepSeek-V3's expert groups,
    one here: its 8 groups need 8 experts) are not read."""
    ep = strategy.ep
    if ep == 1:
        return model
    e = local_experts(model, ep) * (strategy.tp // strategy.expert_tp)
    local = {"num_experts": e, "experts_per_token": min(model.experts_per_token, e)}
    if model.n_group > 1:
        local |= {"n_group": 1, "topk_group": 1}
    return ModelSpec(**(model.model_dump() | local))


def moe_layers_of(model: ModelSpec, rank: PipelineRank) -> int:
    """MoE layers among a pipeline rank's decoder layers."""
    moe = model.moe_layers
    return sum(1 for i in rank.layers if moe[i])


def expert_params(model: ModelSpec, rank: PipelineRank, etp: int) -> float:
    """Routed-expert parameters of a pipeline rank's layers on one rank of the expert-TP group,
    all experts (3·E·I'·h per MoE layer: gate, up, down, over etp)."""
    return 3 * model.num_experts * model.expert_width * model.hidden_size * moe_layers_of(model, rank) / etp


def state_shards(n: int, psi_full: float, psi_held: float) -> float:
    """The shard count that gives the per-rank size of the sharded states from the held ψ (both
    per TP rank): dense parameters are sharded over the n ranks of the shard group, a rank's
    num_experts/ep experts over etp ranks over the n·tp/(ep·etp) ranks left (efsdp, the
    expert-data-parallel group), so a rank's shard is dense/n + (experts/(ep·etp))/(n·tp/(ep·etp))
    = (dense + experts/tp)/n = ψ_full/n. Returned as n·ψ_held/ψ_full, so that ψ_held / it =
    ψ_full / n; n where nothing is sharded (n = 1)."""
    if n <= 1 or psi_full <= 0:
        return n
    return n * psi_held / psi_full


def dp_moved_share(model: ModelSpec, strategy: Strategy, layout: ParallelLayout, rank: PipelineRank,
                   psi_held: float) -> float:
    """The share of a rank's held parameters ψ_held whose data-parallel collectives move bytes:
    all of them, but where the expert-data-parallel group is one rank (dp·tp = ep·etp: every rank
    holds experts no other rank holds) the experts' gathers and reductions are over nobody. Where
    it is larger the experts' collectives run over dp·tp/(ep·etp) ranks, priced on the
    data-parallel group's link and ring (an upper bound: (g − 1)/g of a smaller group)."""
    ep = strategy.ep
    if ep <= 1 or layout.expert_dp > 1 or psi_held <= 0:
        return 1.0
    return max(0.0, 1.0 - expert_params(model, rank, layout.expert_tp) / ep / psi_held)


def a2a_bytes(model: ModelSpec, train: TrainSpec, ep: int, load: float = 1.0, tp: int = 1) -> float:
    """Bytes one rank sends in one all-to-all (a dispatch or a combine) of one MoE layer and
    micro-batch: its tokens' k routed copies of h elements in the compute dtype, the (ep − 1)/ep
    of them bound for other ranks, × `load` on the busiest rank. Beside TP a rank routes its
    tokens/tp (sequence parallelism)."""
    if ep <= 1:
        return 0.0
    c, h, k = train.compute_bytes, model.hidden_size, model.experts_per_token
    return train.tokens_per_micro_batch / tp * k * h * c * (ep - 1) / ep * load


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
    return a2a_bytes(model, train, ep, strategy.ep_load_imbalance, strategy.tp) * calls, calls


def moe_tp_pairs(model: ModelSpec, strategy: Strategy) -> tuple[float, int]:
    """(volume, collectives): the sequence-parallel all-gather + reduce-scatter pairs that a MoE
    layer's MLP runs per pass beside TP, where a dense MLP runs one, in pairs of the tokens'
    hidden states (b·s·h, the unit of plan.comm's TP traffic), and how many pairs are launched. Without EP: one (the experts split as a dense MLP, or Megatron's default
    allgather dispatcher). Under EP with Megatron's alltoall dispatcher: the shared experts' own
    pair (moe/shared_experts.py:574-583) and, at etp = tp, the k routed copies gathered over the
    expert-TP group and scattered back (k pairs); at etp = 1 none for the routed experts.
    torchtitan's DTensor MoE keeps one pair at the layer's boundary (MOE_SHARDING.md: input
    `Shard(1)`, output `Partial` → `Shard(1)`, the shared experts under the dense TP plan)."""
    if strategy.ep == 1 or strategy.tp == 1:
        return 1.0, 1
    routed = strategy.expert_tp == strategy.tp  # else the experts are whole: nothing to gather
    boundary = strategy.tp_scheme.name == "dtensor" or model.shared_expert_intermediate_size > 0
    return boundary + routed * model.experts_per_token, boundary + routed


def a2a_hidden(a2a_s: float, window_s: float, micro_batches: int) -> float:
    """Seconds of the all-to-alls (`a2a_s` a step) hidden under Megatron's
    `--overlap-moe-expert-parallel-comm` (Strategy.ep_overlap): its schedule runs one
    micro-batch's forward beside another's backward, each one's all-to-alls behind the other's
    compute (megatron/core/pipeline_parallel/combined_1f1b.py), as well as compute hides any
    collective (`window_s`: overlap_efficiency × the step's compute, less what else hides there).
    The first forward and the last backward have no partner: (m − 1)/m of them, m micro-batches."""
    if micro_batches <= 1 or a2a_s <= 0:
        return 0.0
    return min(a2a_s, max(0.0, window_s)) * (micro_batches - 1) / micro_batches


def ep_ranks_per_node(ep: int, etp: int, gpus_per_node: int) -> int:
    """EP ranks inside one node: the group's ranks are adjacent after the expert-TP ranks'
    (Megatron's expert grid tp-ep-dp with tp = etp, torchtitan's [..., efsdp, ep] sparse mesh),
    so a node holds gpus_per_node / etp of them."""
    return max(1, min(ep, gpus_per_node // max(etp, 1)))


def a2a_time(volume: float, ep: int, hw: HardwareSpec, etp: int = 1) -> float:
    """Seconds the all-to-alls that send `volume` bytes from one GPU take on the wire. Of what a
    rank sends, (p − 1)/(ep − 1) goes to the p − 1 peers in its node over the intra link and the
    rest through its share of the node's NICs (network.nic_bytes_per_s_per_gpu: NIC bandwidth ×
    NICs / GPUs per node), both at once: the slower bounds it. Their launches' latency is the
    critical path's (CommBreakdown.blocking_calls, timing.step_time)."""
    if ep <= 1 or volume <= 0:
        return 0.0
    p = ep_ranks_per_node(ep, etp, hw.gpus_per_node)
    intra = volume * (p - 1) / (ep - 1) / hw.intra.bus_bytes_per_s
    inter = 0.0
    if p < ep:
        nic = hw.inter_node_bytes_per_s / hw.gpus_per_node  # network.nic_bytes_per_s_per_gpu (network imports comm, which imports this)
        inter = volume * (ep - p) / (ep - 1) / nic
    return max(intra, inter)


def a2a_link(ep: int, etp: int, hw: HardwareSpec) -> str:
    """"intra" when the EP group fits in a node, else "inter"."""
    return "intra" if ep_ranks_per_node(ep, etp, hw.gpus_per_node) >= ep else "inter"


def expert_gemms(model: ModelSpec, tp: int, ep: int = 1, etp: int | None = None) -> list[tuple[float, float, float]]:
    """(k, n, share of a rank's tokens) of one MoE layer's routed-expert linears on one rank, at
    the width kernels.layer_gemms prices them: E/ep local experts of width I'/etp (etp default
    tp), each of which gets k·ep·etp/(tp·E) of the tokens a TP rank's layer sees (the group's
    tokens·k spread over E experts, E/ep of them here, tokens/tp a rank routes gathered over
    etp): the same work as E experts with k/E each, in fewer, taller GEMMs (weights read once
    per expert), whatever etp."""
    e, k = model.num_experts, model.experts_per_token
    etp = tp if etp is None else etp
    h, i = model.hidden_size, model.intermediate_size / etp
    share = k * ep * etp / (tp * e)
    return [(h, i, share), (h, i, share), (i, h, share)] * (e // ep)
