"""The device mesh, built from the planner's ParallelLayout in this one place (torchtitan's
`ParallelDims.build_mesh`): the engines take their process groups from it, never from their
own reading of the strategy, so the shard group the plan assumed is the one that runs."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.specs import ParallelLayout

# Outer to inner, as torchtitan orders them: pipeline stages, replicas, shards, tensor ranks.
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """A mesh over all ranks with one named dimension per parallel degree above 1; `dp_shard`
    is always present (size 1 on one rank) so data-parallel engines always find their group."""
    degrees = {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "tp": layout.tp}
    names = tuple(d for d in DIMS if degrees[d] > 1 or d == "dp_shard")
    return init_device_mesh(device_type, tuple(degrees[d] for d in names), mesh_dim_names=names)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The (dp_replicate, dp_shard) sub-mesh FSDP2 shards over: 2-D for HSDP, else 1-D."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"] if len(names) > 1 else mesh
