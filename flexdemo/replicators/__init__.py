"""Replicators: how the shard gradients of one replica are exchanged with the other replicas.

One class per scheme, each owning its knobs (``knobs_type``, a schema of
:mod:`flexdemo.knobs`) and its schedule (``replicates_on(step)``):

- ``demo.py``: :class:`DeMoReplicator`, top-k DCT coefficients of a decoupled momentum
  (``blocks.py`` holds its batched block transform and momentum, ``reference_blocks.py`` the
  same steps in the reference package's arithmetic).
- ``dense.py``: :class:`FullReplicator` (average everything), :class:`NoReplicator` (nothing).
- ``partial.py``: :class:`RandomReplicator`, :class:`StridingReplicator`: part of a
  parameter-space momentum.
- ``gossip.py``: :class:`GossipReplicator`, decentralized: parameters mixed with the
  neighbours of a communication graph (``flexdemo/graphs.py``), point to point.
- ``ada.py``: :class:`AdaReplicator`, gossip whose graph moves along a ladder of graphs with
  the replica spread it measures (``sampled_spread.py``) every few rounds.
- ``diloco.py``: :class:`DiLoCoReplicator`, local steps and a periodic outer Nesterov step.
- ``streaming_diloco.py``: :class:`StreamingDiLoCoReplicator`, DiLoCo per fragment on
  staggered steps, each sync overlapped with a few inner steps (``outer_wire.py``: its wire).
- ``powersgd.py``: :class:`PowerSGDReplicator`, the gradients' mean at low rank (PowerSGD's
  factors P and Q, error feedback, warm start), as PyTorch's ``powerSGD_hook``.
- ``topk.py``: :class:`TopKReplicator`, the top-k of an accumulated velocity with error
  feedback (Deep Gradient Compression), all-gathered.
- ``sparseloco.py``: :class:`SparseLoCoReplicator`, DiLoCo's outer step on a chunked top-k of
  an error-feedback buffer, its values in 2 bits.
- ``reduce.py``: :class:`ReduceReplicator`, the gradient mean in low precision (bf16, or fp8 and
  int8 rows as torchft's quantized all-reduce): hsdp-adamw's ``reduce_format``.

A new scheme is one subclass of :class:`Replicator` (``base.py``), its knobs in
:mod:`flexdemo.knobs` and one entry in ``REPLICATORS``; a named method using it is one record in
:mod:`flexdemo.methods`. Its program (:mod:`flexdemo.program`), written by
:meth:`Replicator.program`, is what a planner and an emulator read of it
(:func:`flexdemo.build.program_of`).
"""

from __future__ import annotations

from .ada import AdaReplicator
from .base import Replicator
from .demo import DeMoReplicator
from .dense import FullReplicator, NoReplicator
from .diloco import DiLoCoReplicator
from .gossip import GossipReplicator
from .partial import RandomReplicator, StridingReplicator
from .powersgd import PowerSGDReplicator
from .reduce import ReduceReplicator
from .sparseloco import SparseLoCoReplicator
from .streaming_diloco import StreamingDiLoCoReplicator
from .topk import TopKReplicator

# Name -> class, for the reference-compatible ``FlexDeMo(..., replicator="demo")``.
REPLICATORS: dict[str, type[Replicator]] = {
    cls.name: cls for cls in (DeMoReplicator, FullReplicator, NoReplicator, RandomReplicator,
                              StridingReplicator, DiLoCoReplicator, StreamingDiLoCoReplicator,
                              GossipReplicator, AdaReplicator, PowerSGDReplicator,
                              TopKReplicator, SparseLoCoReplicator, ReduceReplicator)
}

__all__ = [
    "REPLICATORS",
    "AdaReplicator",
    "DeMoReplicator",
    "DiLoCoReplicator",
    "FullReplicator",
    "GossipReplicator",
    "NoReplicator",
    "PowerSGDReplicator",
    "RandomReplicator",
    "ReduceReplicator",
    "Replicator",
    "SparseLoCoReplicator",
    "StreamingDiLoCoReplicator",
    "StridingReplicator",
    "TopKReplicator",
]
