"""The replicators' knobs: a frozen dataclass each, the one place a default and a check live.

A replicator names its schema (``Replicator.knobs_type``) and builds it from its keyword
arguments, so ``DeMoReplicator(topk=8)`` and a run's ``--topk 8`` meet the same check, once,
without a process group. :class:`StepKnobs` are FlexDeMo's own (the base step and the sign).
A field's docstring is the help of its ``flexbench run`` flag; :mod:`flexdemo.methods` records
which schema each method reads, with the method's own defaults.

Torch-free (as ``methods``, ``graphs``, ``chunking`` and ``_checks``), so that a run's settings
are checked without importing torch (``flexbench sweep --dry-run`` checks every unit).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ._checks import check, in_unit_interval, int_at_least
from .chunking import CHUNKINGS
from .graphs import graph_ladder, graph_name_problem, graph_problem

__all__ = ["ARITHMETICS", "BASES", "EXCHANGES", "FRAGMENT_CUTS", "MAX_DCT_CHUNK", "VALUE_DTYPES",
           "VALUE_FORMATS", "AdaKnobs", "DeMoKnobs", "DiLoCoKnobs", "EveryKnobs", "GossipKnobs",
           "Knobs", "MomentumKnobs", "PartialKnobs", "OUTER_FORMATS", "PowerSGDKnobs",
           "RandomKnobs", "ScheduleKnobs", "StepKnobs", "StreamingDiLoCoKnobs", "StridingKnobs",
           "TopKKnobs",
           "check_ada_thresholds",
           "REDUCE_FORMATS", "SPARSE_FORMATS", "ReduceKnobs", "SparseLoCoKnobs",
           "check_base", "check_dct_chunk", "check_value_format"]

# The wire formats of flexdemo.formats (which owns their encodings), listed here so that they
# are checked without torch.
VALUE_FORMATS = ("fp32", "bf16", "fp32-packed", "bf16-packed", "int8", "int2", "sign")
VALUE_DTYPES = ("bf16", "fp32")
# How DeMo's replicas exchange their top-k (replicators/demo.py): all-gather the sparse buckets,
# all-reduce the dense coefficient vector in bf16, or the one of the two moving fewer bytes.
EXCHANGES = ("allgather", "dense", "dense-mean", "auto")
# How DeMo computes its step: its own batched kernels, or the reference package's operations in
# the package's order (replicators/blocks.py, replicators/reference_blocks.py).
ARITHMETICS = ("fast", "reference")
# Streaming DiLoCo's wire formats of a fragment's pseudo-gradient (replicators/outer_wire.py).
OUTER_FORMATS = ("fp32", "bf16", "int8", "4bit")
# How streaming-diloco cuts its fragments: whole parameters (torchft) or equal element runs.
FRAGMENT_CUTS = ("parameters", "elements")
BASES = ("sign", "adamw")

# The largest DCT chunk side. A side-n chunk needs an n x n basis, built in float64 beside a few
# temporaries of that size and then cached for each dtype and device: at 4096 that is 128 MiB a
# float64 matrix and 64 MiB kept in float32, and every coefficient costs n multiply-adds per
# dimension, so a wider side costs more memory and compute than the exchange it compresses saves
# (DeMo uses 64). A parameter with a longer dimension would otherwise meet the bigger basis only
# at its first step, as an allocation failure.
MAX_DCT_CHUNK = 4096

# value_dtype names a float by its short name or as torch prints a dtype, so the torch-free
# check also takes the reference call's torch.float32 / torch.bfloat16.
_FLOAT_NAMES = {"bf16": "bf16", "fp32": "fp32", "torch.bfloat16": "bf16", "torch.float32": "fp32"}


def check_value_format(value_format: object) -> None:
    """Raise ValueError (one sentence) unless ``value_format`` is one of ``VALUE_FORMATS``."""
    check(value_format in VALUE_FORMATS,
          f"value_format={value_format!r} is unknown; use one of {', '.join(VALUE_FORMATS)}.")


def check_base(base: object) -> None:
    """Raise ValueError (one sentence) unless ``base`` is one of ``BASES``."""
    check(base in BASES, f"base={base!r} is unknown; use one of {', '.join(BASES)}.")


def check_dct_chunk(name: str, chunk: object) -> None:
    """Raise ValueError (one sentence) unless ``chunk`` is an integer from 1 to MAX_DCT_CHUNK."""
    ok = isinstance(chunk, int) and not isinstance(chunk, bool) and 1 <= chunk <= MAX_DCT_CHUNK
    check(ok, f"{name}={chunk!r} must be an integer from 1 to {MAX_DCT_CHUNK}: a DCT chunk of "
              f"side n builds an n x n basis matrix, {MAX_DCT_CHUNK * MAX_DCT_CHUNK * 4 // 2**20} "
              f"MiB in float32 at {MAX_DCT_CHUNK}.")


def check_ada_thresholds(high: object, low: object) -> None:
    """Raise ValueError (one sentence) unless ``0 <= low < high`` are finite numbers."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  for v in (high, low))
    check(numbers and 0 <= low < high,  # type: ignore[operator]
          f"ada_low={low!r} and ada_high={high!r} must be finite numbers with "
          "0 <= ada_low < ada_high.")


