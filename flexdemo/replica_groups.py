"""Which ranks hold copies of this rank's shard: the replication group of sharded parameters.

An optimizer that averages across replicas must average copies of the same shard. For FSDP2
DTensors the parameters say which ranks those are: the mesh dims a parameter is sharded on hold
other shards (its shard group), the dims it is replicated on hold copies. The world group, the
natural default for unsharded parameters, mixes shards as soon as a parameter is split over more
than one rank, and training still runs (the loss falls), so the mistake must be caught here.

Layouts are compared by their ranks, never by mesh object: DTensor's sharding propagation caches
its output specs by value, so a parameter of a model built on a fresh mesh can carry an earlier
model's value-equal mesh (torch 2.13: ``nn.Parameter`` detaches the DTensor, and the detach's
cached spec holds the mesh first seen with that shape), and one model's parameters then carry
two mesh objects for one layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["ShardLayout", "shard_layout", "replication_group_for"]


@dataclass(frozen=True)
class ShardLayout:
    """A rank's sharded parameters: their shard group and the mesh dims that hold copies."""

    shard_ranks: frozenset[int]
    # This rank's copies along each replicate dim: what makes two layouts the same.
    copies: tuple[frozenset[int], ...]
    # (mesh, dim) pairs along which the parameters are replicated: a dim of their own mesh with a
    # Replicate placement, or a dim of the root mesh their (sub)mesh leaves out (FSDP2 on the
    # "shard" submesh of an HSDP mesh, as flexdemo.parallelize wraps the FlexDeMo family). Kept
    # for names and groups, left out of equality (see the module docstring).
    replicate: tuple[tuple[object, int], ...] = field(compare=False)

    def names(self) -> str:
        """The replicate dims by name, for a sentence."""
        return ", ".join(_dim_name(mesh, d) for mesh, d in self.replicate)


def _dim_name(mesh: object, dim: int) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    return repr(names[dim]) if names else str(dim)


def _root(mesh: object) -> object:
    # DeviceMesh keeps the mesh a submesh was sliced from; private in torch 2.13, hence guarded.
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if callable(get_root) else mesh


def _ranks_along(mesh: object, dims: tuple[int, ...]) -> frozenset[int]:
    """This rank's mesh neighbours that differ from it only along ``dims``."""
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d in dims else c for d, c in enumerate(coordinate))
    return frozenset(int(r) for r in mesh.mesh[index].flatten().tolist())


def _layout_of(param: torch.Tensor) -> ShardLayout | None:
    """The layout of a DTensor sharded over more than one rank, else None."""
    mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
    if mesh is None or placements is None:
        return None
    sharded = tuple(d for d, p in enumerate(placements) if p.is_shard() and mesh.size(d) > 1)
    if not sharded:
        return None
    replicate = [(mesh, d) for d, p in enumerate(placements) if p.is_replicate()]
    root, own = _root(mesh), set(getattr(mesh, "mesh_dim_names", None) or ())
    if root is not mesh and root.mesh_dim_names:
        replicate += [(root, d) for d, name in enumerate(root.mesh_dim_names) if name not in own]
    copies = tuple(_ranks_along(m, (d,)) for m, d in replicate)
    return ShardLayout(_ranks_along(mesh, sharded), copies, tuple(replicate))


def shard_layout(params: list[torch.Tensor]) -> ShardLayout | None:
    """The layout of the parameters sharded over more than one rank; None if there are none.

    ValueError (one sentence) when sharded parameters are laid out differently: then no one
    group holds copies of every shard.
    """
    # Equal layouts (equal ranks) collapse to the first seen, whichever mesh objects they hold.
    layouts = list(dict.fromkeys(layout for p in params
                                 if (layout := _layout_of(p)) is not None))
    if not layouts:
        return None
    if len(layouts) > 1:
        raise ValueError("the parameters are sharded on different meshes or placements, so no "
                         "one replication group holds copies of every shard; give each set of "
                         "parameters an optimizer of its own with its replication_group.")
    return layouts[0]


def replication_group_for(params: list[torch.Tensor],
                          given: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to average replicas over: ``given`` if it is right for the parameters, else one
    derived from their mesh when that is unambiguous.

    Unsharded parameters (plain tensors, or DTensors whose shard dims have one rank) keep
    ``given`` (None: the default group). For sharded ones, a given group must not hold two ranks
    of one shard group; without one, the single mesh dim they are replicated along is the group.
    ValueError (one sentence naming the group to pass) otherwise.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return given
    layout = shard_layout(params)
    if layout is None:
        return given
    me = dist.get_rank()
    if given is None:
        if len(layout.replicate) != 1:
            raise ValueError(
                f"the parameters are sharded over ranks {sorted(layout.shard_ranks)} and their "
                f"mesh has {len(layout.replicate)} replicate dims, so the default group "
                "would average different shards; pass replication_group= the group of ranks "
                "that hold copies of this rank's shard (for HSDP: "
                "flexdemo.replicate_group(mesh)).")
        # Possibly an earlier model's value-equal mesh (see the module docstring): its group
        # has the same ranks, and the backend that mesh was built with.
        mesh, dim = layout.replicate[0]
        return mesh.get_group(dim)
    members = frozenset(dist.get_process_group_ranks(given))
    mixed = sorted((members & layout.shard_ranks) - {me})
    if mixed:
        hint = (f"the mesh's {layout.names()} dim group "
                "(for HSDP: flexdemo.replicate_group(mesh))" if layout.replicate
                else "a group of ranks that hold copies of this rank's shard")
        raise ValueError(
            f"replication_group holds ranks {mixed} that hold other shards of this rank's "
            f"parameters (its shard group is {sorted(layout.shard_ranks)}), so averaging over "
            f"it would mix shards; pass {hint}.")
    return given
