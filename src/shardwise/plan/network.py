"""Collective time per link level, after NCCL's own tuning model (src/graph/tuning.cc,
https://github.com/NVIDIA/nccl/blob/5067397c2676d5aed50042fc39e5c8ee96eb0027/src/graph/tuning.cc).

A collective of n ranks on N nodes (g = n/N per node), Simple protocol (large messages):

- bandwidth: nccl-tests' bus bandwidth B of the slowest level it crosses, t = V·(n−1)/n / B for a
  ring (V: the ring volume, an all-reduce counted twice); a tree all-reduce moves V at 0.92·B
  (tuning.cc: tree busBw × .92, algBw = busBw / 2). Inside a node B is the intra link's per-GPU
  figure; across nodes see `inter_bus` (below), capped by the intra link.
- latency per call: NCCL's base latency, then per ring step the hardware latency of the step's
  link: a ring all-gather/reduce-scatter has n−1 steps of which N−1 cross nodes (all-reduce
  twice both), an intra step in a multi-node ring waiting at least the network overhead; a tree
  all-reduce 2·((g−1)·intra + log2 N·inter). NCCL picks, per call, whichever is faster (it does so
  for all-reduce; all-gather and reduce-scatter are rings). Latency grows with the ranks and the
  nodes; nothing here is fitted.

Not modelled: NVLS/SHARP/CollNet, PAT (one GPU per node), LL/LL128 for small messages, tree
correction factors by size, the ring's all-reduce "plateau" factor.

Across nodes, each GPU gets its share of the node's NICs (NIC bandwidth × NICs / GPUs per node),
and a group's ring carries through it only the 1/g of its traffic that leaves the node there, as
a hierarchical ring does: bus bandwidth g × the per-GPU share. A group of all a node's GPUs gets
the node's aggregate (NCCL's model of a multi-node ring: busBw = nChannels × bwInter); groups that
share a node (the DP groups under TP, HSDP's replica groups) share it. One NIC per GPU for every
group instead is refuted by the published runs: it plans 26 of the 44 FSDP runs on 16-512 H100s
22-82% slow (benchmarks/accuracy.py), and llm-foundry's MPT-13B on 64 H100s moved ~102 GB of
planned FSDP traffic per GPU in a 0.85 s step, ≥ 119 GB/s per GPU, over five times one NIC.
The GPT-3 175B ZeRO-3 rows of the Megatron-LM paper (Table 2: 67-82 s a step on 384-1,536 A100s)
stay planned fast here; the likely cause is the engine of the time, not the network (DeepSpeed
0.3.x's ZeRO-3 gathered and reduce-scattered parameter by parameter through list collectives, a
torch.cuda.synchronize() per prefetched parameter: v0.3.15 deepspeed/runtime/zero/
partition_parameters.py; plan/comm.py counts one gather per layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.plan.comm import CommBreakdown
from shardwise.specs.hardware import HardwareSpec
from shardwise.specs.layout import ParallelLayout

# tuning.cc, Simple protocol: baseLatencies[Ring] = baseLatencies[Tree] = 8.4 us per call
BASE_LATENCY_S = 8.4e-6
# tuning.cc getNetOverhead(): 1 us on x86 Intel (2 on AMD), × 3 for Simple: an intra-node step of a
# ring that spans nodes takes at least this
NET_OVERHEAD_S = 3e-6
TREE_BW_FACTOR = 0.92  # tuning.cc: tree all-reduce busBw × .92


@dataclass(frozen=True, slots=True)
class Group:
    """The ranks of one collective and the links between them."""

    ranks: int
    nodes: int  # nodes the ranks span (1: inside a node)
    bus_bytes_per_s: float  # per GPU, of the slowest level crossed
    intra_latency_s: float  # per ring step inside a node
    inter_latency_s: float = 0.0  # per ring step between nodes

    @property
    def per_node(self) -> int:
        return max(1, self.ranks // max(self.nodes, 1))


def ring_latency(g: Group, allreduce: bool = False) -> float:
    """One ring collective's latency: base + (steps − inter steps)·intra + inter steps·inter,
    steps = n − 1 (all-reduce 2(n − 1)), inter steps = N − 1 (all-reduce 2(N − 1))."""
    if g.ranks <= 1:
        return 0.0
    k = 2 if allreduce else 1
    steps, inter = k * (g.ranks - 1), k * (max(g.nodes, 1) - 1)
    intra = g.intra_latency_s if g.nodes <= 1 else max(g.intra_latency_s, NET_OVERHEAD_S)
    return BASE_LATENCY_S + (steps - inter) * intra + inter * g.inter_latency_s


def tree_latency(g: Group) -> float:
    """A tree all-reduce's latency: base + 2·((g − 1)·intra + log2(N)·inter) (chains inside the
    nodes, a double binary tree between them)."""
    if g.ranks <= 1:
        return 0.0
    depth = math.floor(math.log2(g.nodes)) if g.nodes > 1 else 0  # tuning.cc log2i
    return BASE_LATENCY_S + 2 * ((g.per_node - 1) * g.intra_latency_s + depth * g.inter_latency_s)


def ring_collective_time(volume: float, g: Group, allreduce: bool = False) -> float:
    """One ring all-gather / reduce-scatter (or all-reduce) of ring volume `volume`."""
    if g.ranks <= 1 or volume <= 0:
        return 0.0
    return volume * (g.ranks - 1) / g.ranks / g.bus_bytes_per_s + ring_latency(g, allreduce)


def allreduce_time(volume: float, g: Group) -> float:
    """One all-reduce of ring volume `volume` (twice its size), by ring or tree, whichever NCCL's
    model finds faster."""
    if g.ranks <= 1 or volume <= 0:
        return 0.0
    tree = volume / (TREE_BW_FACTOR * g.bus_bytes_per_s) + tree_latency(g)
    return min(ring_collective_time(volume, g, allreduce=True), tree)


def group_time(volume: float, g: Group, calls: int, allreduce_volume: float = 0.0) -> float:
    """`calls` collectives moving `volume` in all (ring volume), `allreduce_volume` of it in
    all-reduces, the rest in all-gathers / reduce-scatters; the calls share the volume evenly and
    split by kind in proportion to it."""
    if g.ranks <= 1 or volume <= 0:
        return 0.0
    calls = max(calls, 1)
    ar = min(max(allreduce_volume, 0.0), volume)
    ar_calls = calls * ar / volume
    other_calls = calls - ar_calls
    t = 0.0
    if ar_calls:
        t += ar_calls * allreduce_time(ar / ar_calls, g)
    if other_calls:
        t += other_calls * ring_collective_time((volume - ar) / other_calls, g)
    return t


def nic_bytes_per_s_per_gpu(hw: HardwareSpec) -> float:
    """A GPU's share of its node's NICs: NIC bandwidth × NICs per node / GPUs per node (the NIC's
    own on InfiniBand/RoCE rails, one per GPU; 1/G of one on Ethernet, one per node)."""
    return hw.inter_node_bytes_per_s / hw.gpus_per_node


def inter_bus(hw: HardwareSpec, per_node: int) -> float:
    """The bus bandwidth of a ring whose ranks span nodes, `per_node` of them in each node. It
    runs as a hierarchical ring would: each rank's NIC carries the 1/per_node of the traffic
    that leaves the node through it, at that GPU's share of the NICs, so the ring's bus bandwidth
    is per_node × the per-GPU share (a node's whole NIC bandwidth when every GPU of the node is
    in the group; one GPU's share when the node's GPUs are in G different groups, e.g. the DP
    groups under TP = G, all at once), never above the link inside the node."""
    return min(hw.intra.bus_bytes_per_s, nic_bytes_per_s_per_gpu(hw) * max(1, per_node))


def ring_time(volume: float, n: int, bus_bytes_per_s: float, latency_s: float, calls: int) -> float:
    """`calls` ring all-gathers/reduce-scatters over n ranks of one link level moving `volume` in
    all: S·(n−1)/n / B + calls·(base + (n−1)·latency)."""
    if n <= 1 or volume <= 0:
        return 0.0
    g = Group(ranks=n, nodes=1, bus_bytes_per_s=bus_bytes_per_s, intra_latency_s=latency_s)
    return group_time(volume, g, calls)


def comm_time(comm: CommBreakdown, hw: HardwareSpec, layout: ParallelLayout) -> float:
    """Data-parallel collectives of one step, by the levels they cross. A group inside a node
    runs at the intra link; a group that spans nodes runs at the slower of the intra link and
    the GPU's share of the NICs, with latency by NCCL's step counts. HSDP's cross-node all-reduce
    runs one group per local rank (one rank per node). TP all-reduces and PP sends are priced
    apart (timing.step_time: on the critical path)."""
    dp = layout.dp
    per_node_dp = max(1, min(dp, hw.gpus_per_node // layout.tp))
    tp_allreduce = (comm.blocking - comm.p2p - comm.all_to_all) / 2  # EP's all-to-alls: plan/experts.py
    ar = 2 * max(0.0, comm.all_reduce - tp_allreduce)  # DP all-reduce, ring volume
    ar_inter = min(comm.inter, ar)
    t = 0.0
    if comm.intra:
        g = Group(per_node_dp, 1, hw.intra.bus_bytes_per_s, hw.intra.latency_s)
        t += group_time(comm.intra, g, comm.calls, ar - ar_inter)
    if comm.inter:
        nodes = max(2, -(-dp // per_node_dp))
        if layout.dp_replicate > 1 and layout.dp_shard > 1:  # HSDP: one rank per node per group
            g = Group(nodes, nodes, inter_bus(hw, 1), hw.intra.latency_s, hw.inter.latency_s)
        else:
            g = Group(dp, nodes, inter_bus(hw, per_node_dp), hw.intra.latency_s, hw.inter.latency_s)
        t += group_time(comm.inter, g, comm.calls, ar_inter)
    return t