def _with_float(value_format: str, dtype: str) -> str:
    """``value_format`` with its float (bf16 or fp32) replaced by ``dtype``; others unchanged."""
    head, sep, tail = value_format.partition("-")
    return dtype + sep + tail if head in VALUE_DTYPES else value_format


@dataclass(frozen=True)
class Knobs:
    """No knobs (a replicator without any); subclasses add fields and extend :meth:`check`."""

    # Names a schema also answers to (name -> what it means), which with_given() turns into
    # its fields.
    aliases: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError (one sentence) on the first bad knob."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The knobs this schema reads: its fields, then its aliases."""
        return tuple(f.name for f in dataclasses.fields(cls)) + tuple(cls.aliases)

    def with_given(self, given: Mapping[str, Any]) -> Knobs:
        """A checked copy with the ``given`` knobs replaced; None means "keep the default"."""
        given = {k: v for k, v in given.items() if v is not None}
        unknown = [k for k in given if k not in self.names()]
        if unknown:
            raise ValueError(f"{type(self).__name__} has no knob {unknown[0]!r}; it takes "
                             f"{', '.join(self.names()) or 'none'}.")
        return dataclasses.replace(self, **given) if given else self

    def problem(self, nodes: int) -> str | None:
        """One sentence saying why these knobs cannot run on ``nodes`` nodes, or None."""
        return None


@dataclass(frozen=True)
class StepKnobs(Knobs):
    """FlexDeMo's own knobs: how a replica applies the update its replicator hands back."""

    base: str | None = None
    """Base step: sign (SGD) or adamw; None: the method's (adamw for flexdemo-adamw, diloco,
    gossip and ada, sign for the others)."""
    sign: bool | None = None
    """Take sign() of the update before the base step; None: the method's (yes for the DeMo
    family but flexdemo-adamw, random, striding and none)."""
    beta1: float | None = None
    """The adamw base's first-moment decay, in [0, 1); None: 0.9, AdamW's. 0 steps on each
    update alone, normalized by AdamW's second moment (a DeMo replicator keeps its own
    momentum). Refused with the sign base."""

    def check(self) -> None:
        """The base is a known one; sign is a bool; beta1 lies in [0, 1), not with base sign."""
        if self.base is not None:
            check_base(self.base)
        check(self.sign is None or isinstance(self.sign, bool),
              f"sign={self.sign!r} must be true or false.")
        if self.beta1 is not None:
            in_unit_interval("beta1", self.beta1, closed_low=True, closed_high=False)
            check(self.base != "sign", f"beta1={self.beta1!r} is the adamw base's; the sign "
                                       "base keeps no moments (give base adamw or no beta1).")


