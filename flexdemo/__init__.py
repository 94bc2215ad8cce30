"""FlexDeMo: decoupled momentum (DeMo) and DeToNATION replicators on hybrid sharded parallelism.

Usage on N nodes × G ranks (one process per rank, process group already initialised)::

    record = method_record(method)                           # its replicator, knobs, lr, wiring
    mesh = build_mesh(N, G)                                  # ("replicate", "shard")
    parallelize(model, mesh, inter_all_reduce=record.inter_all_reduce)
    opt = build_optimizer(method, model, mesh, topk=8)       # record's lr, knobs unless given
    loss.backward(); opt.step()

or directly::

    opt = FlexDeMo(model.parameters(), lr=1e-3, replicator=DeMoReplicator(topk=32, chunk=64),
                   base="sign", replication_group=replicate_group(mesh))
    opt.step(); opt.last_step_comm                           # bytes/calls on the inter-node group

Where things live: ``methods.py`` (one record per method: replicator, knobs with the method's
defaults, lr, wiring) and ``build.py`` (``build_optimizer``, a record made into an optimizer),
``knobs.py`` (each replicator's knobs: the one place a default and a check live),
``optimizer.py`` (FlexDeMo), ``bases.py`` (sign-SGD and AdamW steps), ``replicators/`` (one
module per family), ``dct.py`` and ``chunking.py`` (the transform), ``codec.py`` (top-k and
index wire format), ``formats.py`` and ``bitpack.py`` (the value formats, quantizers and
bit-packed indices), ``wire.py`` (the bucket and byte counts), ``graphs.py`` (gossip graphs,
mixing matrices and Ada's ladder), ``consensus.py`` (replica variance), ``hsdp.py`` (mesh and
FSDP2), ``devices.py`` (the default group's backend, the side-channel tensors' device),
``program.py`` (a replicator's exchange step by step as data, which ``Replicator.program``
writes for a planner and an emulator). Only torch is imported here, and only when a name that
needs it is first used: ``methods``, ``knobs``, ``graphs``, ``chunking``, ``program`` and
``devices`` are torch-free at import, so run settings are checked without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# Name -> the module that defines it, imported on first use (PEP 562): `import flexdemo.methods`
# must not pull torch in through this file.
_WHERE = {
    "BASES": "knobs", "VALUE_FORMATS": "knobs", "VALUE_DTYPES": "knobs", "Knobs": "knobs",
    "StepKnobs": "knobs", "DeMoKnobs": "knobs", "RandomKnobs": "knobs",
    "StridingKnobs": "knobs", "DiLoCoKnobs": "knobs", "GossipKnobs": "knobs",
    "AdaKnobs": "knobs", "PowerSGDKnobs": "knobs", "TopKKnobs": "knobs",
    "SparseLoCoKnobs": "knobs", "ReduceKnobs": "knobs",
    "BASELINE": "methods", "METHODS": "methods", "RECORDS": "methods", "Method": "methods",
    "method_record": "methods",
    "build_optimizer": "build", "has_program": "build", "program_of": "build",
    "replicator_of": "build",
    "index_width": "bitpack", "pack_bits": "bitpack", "packed_nbytes": "bitpack",
    "unpack_bits": "bitpack",
    "CHUNKINGS": "chunking", "BlockLayout": "chunking", "largest_divisor_at_most": "chunking",
    "matrix_shape": "chunking",
    "index_dtype": "codec", "mean_decode": "codec", "topk_encode": "codec",
    "replica_spread": "consensus",
    "dct_chunked": "dct", "dct_matrix": "dct", "idct_chunked": "dct",
    "WireFormat": "formats", "make_format": "formats",
    "GRAPHS": "graphs", "check_graph": "graphs", "graph_ladder": "graphs",
    "mixing_matrix": "graphs",
    "build_mesh": "hsdp", "parallelize": "hsdp", "replicate_group": "hsdp",
    "shard_group": "hsdp", "shard_layout": "hsdp", "fsdp_units": "hsdp",
    "parameter_units": "hsdp",
    "watch_unit_backward": "hsdp",
    "FlexDeMo": "optimizer", "local_tensor": "optimizer",
    "OPS": "program", "Op": "program", "Periodic": "program", "Program": "program",
    "REPLICATORS": "replicators", "AdaReplicator": "replicators",
    "DeMoReplicator": "replicators", "DiLoCoReplicator": "replicators",
    "FullReplicator": "replicators", "GossipReplicator": "replicators",
    "NoReplicator": "replicators", "RandomReplicator": "replicators",
    "Replicator": "replicators", "StridingReplicator": "replicators",
    "StreamingDiLoCoReplicator": "replicators", "PowerSGDReplicator": "replicators",
    "TopKReplicator": "replicators", "SparseLoCoReplicator": "replicators",
    "ReduceReplicator": "replicators",
    "backend_for": "devices", "side_channel_device": "devices",
    "CommStats": "wire", "all_gather_bytes": "wire", "all_reduce_bytes": "wire", "pack": "wire",
    "plan_bucket": "wire", "unpack": "wire",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the module defining ``name`` on first use and keep the name here."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'flexdemo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and this module's own."""
    return sorted(set(globals()) | set(__all__))
