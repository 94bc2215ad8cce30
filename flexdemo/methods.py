"""The training methods as records: one :class:`Method` each, the one place a method's facts live.

A record holds the method's replicator (by its ``REPLICATORS`` name), the knobs it reads with
this method's defaults (an instance of that replicator's schema, :mod:`flexdemo.knobs`), its
default learning rate and how it is wired: whether FSDP2 shards the model, keeps its inter-node
all-reduce, and whether the method gossips or adapts its graph. Everything that asks "which
methods ..." asks the records; :func:`flexdemo.build_optimizer` turns one into an optimizer.

A user's method is the same record, its replicator the class itself, returned by a factory of
their own module and asked for as ``module.path:factory`` (:mod:`flexdemo.plugins`).

Torch-free, so that run settings are checked without torch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._checks import check
from .knobs import (
    AdaKnobs,
    DeMoKnobs,
    DiLoCoKnobs,
    GossipKnobs,
    Knobs,
    PowerSGDKnobs,
    RandomKnobs,
    ReduceKnobs,
    SparseLoCoKnobs,
    StepKnobs,
    StreamingDiLoCoKnobs,
    StridingKnobs,
    TopKKnobs,
)
from .plugins import call_factory, check_record, is_plugin

__all__ = ["BASELINE", "FLEXDEMO_KNOBS", "METHODS", "RECORDS", "WIRED", "Method", "method_record"]

# Knobs a run sets from its own settings rather than per method (the run's seed).
WIRED = ("seed",)


@dataclass(frozen=True)
class Method:
    """One training method: its replicator, the knobs it reads (with defaults), lr and wiring."""

    name: str
    replicator: str | type | None
    """The replicator: its class (a ``Replicator`` subclass, a plug-in's own), or its name in
    ``flexdemo.replicators.REPLICATORS``; None: plain AdamW, with FSDP2's all-reduce averaging
    the gradients across nodes."""
    knobs: Knobs = field(default_factory=Knobs)
    """The replicator's knobs (its ``knobs_type``) at this method's defaults."""
    lr: float = 1e-3
    """Default learning rate."""
    shards: bool = True
    """FSDP2 shards the model inside a node (:func:`flexdemo.parallelize`); False: every rank
    holds the whole model and is a replica."""
    inter_all_reduce: bool = False
    """FSDP2's inter-node gradient all-reduce stays on."""
    takes_sign: bool = True
    """The ``sign`` knob applies (False where the local step is plain AdamW)."""
    gossips: bool = False
    """Its traffic is messages to the neighbours of a communication graph."""
    adapts: bool = False
    """It picks its own graph from the replica spread it measures."""
    step: StepKnobs = field(default_factory=StepKnobs)
    """This method's own defaults of FlexDeMo's base step and sign (None: the replicator's);
    a run's ``base`` and ``sign`` still win."""

    @property
    def replicator_type(self) -> type | None:
        """The replicator's class (None: plain AdamW); a name is looked up, importing torch."""
        if self.replicator is None or isinstance(self.replicator, type):
            return self.replicator
        from .replicators import REPLICATORS

        return REPLICATORS[self.replicator]

    @property
    def takes(self) -> tuple[str, ...]:
        """The knobs this method reads, by their run-setting names (plain AdamW: no step
        knobs, FlexDeMo's base step is not its step)."""
        own = tuple(n for n in self.knobs.names() if n not in WIRED)
        if self.replicator is None:
            return own
        return own + tuple(n for n in StepKnobs.names() if n != "sign" or self.takes_sign)

    def settings(self, given: Mapping[str, Any],
                 **wired: Any) -> tuple[Knobs, StepKnobs]:
        """The replicator's knobs and FlexDeMo's, ``given`` over this method's defaults.

        None in ``given`` means "the default". ``wired`` (the run's ``seed``) applies where the
        replicator reads it. ValueError (one sentence) on a knob this method does not read or a
        bad value.
        """
        given = {k: v for k, v in given.items() if v is not None}
        extra = sorted(k for k in given if k not in self.takes)
        check(not extra, f"method {self.name!r} does not read {', '.join(extra)}; it takes "
                         f"{', '.join(self.takes) or 'no knobs'}.")
        step = self.step.with_given({k: given.pop(k) for k in StepKnobs.names() if k in given})
        names = self.knobs.names()
        given.update({k: v for k, v in wired.items() if k in names and v is not None})
        return self.knobs.with_given(given), step  # type: ignore[return-value]

    def settings_on(self, given: Mapping[str, Any], nodes: int,
                    **wired: Any) -> tuple[Knobs, StepKnobs]:
        """:meth:`settings`, refused (ValueError, one sentence) where the knobs cannot run
        between ``nodes`` nodes (replicas): a gossip graph needs enough of them, Ada two.

        The one check of a method at a shape: a run asks it at its nodes, a plan at its
        replicas."""
        knobs, step = self.settings(given, **wired)
        problem = knobs.problem(nodes)
        check(problem is None, str(problem))
        return knobs, step

    def wired(self, given: Mapping[str, Any]) -> Method:
        """This record as the knobs ``given`` wire it: itself, but for plain AdamW with a
        ``reduce_format`` other than fp32, whose inter-node gradient mean the ``reduce``
        replicator then takes from FSDP2 (under FlexDeMo's AdamW step). ValueError as
        :meth:`settings`."""
        knobs, _ = self.settings(given)
        if self.replicator is None and getattr(knobs, "reduce_format", "fp32") != "fp32":
            return dataclasses.replace(self, replicator="reduce", inter_all_reduce=False)
        return self

    def resolved(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every knob this method reads with its value: as given, else this method's default."""
        knobs, step = self.settings(given)
        values = {**dataclasses.asdict(knobs), **dataclasses.asdict(step)}
        if isinstance(knobs, DeMoKnobs):  # recorded as the arithmetic the run computes in
            values["arithmetic"] = knobs.arithmetic_used
        # An alias (value_dtype) has no value of its own: it stays as given.
        return {name: values.get(name, given.get(name)) for name in self.takes}


# FlexDeMo's defaults come from the frontier sweep (results/frontier/README.md):
# the paper's 1-D chunks of 64 elements with the top 4 kept reached the target first at
# 100 Mbit/s; its indices are bit-packed (6 bits instead of 16: lossless, 31% fewer bytes).
# Its momentum keeps DeMo's decay 0.999. On lm-tiny 2 x 2, decay 0.9 reached the quick sweep's
# target in 60 and 70 steps where 0.999 took 70 and 90, and in fewer steps on five seeds
# (results/decay/README.md); it stays a variant (`--decay 0.9`, the quick sweep's
# flexdemo[decay=0.9]), not the default: the best decay depends on the workload and the step
# count, and the committed sweeps, made at 0.999, stay reproducible from their configs.
FLEXDEMO_KNOBS = DeMoKnobs(topk=4, chunking="flat", value_format="bf16-packed")

RECORDS: tuple[Method, ...] = (
    # demo keeps DeMo's original setting: 64 x 64 blocks, top 32, 16-bit indices, decay 0.999.
    Method("flexdemo", "demo", FLEXDEMO_KNOBS),
    # FlexDeMo with its exchange overlapped with the next step's compute: each step steps on
    # its own top-k at once and swaps it for the replicas' mean once that has arrived, a step
    # later (the rules live in replicators/demo.py). Without the look-ahead (applying
    # only the previous step's mean) lm-tiny ended 16% above flexdemo; with it, 3%.
    Method("flexdemo-async", "demo", dataclasses.replace(FLEXDEMO_KNOBS, delay=1, lookahead=True)),
    # FlexDeMo under an AdamW step (DeToNATION's DeToAdamW, which takes the sign first by
    # default; this one does not): the decoded mean of the replicas' momenta is AdamW's
    # gradient (the lr rule: flexdemo/bases.py, AdamWBase). Its lr 1e-3 is AdamW's usual
    # default; on lm-tiny no lr, sign, beta1, decay or schedule tried reached the quick sweep's
    # target on both seeds (results/tuning/README.md).
    Method("flexdemo-adamw", "demo", FLEXDEMO_KNOBS, step=StepKnobs(base="adamw", sign=False)),
    Method("demo", "demo", DeMoKnobs(), shards=False),
    # reduce_format other than fp32: the inter-node mean in bf16, fp8 or int8 rows (torchft's
    # quantized all-reduce), by the reduce replicator; fp32 is FSDP2's own (Method.wired).
    Method("hsdp-adamw", None, ReduceKnobs(), inter_all_reduce=True),
    Method("diloco", "diloco", DiLoCoKnobs(), takes_sign=False),
    # DiLoCo per fragment, staggered, each sync overlapped with tau inner steps (torchft's
    # Streaming DiLoCo; the rules live in replicators/streaming_diloco.py).
    Method("streaming-diloco", "streaming-diloco", StreamingDiLoCoKnobs(), takes_sign=False),
    Method("random", "random", RandomKnobs()),
    Method("striding", "striding", StridingKnobs()),
    Method("none", "none"),
    # Gossip's and Ada's local step is plain AdamW, as DiLoCo's inner one.
    Method("gossip", "gossip", GossipKnobs(), takes_sign=False, gossips=True),
    Method("ada", "ada", AdaKnobs(), takes_sign=False, gossips=True, adapts=True),
    # HSDP with its inter-node all-reduce replaced by PowerSGD's low-rank factors; AdamW on the
    # mean it approximates, as hsdp-adamw on the exact one (replicators/powersgd.py).
    Method("powersgd", "powersgd", PowerSGDKnobs(), takes_sign=False),
    # Deep Gradient Compression: top-k of a momentum-corrected velocity, all-gathered, SGD step
    # (replicators/topk.py). Its step is SGD, whose lr is not AdamW's: on lm-tiny 2 x 2, 100
    # steps, seed 0, lr 0.03, 0.06 and 0.1 ended at val_loss 2.944, 2.913 and 3.070 (1.0
    # diverged by step 9).
    Method("topk-ef", "topk", TopKKnobs(), lr=0.06, takes_sign=False),
    # -- local-sgd and sparseloco ---------------------------------------------------------
    # Local SGD / FedAvg: averaging the parameters every H steps is applying the replicas'
    # mean pseudo-gradient with an outer SGD of lr 1 and no momentum: diloco's record with
    # those defaults (the inner step stays AdamW; base sign without sign is plain SGD).
    Method("local-sgd", "diloco", DiLoCoKnobs(outer_lr=1.0, outer_momentum=0.0),
           takes_sign=False),
    # SparseLoCo: diloco's inner AdamW, a chunked top-k of an error-feedback buffer in 2 bits,
    # plain SGD outside (the rules live in replicators/sparseloco.py).
    Method("sparseloco", "sparseloco", SparseLoCoKnobs(), takes_sign=False),
)
# Learning rates: tuned on lm-tiny, 2 nodes x 2, 300 steps, constant lr (docs/methods.md, "Learning
# rates"): hsdp-adamw and flexdemo both degrade sharply above about 1.2e-3; the others keep 1e-3
# untuned (gossip and ada: the AdamW base of hsdp-adamw at its default).

METHODS: tuple[str, ...] = tuple(m.name for m in RECORDS)
"""The method names, in the order tables list them."""

BASELINE = "hsdp-adamw"
"""The full-synchronization method that targets and speed-ups are measured against."""

_BY_NAME = {m.name: m for m in RECORDS}


def method_record(name: str) -> Method:
    """The record of method ``name``: a built-in one, or the one a plug-in's factory
    ``module.path:factory`` returns, checked and named by that path (:mod:`flexdemo.plugins`;
    once a process). ValueError, one sentence, naming the known ones or the plug-in's file."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    check(is_plugin(name), f"method={name!r} is unknown; use one of {', '.join(METHODS)}, or "
                           "your own as module.path:factory.")
    return _plugin_record(name)


@functools.lru_cache(maxsize=64)
def _plugin_record(spec: str) -> Method:
    """A plug-in's record, checked; a failure is not kept (the next call tries again)."""
    record, where = call_factory(spec)
    check(isinstance(record, Method), f"method {spec!r}: its factory ({where}) returned a "
                                      f"{type(record).__name__}; it must return a "
                                      "flexdemo.Method (a name, a Replicator subclass, its "
                                      "knobs, then lr and wiring).")
    check_record(record, f"method {spec!r} ({where})")
    return dataclasses.replace(record, name=spec)