@dataclass(frozen=True)
class EveryKnobs(Knobs):
    """A replicator that replicates every k-th step."""

    replicate_every: int = 1
    """Replicate only on steps divisible by this."""

    def check(self) -> None:
        """``replicate_every`` is a positive integer."""
        super().check()
        int_at_least("replicate_every", self.replicate_every, 1)


@dataclass(frozen=True)
class ScheduleKnobs(EveryKnobs):
    """A replicator that replicates every k-th step and skips every m-th."""

    skip_every: int | None = None
    """And never on steps divisible by this (None: skip none)."""

    def check(self) -> None:
        """``skip_every`` is None or a positive integer."""
        super().check()
        ok = self.skip_every is None or (isinstance(self.skip_every, int)
                                         and not isinstance(self.skip_every, bool)
                                         and self.skip_every >= 1)
        check(ok, f"skip_every={self.skip_every!r} must be None or an integer >= 1.")


@dataclass(frozen=True)
class MomentumKnobs(ScheduleKnobs):
    """A replicator that sends part of a decaying momentum (DeMo, random, striding)."""

    decay: float = 0.999
    """Decay of the momentum the replicator sends from, in [0, 1)."""
    fold_skipped: bool = False
    """Fold an off-schedule step's gradient into the momentum as well, so it is sent again
    later (the reference implementation leaves it alone, as the default does)."""

    def check(self) -> None:
        """``decay`` lies in [0, 1); ``fold_skipped`` is a bool."""
        super().check()
        in_unit_interval("decay", self.decay, closed_low=True, closed_high=False)
        check(isinstance(self.fold_skipped, bool),
              f"fold_skipped={self.fold_skipped!r} must be true or false.")


