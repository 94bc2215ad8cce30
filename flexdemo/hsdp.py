"""HSDP wiring: the 2-D (replicate, shard) device mesh and FSDP2 applied block by block."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

MESH_DIMS = ("replicate", "shard")


def build_mesh(nodes: int, per_node: int, device_type: str = "cpu",
               backend: str | None = None) -> DeviceMesh:
    """Build the (replicate=nodes, shard=per_node) mesh from groups made with ``backend``.

    Every rank creates every group in the same order, as ``dist.new_group`` requires.
    """
    if not (isinstance(nodes, int) and nodes >= 1):
        raise ValueError(f"nodes={nodes!r} must be an integer >= 1.")
    if not (isinstance(per_node, int) and per_node >= 1):
        raise ValueError(f"per_node={per_node!r} must be an integer >= 1.")
    world = dist.get_world_size()
    if world != nodes * per_node:
        raise ValueError(f"nodes*per_node={nodes * per_node} must equal the world size {world}.")
    rank = dist.get_rank()
    layout = torch.arange(world).view(nodes, per_node)
    replicate_group = shard_group = None
    # Replicate groups: one rank per node with the same local index (columns of the layout).
    for j in range(per_node):
        group = dist.new_group(layout[:, j].tolist(), backend=backend)
        if rank % per_node == j:
            replicate_group = group
    for n in range(nodes):
        group = dist.new_group(layout[n].tolist(), backend=backend)
        if rank // per_node == n:
            shard_group = group
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=layout,
                                 mesh_dim_names=MESH_DIMS)


def _blocks(model: nn.Module) -> list[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return [b for b in blocks if any(True for _ in b.parameters())]
    return [c for c in model.children() if any(True for _ in c.parameters())]


def parallelize(model: nn.Module, mesh: DeviceMesh, inter_all_reduce: bool = True) -> nn.Module:
    """Apply FSDP2 to each block with parameters, then to the root.

    ``inter_all_reduce=True`` is HSDP on the 2-D mesh: reduce-scatter inside the node, then
    all-reduce across nodes. ``inter_all_reduce=False`` (the FlexDeMo family, which replicates
    itself) shards over the mesh's "shard" dim only: each node is an independent FSDP2 group, so
    gradients arrive reduce-scattered and averaged inside the node and nothing crosses nodes.
    FSDP2's own switch, ``set_requires_all_reduce(False)``, is meant for gradient accumulation:
    it holds the reduce-scattered gradient back from ``.grad`` until a step with the all-reduce
    on, so the optimizer would never see it.
    """
    target = mesh if inter_all_reduce else mesh[MESH_DIMS[1]]
    for block in _blocks(model):
        fully_shard(block, mesh=target)
    fully_shard(model, mesh=target)
    return model


def replicate_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The inter-node group (one rank per node) of ``mesh``."""
    return mesh.get_group(MESH_DIMS[0])


def shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The intra-node group of ``mesh``."""
    return mesh.get_group(MESH_DIMS[1])
