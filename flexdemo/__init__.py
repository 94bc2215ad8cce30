"""FlexDeMo: decoupled momentum (DeMo) and DeToNATION replicators on hybrid sharded parallelism.

Usage on N nodes × G ranks (one process per rank, process group already initialised)::

    mesh = build_mesh(N, G)                                  # ("replicate", "shard")
    parallelize(model, mesh, inter_all_reduce=method_uses_inter_all_reduce(method))
    opt = build_optimizer(method, model, mesh)    # DEFAULT_LR, DEFAULT_KNOBS unless given
    loss.backward(); opt.step()

or directly::

    opt = FlexDeMo(model.parameters(), lr=1e-3, replicator=DeMoReplicator(topk=32, chunk=64),
                   base="sign", replication_group=replicate_group(mesh))
    opt.step(); opt.last_step_comm                           # bytes/calls on the inter-node group

Where things live: ``optimizer.py`` (FlexDeMo), ``bases.py`` (sign-SGD and AdamW steps),
``replicators/`` (one module per family), ``dct.py`` and ``chunking.py`` (the transform),
``codec.py`` (top-k and index wire format), ``formats.py`` and ``bitpack.py`` (the value
formats, quantizers and bit-packed indices), ``wire.py`` (the bucket and byte counts),
``graphs.py`` (gossip graphs, mixing matrices and Ada's ladder), ``consensus.py`` (replica
variance), ``methods.py`` (method name -> replicator and base), ``hsdp.py`` (mesh and FSDP2).
Only torch is imported here.
"""

from .bases import BASES
from .bitpack import index_width, pack_bits, packed_nbytes, unpack_bits
from .chunking import CHUNKINGS, BlockLayout, largest_divisor_at_most, matrix_shape
from .codec import index_dtype, mean_decode, topk_encode
from .consensus import replica_spread
from .dct import dct_chunked, dct_matrix, idct_chunked
from .formats import VALUE_FORMATS, WireFormat, make_format
from .graphs import GRAPHS, check_graph, graph_ladder, mixing_matrix
from .hsdp import build_mesh, parallelize, replicate_group, shard_group
from .methods import (
    DEFAULT_KNOBS,
    DEFAULT_LR,
    METHODS,
    build_optimizer,
    method_uses_inter_all_reduce,
    method_uses_sharding,
    resolve_knobs,
)
from .optimizer import FlexDeMo, local_tensor
from .replicators import (
    REPLICATORS,
    AdaReplicator,
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    GossipReplicator,
    NoReplicator,
    RandomReplicator,
    Replicator,
    StridingReplicator,
)
from .wire import CommStats, all_gather_bytes, all_reduce_bytes, pack, plan_bucket, unpack

__all__ = [
    "BASES",
    "CHUNKINGS",
    "DEFAULT_KNOBS",
    "DEFAULT_LR",
    "GRAPHS",
    "METHODS",
    "REPLICATORS",
    "AdaReplicator",
    "BlockLayout",
    "CommStats",
    "DeMoReplicator",
    "DiLoCoReplicator",
    "FlexDeMo",
    "FullReplicator",
    "GossipReplicator",
    "NoReplicator",
    "RandomReplicator",
    "Replicator",
    "StridingReplicator",
    "VALUE_FORMATS",
    "WireFormat",
    "all_gather_bytes",
    "all_reduce_bytes",
    "build_mesh",
    "build_optimizer",
    "check_graph",
    "graph_ladder",
    "dct_chunked",
    "dct_matrix",
    "idct_chunked",
    "index_dtype",
    "index_width",
    "largest_divisor_at_most",
    "local_tensor",
    "make_format",
    "matrix_shape",
    "mean_decode",
    "method_uses_inter_all_reduce",
    "mixing_matrix",
    "method_uses_sharding",
    "pack",
    "pack_bits",
    "packed_nbytes",
    "parallelize",
    "plan_bucket",
    "replica_spread",
    "replicate_group",
    "resolve_knobs",
    "shard_group",
    "topk_encode",
    "unpack",
    "unpack_bits",
]