@dataclass(frozen=True)
class DeMoKnobs(MomentumKnobs):
    """:class:`~flexdemo.replicators.DeMoReplicator`'s knobs (DeMo's own setting by default)."""

    topk: int = 32
    """DCT coefficients kept per chunk (block chunking clamps it to a block's elements)."""
    chunk: int = 64
    """DCT chunk side: each dimension (block) or the flat shard (flat) uses its largest divisor
    not above this."""
    chunking: str = "block"
    """block (2-D DCT blocks of each shard as a matrix) or flat (1-D chunks of the flat shard, as
    the reference on FSDP1)."""
    value_format: str = "bf16"
    """Wire format of the coefficients: fp32, bf16 (16-bit indices), fp32-packed, bf16-packed
    (bit-packed indices), int8, int2 or sign (quantized, with a per-chunk scale)."""
    delay: int = 0
    """Replicating steps between posting an exchange and applying it: 0 (the same step) or 1
    (apply the previous one's while this one's all-gather is in flight; the first applies
    nothing)."""
    lookahead: bool = False
    """With delay 1: step on this replica's own top-k at once and, one step later, swap it for
    the replicas' mean, so a gradient never misses the last step (needs the sign step)."""

    exchange: str = "allgather"
    """How the replicas exchange their top-k: allgather (every replica's sparse bucket, so a
    rank receives (N-1) x its bucket); dense (each rank scatters the values it sends into its
    shard's dense coefficient vector and the N replicas all-reduce it in bf16, a sum divided by
    N: 2(N-1)/N x the dense bytes at any N; a coefficient a replica did not send counts as its
    zero); dense-mean (the same with a count of senders per coefficient in the same bf16
    all-reduce, twice the bytes, each sum divided by its count: DeMo's mean over the senders);
    or auto (dense-mean where 2 x its bytes < N x bucket bytes, i.e. where a ring all-reduce,
    2(N-1)/N x dense, moves fewer bytes than the all-gather, (N-1) x bucket, else allgather;
    ties go to allgather; decided once at setup from N and the sizes, which every replica
    computes alike, so no communication)."""
    arithmetic: str | None = None
    """How the step is computed: fast (momentum kept in the DCT domain, one batched transform
    per block shape, a two-stage top-k) or reference (DeToNATION 0.5.2's operations in its
    order: momentum in parameter space, FFT-built bases, one transform per tensor; with fp32
    values the package's step bit for bit, at about twice fast's CPU time). The two agree to
    float rounding, which the sign step amplifies: their trajectories part within a few steps.
    Not given: reference with value_format fp32 (the exact mode), fast with the others."""

    aliases: ClassVar[dict[str, str]] = {
        "value_dtype": "Alias kept for value_format: bf16 or fp32, the float of the method's "
                       "default value_format (bf16 <-> fp32, bf16-packed <-> fp32-packed); a "
                       "value_format given as well wins.",
    }

    def check(self) -> None:
        """Positive topk, a chunk whose basis fits, a known chunking, format, exchange and
        arithmetic, topk <= chunk when flat, a delay of 0 or 1, and lookahead only with delay 1."""
        super().check()
        int_at_least("topk", self.topk, 1)
        check_dct_chunk("chunk", self.chunk)
        check(self.chunking in CHUNKINGS,
              f"chunking={self.chunking!r} is unknown; use one of {', '.join(CHUNKINGS)}.")
        check_value_format(self.value_format)
        ok = isinstance(self.delay, int) and not isinstance(self.delay, bool)
        check(ok and self.delay in (0, 1),
              f"delay={self.delay!r} must be 0 (apply each exchange in its own step) or 1 "
              "(apply it one replicating step later).")
        check(isinstance(self.lookahead, bool),
              f"lookahead={self.lookahead!r} must be true or false.")
        check(not self.lookahead or self.delay == 1,
              f"lookahead=true needs delay=1 (it corrects a delayed exchange), got "
              f"delay={self.delay!r}.")
        check(self.exchange in EXCHANGES,
              f"exchange={self.exchange!r} is unknown; use one of {', '.join(EXCHANGES)}.")
        check(self.arithmetic is None or self.arithmetic in ARITHMETICS,
              f"arithmetic={self.arithmetic!r} is unknown; use one of {', '.join(ARITHMETICS)} "
              "(or none: reference with value_format fp32, else fast).")
        check(self.chunking != "flat" or self.topk <= self.chunk,
              f"topk={self.topk} is larger than a flat chunk of chunk={self.chunk} elements; "
              f"use topk <= {self.chunk} or chunking='block'.")

    @property
    def arithmetic_used(self) -> str:
        """The arithmetic the step runs: ``arithmetic``, or by default reference with the fp32
        value format (the package's wire: the exact mode) and fast with the others."""
        if self.arithmetic is not None:
            return self.arithmetic
        return "reference" if self.value_format == "fp32" else "fast"

    def with_given(self, given: Mapping[str, Any]) -> Knobs:
        """As :meth:`Knobs.with_given`, with ``value_dtype`` turned into the value format."""
        given = dict(given)
        dtype = given.pop("value_dtype", None)
        if dtype is not None:
            name = _FLOAT_NAMES.get(str(dtype))
            check(name is not None, f"value_dtype={dtype!r} is unknown; use one of "
                                    f"{', '.join(VALUE_DTYPES)}.")
            if given.get("value_format") is None:
                given["value_format"] = _with_float(self.value_format, name)
        return super().with_given(given)


@dataclass(frozen=True)
class PartialKnobs(MomentumKnobs):
    """A replicator that averages a fraction of the momentum's rows or chunks."""

    rate: float = 0.1
    """Fraction of the momentum's rows (random) or chunks (striding) sent each step, in (0, 1]."""

    def check(self) -> None:
        """``rate`` lies in (0, 1]."""
        super().check()
        in_unit_interval("rate", self.rate, closed_low=False, closed_high=True)


