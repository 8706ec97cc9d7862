"""Links by GPU and collectives at scale: every catalog GPU names the link it has inside a node,
`--interconnect nvlink` means the GPU's own generation (refused where it has none), the plan
prints which link it assumed; plan/network.py's collective times against hand arithmetic; the
GPT-3 175B ZeRO-3 runs' exposed communication grows with the node count; `--nics-per-node` is
at most the GPUs per node."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_scripts import load
from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app
from shardwise.errors import ShardwiseError
from shardwise.plan import network
from shardwise.plan.comm import CommBreakdown
from shardwise.plan.evaluate import evaluate
from shardwise.specs.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

# What each GPU has between the GPUs of one node, from the vendors' product descriptions:
# NVLink 2/3/4/5 on V100/A100/H100-H200-H20/B200-GB200, PCIe on the PCIe and consumer cards, xGMI on
# MI300X/MI325X (and MI250X's GCD links).
OWN_LINK = {
    "a100-40g": "nvlink3", "a100-80g": "nvlink3", "a800-80g": "nvlink3-400", "h100-sxm": "nvlink4", "h200": "nvlink4",
    "v100-32g": "nvlink2", "h100-pcie": "pcie5", "l40s": "pcie4", "rtx-4090": "pcie4", "rtx-3090": "pcie4",
    "mi300x": "xgmi", "b200": "nvlink5", "gb200": "nvlink5", "h20": "nvlink4", "rtx-4080": "pcie4",
    "rtx-4070-ti": "pcie4", "rtx-5090": "pcie5", "l4": "pcie4", "a10g": "pcie4", "mi250x": "xgmi-mi250x",
    "mi325x": "xgmi", "rtx-a6000": "pcie4",
}  # fmt: skip


def flat(text: str) -> str:
    return " ".join(text.split())


# --- links by GPU -----------------------------------------------------------------------


def test_every_gpu_names_its_own_link():
    assert set(catalog.gpu_names()) == set(OWN_LINK)  # a new GPU must say which link it has
    for gpu, link in OWN_LINK.items():
        hw = catalog.build_hardware(gpu=gpu, gpus=8)
        assert hw.intra.name == link, gpu
        assert hw.intra.what  # described in words for the plan's header


def test_pcie_links_are_slower_than_nvlink_and_grow_with_the_generation():
    bw = {n: catalog.get_link(n).bus_bytes_per_s for n in ("pcie3", "pcie4", "pcie5", "nvlink3")}
    assert bw["pcie3"] < bw["pcie4"] < bw["pcie5"] < bw["nvlink3"]
    # each generation of PCIe doubles the per-lane rate (8, 16, 32 GT/s): so do the figures
    assert bw["pcie5"] / bw["pcie4"] == pytest.approx(2) and bw["pcie4"] / bw["pcie3"] == pytest.approx(2)


def test_interconnect_nvlink_is_the_gpus_generation():
    a100 = catalog.build_hardware(gpu="a100-80g", gpus=8, interconnect="nvlink").intra
    h100 = catalog.build_hardware(gpu="h100-sxm", gpus=8, interconnect="nvlink").intra
    v100 = catalog.build_hardware(gpu="v100-32g", gpus=8, interconnect="nvlink").intra
    assert (a100.name, h100.name, v100.name) == ("nvlink3", "nvlink4", "nvlink2")
    assert a100.bus_bytes_per_s != h100.bus_bytes_per_s
    assert a100.bus_bytes_per_s == catalog.get_link("nvlink3").bus_bytes_per_s
    assert h100.bus_bytes_per_s == catalog.get_link("nvlink4").bus_bytes_per_s
    # `pcie` likewise: the GPU's host-interface generation
    assert catalog.build_hardware(gpu="h100-sxm", gpus=8, interconnect="pcie").intra.name == "pcie5"
    assert catalog.build_hardware(gpu="v100-32g", gpus=8, interconnect="pcie").intra.name == "pcie3"
    # the CLI says the same in its JSON
    for gpu, link in (("a100-80g", "nvlink3"), ("h100-sxm", "nvlink4")):
        res = runner.invoke(app, ["plan", "--json", "--gpu", gpu, "--gpus", "8", "--gpus-per-node", "8",
                                  "--interconnect", "nvlink", "-s", "zero2"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["hardware"]["links"]["intra"]["name"] == link


@pytest.mark.parametrize(("gpu", "own"), [("rtx-4090", "pcie4"), ("l40s", "pcie4"), ("h100-pcie", "pcie5"),
                                          ("mi300x", "xgmi")])
def test_interconnect_nvlink_is_refused_where_the_gpu_has_none(gpu, own):
    res = runner.invoke(app, ["plan", "--gpu", gpu, "--gpus", "4", "--gpus-per-node", "4", "--interconnect", "nvlink"])
    out = flat(res.output)
    assert res.exit_code == 2
    assert f"--interconnect nvlink: {gpu} has no NVLink" in out and f"talk over {own}" in out
    with pytest.raises(ShardwiseError, match="own generation"):
        catalog.get_link("nvlink")  # without a GPU there is no generation to mean


def test_four_rtx_4090s_plan_over_pcie_and_say_so():
    args = ["--params", "13e9", "--gpu", "rtx-4090", "--gpus", "4", "--gpus-per-node", "4", "--lora-rank", "16"]
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 0, res.output
    assert ("1 node(s) × 4 GPUs; links: intra-node pcie4 20 GB/s (PCIe 4.0 x16, no NVLink; the rtx-4090's own)"
            in flat(res.output))
    doc = json.loads(runner.invoke(app, ["plan", "--json", *args]).output)
    intra = doc["hardware"]["links"]["intra"]
    assert (intra["name"], intra["gpu_default"], intra["bus_bytes_per_s"]) == ("pcie4", True, 20e9)
    assert doc["hardware"]["intra"] == "pcie4"
    # what the plan prices: DP traffic inside the node at 20 GB/s, not the 150 GB/s it used to assume
    hw = catalog.build_hardware(gpu="rtx-4090", gpus=4)
    assert hw.intra.bus_bytes_per_s == 20e9


def test_a_named_link_says_it_is_not_the_gpus_own():
    res = runner.invoke(app, ["plan", "--gpus", "8", "--gpus-per-node", "8", "--interconnect", "pcie4"])
    assert "intra-node pcie4 20 GB/s (PCIe 4.0 x16, no NVLink; not the a100-80g's own nvlink3)" in flat(res.output)


# --- collective times against hand arithmetic ----------------------------------------------
# NCCL's tuning model (src/graph/tuning.cc), Simple protocol: 8.4 us base latency per call, per
# ring step the link's hardware latency, an intra step of a multi-node ring at least 3 us.
BASE, NET_OVERHEAD = 8.4e-6, 3e-6


def test_all_gather_on_two_nodes_of_eight():
    hw = catalog.build_hardware(gpu="a100-80g", gpus=16, gpus_per_node=8, interconnect="ib-200")
    nvl, nic = hw.intra.bus_bytes_per_s, hw.inter.bus_bytes_per_s  # 230e9 per GPU, 22e9 per NIC
    lat_in, lat_out = hw.intra.latency_s, hw.inter.latency_s
    size = 1e9  # a 1 GB all-gather: each GPU receives 15/16 of it
    # bandwidth: one NIC per GPU, a ring through all 8 GPUs of each node carries through each NIC
    # 1/8 of its traffic -> 8 x 22 GB/s for the ring, under NVLink's 230
    bus = min(nvl, 8 * nic)
    assert network.inter_bus(hw, 8) == pytest.approx(bus)
    # latency: 15 ring steps, 1 of them between the nodes
    expected = size * 15 / 16 / bus + BASE + 14 * max(lat_in, NET_OVERHEAD) + 1 * lat_out
    group = network.Group(16, 2, bus, lat_in, lat_out)
    assert network.ring_collective_time(size, group) == pytest.approx(expected)
    # through the step's entry point: one all-gather of the data-parallel group of 16 across nodes
    comm = CommBreakdown(all_gather=size, inter=size, calls=1)
    layout = ParallelLayout(world_size=16, dp_shard=16)
    assert network.comm_time(comm, hw, layout) == pytest.approx(expected)
    # ten calls of 100 MB: the same bandwidth term, ten latencies
    ten = CommBreakdown(all_gather=size, inter=size, calls=10)
    assert network.comm_time(ten, hw, layout) == pytest.approx(
        size * 15 / 16 / bus + 10 * (BASE + 14 * max(lat_in, NET_OVERHEAD) + lat_out))


def test_ring_inside_one_node():
    # 8 GPUs on NVLink 3 (230 GB/s, 3.4 us a step), two calls moving 1 GB in all
    expected = 1e9 * 7 / 8 / 230e9 + 2 * (BASE + 7 * 3.4e-6)
    assert network.ring_time(1e9, 8, 230e9, 3.4e-6, 2) == pytest.approx(expected)
    assert network.ring_time(1e9, 1, 230e9, 3.4e-6, 2) == 0.0  # one rank: nothing to move


def test_all_reduce_takes_the_faster_of_ring_and_tree():
    nvl, nic, lat_in, lat_out = 230e9, 22e9, 3.4e-6, 14e-6
    g = network.Group(256, 32, min(nvl, 8 * nic), lat_in, lat_out)  # 32 nodes of 8
    # ring all-reduce: 2·255 steps, 2·31 of them between nodes; tree: 2·(7 intra + log2(32) = 5 inter)
    ring_lat = BASE + (2 * 255 - 2 * 31) * max(lat_in, NET_OVERHEAD) + 2 * 31 * lat_out
    tree_lat = BASE + 2 * (7 * lat_in + 5 * lat_out)
    assert network.ring_latency(g, allreduce=True) == pytest.approx(ring_lat)
    assert network.tree_latency(g) == pytest.approx(tree_lat)
    small, big = 2 * 1e6, 2 * 4e9  # ring volumes (twice the size) of a 1 MB and a 4 GB all-reduce
    for v in (small, big):
        ring = v * 255 / 256 / g.bus_bytes_per_s + ring_lat
        tree = v / (0.92 * g.bus_bytes_per_s) + tree_lat
        assert network.allreduce_time(v, g) == pytest.approx(min(ring, tree))
    # latency-bound: the tree wins the small one; bandwidth-bound: the ring wins the big one
    assert network.allreduce_time(small, g) < network.ring_collective_time(small, g, allreduce=True)
    assert network.allreduce_time(big, g) == pytest.approx(network.ring_collective_time(big, g, allreduce=True))


def test_groups_sharing_a_node_share_its_nics():
    hw = catalog.build_hardware(gpu="a100-80g", gpus=16, gpus_per_node=8, interconnect="ib-200")
    # TP 8: each node holds one rank of each of the 8 DP groups, all reducing at once: one NIC each
    assert network.inter_bus(hw, 1) == pytest.approx(22e9)
    # Ethernet, one NIC per node: a GPU's share is 1/8 of it
    eth = catalog.build_hardware(gpu="a100-80g", gpus=16, gpus_per_node=8, interconnect="eth-100")
    assert network.nic_bytes_per_s_per_gpu(eth) == pytest.approx(10e9 / 8)
    assert network.inter_bus(eth, 8) == pytest.approx(10e9)
    # four NICs for eight GPUs: half a NIC each
    four = catalog.build_hardware(gpu="a100-80g", gpus=16, gpus_per_node=8, interconnect="ib-200", nics_per_node=4)
    assert network.nic_bytes_per_s_per_gpu(four) == pytest.approx(22e9 * 4 / 8)


def test_latency_grows_with_ranks_and_nodes():
    lats = [network.ring_latency(network.Group(8 * n, n, 176e9, 3.4e-6, 14e-6)) for n in (1, 2, 16, 192)]
    assert lats == sorted(lats) and lats[-1] > 100 * lats[0]


# --- GPT-3 175B under ZeRO-3 at 384, 768, 1,536 A100s (Megatron-LM paper Table 2) ---------


def _accuracy():
    return load("accuracy")


def test_gpt3_zero3_exposed_communication_grows_with_the_gpu_count():
    acc = _accuracy()
    runs = {r["gpus"]: r for r in acc.load_runs() if r["name"].startswith("gpt-174.6b") and r["strategy"] == "zero3"}
    assert set(runs) == {384, 768, 1536}
    times, comms = {}, {}
    for n, run in runs.items():
        model, hw, train, strategy = acc.build(run)
        ev = evaluate(model, hw, train, strategy, margin=0.0)
        times[n], comms[n] = ev.time, ev.comm
    # the same bytes and calls per GPU at every scale (ZeRO-3 gathers the whole model whatever the
    # batch), but more ring steps: the collectives take longer and less compute is left to hide them
    assert comms[384].total == pytest.approx(comms[1536].total) and comms[384].calls == comms[1536].calls
    assert times[384].comm_s < times[768].comm_s < times[1536].comm_s
    assert times[1536].exposed_comm_s > 2 * times[384].exposed_comm_s
    assert times[1536].exposed_fraction > times[384].exposed_fraction
    # by hand: 8-GPU nodes, 48 vs 192 of them; per call, n - N intra steps (NVLink 3.4 us, at least
    # the 3 us network overhead) and N - 1 steps over InfiniBand (14 us)
    per_call = ((1536 - 192) - (384 - 48)) * max(3.4e-6, NET_OVERHEAD) + (191 - 47) * 14e-6
    v = comms[384].total  # ring volume per GPU (all-gathers and reduce-scatters)
    bandwidth = v * (1 / 384 - 1 / 1536) / (8 * 22e9)  # (n-1)/n grows a little too
    assert times[1536].comm_s - times[384].comm_s == pytest.approx(comms[384].calls * per_call + bandwidth)


# --- --nics-per-node ----------------------------------------------------------------------


def test_nics_per_node_is_at_most_the_gpus_per_node():
    res = runner.invoke(app, ["plan", "--gpus", "16", "--gpus-per-node", "8", "--nics-per-node", "64"])
    assert res.exit_code == 2
    assert "--nics-per-node 64 exceeds the 8 GPUs per node: expected 1..8" in flat(res.output)
    with pytest.raises(ShardwiseError, match="--nics-per-node 9"):
        catalog.build_hardware(gpus=16, gpus_per_node=8, nics_per_node=9)
    ok = runner.invoke(app, ["plan", "--gpus", "16", "--gpus-per-node", "8", "--nics-per-node", "8", "-s", "zero2"])
    assert ok.exit_code == 0, ok.output


def test_fewer_nics_make_cross_node_collectives_slower():
    model = catalog.get_model("llama-2-7b")
    from shardwise.specs import Strategy, TrainSpec

    t = {}
    for nics in (8, 2):
        hw = catalog.build_hardware(gpus=16, gpus_per_node=8, interconnect="ib-200", nics_per_node=nics)
        t[nics] = evaluate(model, hw, TrainSpec(), Strategy.from_name("zero3")).time.comm_s
    assert t[2] > t[8] and math.isfinite(t[2])


# The NIC of each GPU's reference node (NVIDIA DGX BasePOD reference architecture, "Core Components":
# DGX H100/H200/B200 carry eight single-port ConnectX-7 at up to 400 Gb/s; DGX A100 eight HDR 200).
REFERENCE_NIC = {"h100-sxm": "ib-400", "h200": "ib-400", "b200": "ib-400", "gb200": "ib-400", "a100-80g": "ib-200",
                 "a100-40g": "ib-200"}


@pytest.mark.parametrize(("gpu", "nic"), sorted(REFERENCE_NIC.items()))
def test_a_multi_node_plan_assumes_the_reference_nodes_nic(gpu, nic):
    hw = catalog.build_hardware(gpu=gpu, gpus=16, gpus_per_node=8)
    assert hw.inter.name == nic
    # --interconnect still names another
    assert catalog.build_hardware(gpu=gpu, gpus=16, gpus_per_node=8, interconnect="roce-100").inter.name == "roce-100"


def test_the_plan_prints_the_network_it_assumed():
    r = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--gpus", "16", "--json"])
    assert r.exit_code == 0, r.output
    links = json.loads(r.output)["hardware"]["links"]
    assert links["inter"]["name"] == "ib-400" and links["inter"]["used"]
