"""The reference-style call on a sharded model: the replication group comes from the mesh, and a
group that would average different shards is refused (2 x 2 gloo mesh, FSDP2)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from flexdemo import FlexDeMo, build_mesh, parallelize, replicate_group
from tests.dist_utils import TinyBlocks, run_ranks

NODES, PER_NODE = 2, 2
REFERENCE_CALL = dict(lr=1e-3, compression_topk=4, compression_chunk=8, compression_decay=0.999,
                      replicator="demo")


def _raises(build) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    raise AssertionError("no ValueError")


def _body(rank: int, world: int) -> None:
    torch.manual_seed(0)
    mesh = build_mesh(NODES, PER_NODE)
    model = parallelize(TinyBlocks(), mesh, inter_all_reduce=False)
    replicas = sorted(dist.get_process_group_ranks(replicate_group(mesh)))

    # Without a group: the mesh's replicate dim, not the 4-rank world.
    opt = FlexDeMo(model.parameters(), **REFERENCE_CALL)
    assert opt.replicas == NODES
    assert sorted(dist.get_process_group_ranks(opt.replication_group)) == replicas

    # The world group holds this rank's node neighbour, which holds the other shard.
    message = _raises(lambda: FlexDeMo(model.parameters(), replication_group=dist.group.WORLD,
                                       **REFERENCE_CALL))
    neighbour = rank ^ 1  # ranks 2k and 2k+1 share a node
    assert f"holds ranks [{neighbour}]" in message and "'replicate' dim group" in message

    # The right group, given explicitly, is kept.
    opt = FlexDeMo(model.parameters(), replication_group=replicate_group(mesh), **REFERENCE_CALL)
    assert opt.replicas == NODES

    # Sharded over all 4 ranks of a 1-D mesh: no group holds copies, so the default is refused.
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    from torch.distributed.fsdp import fully_shard

    whole = nn.Linear(8, 8)
    fully_shard(whole, mesh=flat)
    message = _raises(lambda: FlexDeMo(whole.parameters(), **REFERENCE_CALL))
    assert "sharded over ranks [0, 1, 2, 3]" in message and "pass replication_group=" in message


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_the_reference_call_on_a_sharded_model_averages_copies_of_one_shard():
    run_ranks(_body, NODES * PER_NODE)