@dataclass(frozen=True)
class RandomKnobs(PartialKnobs):
    """:class:`~flexdemo.replicators.RandomReplicator`'s knobs."""

    seed: int = 42
    """Seed of the row draws, the same on every replica (a run hands in its own seed)."""


@dataclass(frozen=True)
class StridingKnobs(PartialKnobs):
    """:class:`~flexdemo.replicators.StridingReplicator`'s knobs."""

    chunk: int = 64
    """Chunks each tensor's momentum is cut into (the largest divisor of its size not above
    this)."""

    def check(self) -> None:
        """``chunk`` is a positive integer."""
        super().check()
        int_at_least("chunk", self.chunk, 1)


@dataclass(frozen=True)
class DiLoCoKnobs(Knobs):
    """:class:`~flexdemo.replicators.DiLoCoReplicator`'s knobs."""

    diloco_h: int = 50
    """Inner steps between synchronizations (DiLoCo's H)."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov SGD step."""
    outer_momentum: float = 0.9
    """Momentum of the outer Nesterov SGD step, in [0, 1) (0: plain SGD, no Nesterov)."""
    outer_format: str = "fp32"
    """Wire format of the pseudo-gradient: fp32 or bf16 (all-reduced), int8 or 4bit
    (all-gathered codes with one fp32 scale); what rounding loses is carried to the next sync
    (error feedback)."""

    def check(self) -> None:
        """Positive ``diloco_h`` and ``outer_lr``; ``outer_momentum`` in [0, 1); a known
        format."""
        int_at_least("diloco_h", self.diloco_h, 1)
        _check_outer_step(self.outer_lr, self.outer_momentum)
        _check_outer_format(self.outer_format)


def _check_outer_step(lr: object, momentum: object) -> None:
    """The outer Nesterov SGD's learning rate is a number > 0 and its momentum lies in [0, 1)."""
    check(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0,
          f"outer_lr={lr!r} must be a number > 0.")
    in_unit_interval("outer_momentum", momentum, closed_low=True, closed_high=False)


def _check_outer_format(outer_format: object) -> None:
    """The pseudo-gradient's wire format is one of ``OUTER_FORMATS``."""
    check(outer_format in OUTER_FORMATS,
          f"outer_format={outer_format!r} is unknown; use one of {', '.join(OUTER_FORMATS)}.")


@dataclass(frozen=True)
class StreamingDiLoCoKnobs(Knobs):
    """:class:`~flexdemo.replicators.StreamingDiLoCoReplicator`'s knobs (torchft's names)."""

    sync_every: int = 50
    """Inner steps between two syncs of one fragment (DiLoCo's H); a multiple of num_fragments,
    since one fragment syncs every sync_every / num_fragments steps."""
    num_fragments: int = 2
    """Fragments the parameter list is cut into (contiguous runs of whole parameters), each
    synchronized on its own staggered step with its own outer optimizer."""
    fragment_sync_delay: int = 1
    """Inner steps between posting a fragment's all-reduce and applying it (Streaming DiLoCo's
    tau), below sync_every / num_fragments; 0 applies it in the step that posts it."""
    fragment_update_alpha: float = 0.0
    """Weight of the local parameters when a sync lands, in [0, 1]: a fragment becomes
    alpha * local + (1 - alpha) * synced (0: the synced ones, as DiLoCo)."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov SGD step."""
    outer_momentum: float = 0.9
    """Momentum of the outer Nesterov SGD step, in [0, 1) (0: plain SGD, no Nesterov)."""
    outer_format: str = "fp32"
    """Wire format of a fragment's pseudo-gradient: fp32 or bf16 (all-reduced), int8 or 4bit
    (all-gathered codes with one fp32 scale per fragment); what rounding loses is carried
    to that fragment's next sync (error feedback)."""
    fragment_cut: str = "parameters"
    """How the fragments are cut: "parameters" (contiguous runs of whole parameters, as
    torchft) or "elements" (equal runs of the rank's flattened parameters, a parameter split
    between two fragments where the cut falls, so every sync sends the same bytes to within
    one element)."""
    fragment_runs: int = 1
    """Runs each fragment is made of (fragment_cut="elements" only): the flattened parameters
    are cut into num_fragments * fragment_runs equal runs and run r belongs to fragment
    r % num_fragments, so a fragment's runs are strided over the model's depth (Streaming
    DiLoCo's strided fragments); 1: one contiguous run a fragment."""

    def check(self) -> None:
        """Positive ``sync_every`` and ``num_fragments``, the one dividing the other; a delay
        below the fragment period; alpha in [0, 1]; the outer step; a known format and cut;
        runs a fragment only with the element cut."""
        int_at_least("sync_every", self.sync_every, 1)
        int_at_least("num_fragments", self.num_fragments, 1)
        check(self.sync_every % self.num_fragments == 0,
              f"sync_every={self.sync_every} must be a multiple of "
              f"num_fragments={self.num_fragments}, since one fragment syncs every "
              "sync_every / num_fragments steps.")
        int_at_least("fragment_sync_delay", self.fragment_sync_delay, 0)
        period = self.sync_every // self.num_fragments
        check(self.fragment_sync_delay < period,
              f"fragment_sync_delay={self.fragment_sync_delay} must be below sync_every / "
              f"num_fragments = {period}, so that a sync lands before the next one is posted.")
        in_unit_interval("fragment_update_alpha", self.fragment_update_alpha, closed_low=True,
                         closed_high=True)
        _check_outer_step(self.outer_lr, self.outer_momentum)
        _check_outer_format(self.outer_format)
        check(self.fragment_cut in FRAGMENT_CUTS,
              f"fragment_cut={self.fragment_cut!r} is unknown; use one of "
              f"{', '.join(FRAGMENT_CUTS)}.")
        int_at_least("fragment_runs", self.fragment_runs, 1)
        check(self.fragment_runs == 1 or self.fragment_cut == "elements",
              f"fragment_runs={self.fragment_runs} strides equal runs of elements, so it needs "
              f"fragment_cut='elements' (not {self.fragment_cut!r}).")


@dataclass(frozen=True)
class GossipKnobs(EveryKnobs):
    """:class:`~flexdemo.replicators.GossipReplicator`'s knobs."""

    graph: str = "ring"
    """Communication graph: ring, torus, exponential, one-peer-exponential, complete, or
    sites:S (S sites of consecutive nodes, exponential inside, a ring of gateways across)."""

    def check(self) -> None:
        """``graph`` is a known graph."""
        super().check()
        problem = graph_name_problem(self.graph)
        if problem is not None:
            raise ValueError(problem)

    def problem(self, nodes: int) -> str | None:
        """Why the graph cannot be built on ``nodes`` nodes, or None."""
        return graph_problem(self.graph, nodes)


@dataclass(frozen=True)
class AdaKnobs(EveryKnobs):
    """:class:`~flexdemo.replicators.AdaReplicator`'s knobs (the rule: ``replicators/ada.py``)."""

    # From lm-tiny, 4 nodes x 1, constant lr 1e-3 (benchmarks/bench_ada.py spread):
    # before mixing the complete graph reads 2.4e-3 early to 4.3e-3 late, ring 3.6e-3 to 7.3e-3.
    # The band is a factor-2 budget around the exact average's ~4e-3: above 1.5x of it, buy
    # edges; below ~0.75x, the replicas agree well enough to save some. The spread scales with
    # the lr (a local step moves each replica by about lr per entry): other settings re-tune both.
    ada_every: int = 10
    """Gossip rounds between two measurements of the replica spread (the graph changes at most
    this often)."""
    ada_high: float = 6e-3
    """Relative consensus distance above which the graph moves one rung denser."""
    ada_low: float = 3e-3
    """Relative consensus distance below which the graph moves one rung sparser."""
    ada_sample: int = 4096
    """Entries of each rank's shard the spread is measured on."""
    seed: int = 0
    """Seed of the sampled entries, the same on every replica (a run hands in its own seed)."""

    def check(self) -> None:
        """Positive ``ada_every`` and ``ada_sample``; ``0 <= ada_low < ada_high``."""
        super().check()
        int_at_least("ada_every", self.ada_every, 1)
        check_ada_thresholds(self.ada_high, self.ada_low)
        int_at_least("ada_sample", self.ada_sample, 1)

    def problem(self, nodes: int) -> str | None:
        """Ada needs a ladder of graphs: at least two nodes."""
        if graph_ladder(nodes):
            return None
        return (f"ada needs at least 2 nodes to gossip between, got nodes={nodes}; "
                "use nodes >= 2.")


@dataclass(frozen=True)
class PowerSGDKnobs(Knobs):
    """:class:`~flexdemo.replicators.PowerSGDReplicator`'s knobs (PyTorch's ``PowerSGDState``)."""

    # Rank 4 is the paper's setting for its language model (an LSTM on WikiText-2; rank 2 for
    # its ResNet-18 on CIFAR-10); PyTorch's hook defaults to 1. PyTorch's start_powerSGD_iter
    # defaults to 1000 and its docs suggest about 10% of the steps: 10 of the standard 100.
    powersgd_rank: int = 4
    """Rank r of PowerSGD's low-rank factors (PyTorch's matrix_approximation_rank); a matrix
    with fewer rows or columns uses that many."""
    powersgd_start: int = 10
    """Steps all-reduced whole before compression starts (PyTorch's start_powerSGD_iter)."""
    min_compression_rate: float = 2.0
    """A matrix is compressed only where (n + m) * r * this < n * m, as PyTorch's hook decides;
    >= 1, so a 1-D tensor is always all-reduced whole."""
    error_feedback: bool = True
    """Add what compression left out of a compressed tensor to its next gradient."""
    warm_start: bool = True
    """Start each step's power iteration from the last step's Q (false: fresh random Qs every
    step)."""
    seed: int = 0
    """Seed of the random Qs, drawn as PyTorch's hook draws them from its random_seed (a run
    hands in its own seed)."""

    def check(self) -> None:
        """A positive integer rank, a start >= 0, a compression rate >= 1, two bools, a seed."""
        int_at_least("powersgd_rank", self.powersgd_rank, 1)
        int_at_least("powersgd_start", self.powersgd_start, 0)
        rate = self.min_compression_rate
        ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate)
        check(ok and rate >= 1, f"min_compression_rate={rate!r} must be a finite number >= 1 "
                                "(the compressed size at most the tensor's).")
        for name in ("error_feedback", "warm_start"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name}={value!r} must be true or false.")
        ok = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        check(ok and 0 <= self.seed < 2**32,
              f"seed={self.seed!r} must be an integer from 0 to {2**32 - 1}.")


@dataclass(frozen=True)
class TopKKnobs(Knobs):
    """:class:`~flexdemo.replicators.TopKReplicator`'s knobs (Deep Gradient Compression's)."""

    density: float = 0.01
    """Fraction of each shard's entries sent per step, in (0, 1]: k = ceil(density * numel)."""
    decay: float = 0.9
    """Momentum factor m of DGC's momentum correction u <- m * u + g, in [0, 1); 0 sends the
    top-k of the accumulated gradients alone (Stich et al.'s memory)."""
    value_format: str = "fp32-packed"
    """Wire format of the values sent (indices bit-packed in the packed and quantized formats):
    fp32, bf16, fp32-packed, bf16-packed, int8, int2 or sign (one scale per tensor)."""

    def check(self) -> None:
        """A density in (0, 1], a momentum in [0, 1), a known value format."""
        in_unit_interval("density", self.density, closed_low=False, closed_high=True)
        in_unit_interval("decay", self.decay, closed_low=True, closed_high=False)
        check_value_format(self.value_format)
# -- SparseLoCo and hsdp-adamw's low-precision reduction --------------------------------------
# SparseLoCo's wire formats of the values it keeps (replicators/sparseloco.py): the paper's
# 2-bit statistical codes, or the values themselves in bf16 or fp32.
SPARSE_FORMATS = ("2bit", "bf16", "fp32")
# hsdp-adamw's inter-node gradient reduction (replicators/reduce.py): fp32 is FSDP2's own
# all-reduce; bf16 an all-reduce in bf16; fp8 and int8 rows scaled as torchft's quantized one.
REDUCE_FORMATS = ("fp32", "bf16", "fp8", "int8")


@dataclass(frozen=True)
class SparseLoCoKnobs(Knobs):
    """:class:`~flexdemo.replicators.SparseLoCoReplicator`'s knobs (the defaults: the public
    code's 512M setting of SparseLoCo, arXiv:2508.15706)."""

    diloco_h: int = 15
    """Inner steps between synchronizations (DiLoCo's H)."""
    outer_lr: float = 1.0
    """Learning rate of SparseLoCo's outer step: plain SGD on the replicas' mean sparse update,
    no momentum (the error feedback stands in for it)."""
    topk: int = 128
    """Largest entries of the error-feedback buffer sent per chunk of chunk elements (a chunk
    shorter than chunk keeps its share, topk x its length / chunk, at least 1)."""
    chunk: int = 4096
    """Elements per chunk of each shard's flattened error-feedback buffer (topk / chunk is the
    density; the last chunk of a shard is padded with zeros)."""
    error_decay: float = 0.95
    """Decay of the error-feedback buffer at each sync (SparseLoCo's beta), in [0, 1]."""
    value_format: str = "2bit"
    """Wire format of the kept values: 2bit (the paper's statistical 2-bit codes, one mean and
    four bin means per tensor), bf16 or fp32."""

    def check(self) -> None:
        """Positive ``diloco_h``, ``outer_lr``, ``topk`` and ``chunk`` with ``topk <= chunk``;
        ``error_decay`` in [0, 1]; a known value format."""
        int_at_least("diloco_h", self.diloco_h, 1)
        check(isinstance(self.outer_lr, (int, float)) and not isinstance(self.outer_lr, bool)
              and self.outer_lr > 0, f"outer_lr={self.outer_lr!r} must be a number > 0.")
        int_at_least("topk", self.topk, 1)
        int_at_least("chunk", self.chunk, 1)
        check(self.topk <= self.chunk,
              f"topk={self.topk} is more than chunk={self.chunk}: sparseloco keeps topk of "
              f"every chunk, a density topk/chunk in (0, 1]; use topk <= {self.chunk}.")
        in_unit_interval("error_decay", self.error_decay, closed_low=True, closed_high=True)
        check(self.value_format in SPARSE_FORMATS,
              f"value_format={self.value_format!r} is unknown for sparseloco; use one of "
              f"{', '.join(SPARSE_FORMATS)}.")


@dataclass(frozen=True)
class ReduceKnobs(Knobs):
    """hsdp-adamw's knob: the format of its inter-node gradient reduction
    (:class:`~flexdemo.replicators.ReduceReplicator` where it is not FSDP2's own)."""

    reduce_format: str = "fp32"
    """Format of the inter-node gradient all-reduce: fp32 (FSDP2's own), bf16, or fp8 and int8
    rows with one fp32 scale each, reduced as torchft's quantized all-reduce (all-to-all, sum
    in fp32, all-gather)."""

    def check(self) -> None:
        """A known reduce format."""
        check(self.reduce_format in REDUCE_FORMATS,
              f"reduce_format={self.reduce_format!r} is unknown; use one of "
              f"{', '.join(REDUCE_FORMATS)}.")
