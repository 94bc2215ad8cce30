"""Run configuration: one typed dataclass, validated before anything is written.

TOML files and `--set key=value` overrides mirror the field names; human units ("100Mbit",
"10ms") stay strings here and become bytes/s and seconds in one place, `RunConfig.topology()`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from experiments.errors import ConfigError

# The one list of methods, chunkings and wire formats: the optimizer package owns them.
from flexdemo import CHUNKINGS, GRAPHS, METHODS, VALUE_FORMATS, resolve_knobs
from flexdemo.graphs import graph_ladder, graph_problem
from flexdemo.replicators.ada import DEFAULT_EVERY, DEFAULT_HIGH, DEFAULT_LOW

if TYPE_CHECKING:
    from netsim.topology import Topology

WORKLOADS = ("lm-tiny", "lm-small", "vision-tiny")
SHAPING_MODES = ("off", "wall", "virtual", "kernel")
SCHEDULES = ("constant", "warmup", "cosine")
VALUE_DTYPES = ("bf16", "fp32")


@dataclass
class RunConfig:
    """Everything that defines one training run (method, workload, cluster shape, network)."""

    method: str = "flexdemo"
    """Training scheme: flexdemo, demo, hsdp-adamw, diloco, random, striding, none, gossip or
    ada."""
    workload: str = "lm-tiny"
    """Model and data: lm-tiny, lm-small, vision-tiny, or your own factory as "module.path:attr"."""
    nodes: int = 2
    """Nodes (replicas); the inter-node group has one rank per node."""
    gpus_per_node: int = 2
    """Accelerators (ranks) per node; FSDP2 shards across them."""
    steps: int | None = None
    """Optimizer steps; None takes the workload's default budget."""
    lr: float | None = None
    """Learning rate; None takes the method's tuned default for the workload."""
    schedule: str = "constant"
    """Learning-rate schedule: constant, warmup (linear, then constant) or cosine (down to 10%)."""
    warmup: float = 0.05
    """Fraction of the steps spent in linear warmup (warmup and cosine schedules)."""
    seed: int = 0
    """Seed for model init, data order and random replication."""
    batch_size: int | None = None
    """Per-rank micro-batch; None takes the workload's default."""
    eval_every: int | None = None
    """Steps between validation evaluations; None takes the workload's default."""
    topk: int | None = None
    """FlexDeMo: DCT coefficients kept per chunk; None: the method's (flexdemo 4, demo 32)."""
    chunk: int = 64
    """FlexDeMo: DCT chunk size (largest divisor of each dimension not above this)."""
    decay: float = 0.999
    """FlexDeMo: decay of the decoupled momentum."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    sign: bool = True
    """FlexDeMo: take sign() of the decoded update."""
    value_dtype: str = "bf16"
    """FlexDeMo: dtype of the values on the wire, bf16 or fp32."""
    chunking: str | None = None
    """FlexDeMo: block (2-D DCT blocks) or flat (1-D chunks); None: the method's (flexdemo flat)."""
    value_format: str | None = None
    """FlexDeMo: wire format (bf16, bf16-packed, int8, int2, sign, ...); None: the method's."""
    diloco_h: int = 50
    """DiLoCo: inner steps between synchronizations."""
    outer_lr: float = 0.7
    """DiLoCo: outer Nesterov learning rate."""
    outer_momentum: float = 0.9
    """DiLoCo: outer Nesterov momentum."""
    graph: str = "ring"
    """Gossip: communication graph: ring, torus, exponential, one-peer-exponential or complete
    (ada picks its own)."""
    ada_every: int = DEFAULT_EVERY
    """Ada: gossip rounds between two measurements of the replica spread (the graph changes at
    most this often)."""
    ada_high: float = DEFAULT_HIGH
    """Ada: relative consensus distance above which the graph moves one rung denser."""
    ada_low: float = DEFAULT_LOW
    """Ada: relative consensus distance below which the graph moves one rung sparser."""
    replicate_every: int = 1
    """Replicate only every k-th step."""
    inter_bw: str | None = None
    """Inter-node bandwidth ("100Mbit", "1Gbit", "25GB/s"); None: the real, unshaped link."""
    inter_lat: str = "0ms"
    """Inter-node latency ("10ms", "200us")."""
    node_links: list[str] = field(
        default_factory=list, metadata={"flag": "--node-link", "metavar": "NODE=BW[,LAT]"}
    )
    """Nodes with a link of their own instead of inter_bw/inter_lat, each "NODE=BANDWIDTH[,LATENCY]"
    (e.g. "3=100Mbit,20ms"); the flag --node-link repeats, --set takes them joined by ";"."""
    intra_bw: str = "100GB/s"
    """Intra-node bandwidth, used by the cost model (intra links are not shaped)."""
    intra_lat: str = "5us"
    """Intra-node latency, used by the cost model."""
    shaping: str = "off"
    """off: count only; wall: wait on the modeled link; virtual: add modeled time to a clock;
    kernel: Linux tc on veth links between one network namespace per node (root only)."""
    backend: str = "auto"
    """Process-group backend: auto (nccl with CUDA, else gloo), gloo or nccl."""
    threads_per_rank: int = 1
    """torch threads per rank when the launcher spawns ranks on this machine."""
    pin_cores: bool = False
    """Pin rank r to core r mod cores, so runs compared with each other share CPUs alike."""
    stall_timeout: float = 90.0
    """Seconds without progress on any rank before the run is stopped as stalled."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form labels carried into run.json (e.g. sweep unit ids)."""

    def validate(self) -> RunConfig:
        """Raise ConfigError on the first bad field; return self so calls chain."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}.")
        _choice("method", self.method, METHODS)
        _workload(self.workload)
        _choice("shaping", self.shaping, SHAPING_MODES)
        _choice("schedule", self.schedule, SCHEDULES)
        if not 0.0 <= self.warmup < 1.0:
            raise ConfigError(f"warmup must be a fraction in [0, 1), got {self.warmup}.")
        self._check_wire()
        _choice("backend", self.backend, ("auto", "gloo", "nccl"))
        _choice("graph", self.graph, GRAPHS)
        _at_least("nodes", self.nodes, 1)
        _at_least("gpus_per_node", self.gpus_per_node, 1)
        _at_least("diloco_h", self.diloco_h, 1)
        _at_least("ada_every", self.ada_every, 1)
        _at_least("replicate_every", self.replicate_every, 1)
        _at_least("threads_per_rank", self.threads_per_rank, 1)
        for name in ("steps", "batch_size", "eval_every"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"decay must be in [0, 1), got {self.decay}.")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"lr must be a positive number, got {self.lr}.")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}.")
        if not self.outer_lr > 0:
            raise ConfigError(f"outer_lr must be a positive number, got {self.outer_lr}.")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}.")
        if not self.stall_timeout > 0:
            raise ConfigError(f"stall_timeout must be a positive number of seconds, got "
                              f"{self.stall_timeout}.")
        if self.method == "gossip" and graph_problem(self.graph, self.nodes):
            raise ConfigError(graph_problem(self.graph, self.nodes))
        self._check_ada()
        self._check_shaping()
        self.topology()  # parses the unit strings and node links
        return self

    def _check_wire(self) -> None:
        """FlexDeMo's chunking, top-k and wire format, with the method's defaults filled in."""
        _choice("value_dtype", self.value_dtype, VALUE_DTYPES)
        if self.chunking is not None:
            _choice("chunking", self.chunking, CHUNKINGS)
        if self.value_format is not None:
            _choice("value_format", self.value_format, VALUE_FORMATS)
        if self.topk is not None:
            _at_least("topk", self.topk, 1)
        _at_least("chunk", self.chunk, 1)
        topk, chunking, _ = self.knobs()
        if chunking == "flat" and topk > self.chunk:
            raise ConfigError(f"topk={topk} is larger than a flat chunk of chunk="
                              f"{self.chunk} elements; use topk <= chunk or chunking=block.")

    def _check_ada(self) -> None:
        """Ada's thresholds, and a graph ladder on this many nodes."""
        if not 0 <= self.ada_low < self.ada_high:
            raise ConfigError(f"ada_low={self.ada_low} and ada_high={self.ada_high} must satisfy "
                              "0 <= ada_low < ada_high.")
        if self.method == "ada" and not graph_ladder(self.nodes):
            raise ConfigError(f"method='ada' needs at least 2 nodes to gossip between, got "
                              f"nodes={self.nodes}; use nodes >= 2.")

    def _check_shaping(self) -> None:
        """Shaping needs a bandwidth; kernel shaping runs gloo ranks in namespaces."""
        if self.shaping != "off" and self.inter_bw is None:
            raise ConfigError(f"shaping={self.shaping!r} needs an inter-node bandwidth (inter_bw).")
        if self.shaping == "kernel" and self.backend == "nccl":
            raise ConfigError("shaping='kernel' runs gloo ranks over the namespaces' links; use "
                              "backend auto or gloo, not nccl.")

    def knobs(self) -> tuple[int, str, str | None]:
        """(topk, chunking, value_format) with the method's defaults filled in."""
        dtype = torch.float32 if self.value_dtype == "fp32" else torch.bfloat16
        return resolve_knobs(self.method, self.topk, self.chunking, self.value_format, dtype)

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.gpus_per_node

    def topology(self) -> Topology:
        """The run's network as one netsim Topology in bytes/s and seconds (ConfigError if bad).

        The one place the unit strings and node links are parsed. An unshaped run (inter_bw None)
        gets `Topology.from_strings`'s placeholder inter link at the intra bandwidth.
        """
        from netsim.topology import Topology

        specs = self.node_links
        if not isinstance(specs, list) or not all(isinstance(x, str) for x in specs):
            raise ConfigError(f'node_links must be a list of "NODE=BANDWIDTH[,LATENCY]" strings, '
                              f'such as ["3=100Mbit,20ms"], got {specs!r}.')
        try:
            return Topology.from_strings(
                self.nodes, self.gpus_per_node,
                inter_bw=self.inter_bw, inter_lat=self.inter_lat, intra_bw=self.intra_bw,
                intra_lat=self.intra_lat,
                node_links=specs,
            )  # fmt: skip
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (for run.json)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build from a dict, rejecting unknown keys and coercing strings from the CLI."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown run setting {unknown[0]!r}; known settings: {', '.join(sorted(names))}."
            )
        return cls(**{k: _coerce(names[k], v) for k, v in data.items()})

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields changed (string values coerced as from the CLI)."""
        return RunConfig.from_dict({**self.to_dict(), **changes})


def field_help(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), for --help texts."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for item, after in zip(body, body[1:], strict=False):
        if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            docs[item.target.id] = " ".join(str(after.value.value).split())
    return docs


def add_run_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One `--name` flag per RunConfig field (typed, documented by the field's docstring).

    Flags default to None, so that `run_arguments` can tell what was given on the command line.
    """
    docs = {k: v.replace("%", "%%") for k, v in field_help(RunConfig).items()}  # argparse
    for f in dataclasses.fields(RunConfig):
        if f.name in skip or f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=docs.get(f.name))
            continue
        if kind.startswith("list"):
            # Repeatable: each use adds one entry (the field's metadata names the flag).
            parser.add_argument(f.metadata.get("flag", flag), dest=f.name, action="append",
                                default=None, metavar=f.metadata.get("metavar"),
                                help=docs.get(f.name))
            continue
        base = kind.split(" ")[0]
        parser.add_argument(flag, dest=f.name, default=None, metavar=base.upper(),
                            type=_CLI_TYPES.get(base, str), help=docs.get(f.name))


def run_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields given as flags (see `add_run_arguments`)."""
    names = [f.name for f in dataclasses.fields(RunConfig)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


_CLI_TYPES = {"int": int, "float": float, "str": str}


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """Turn ["key=value", ...] into a dict, rejecting items without '='."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes key=value, got {pair!r}.")
        out[key.strip()] = value.strip()
    return out


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Turn a CLI string into the field's type; leave typed values (from TOML) alone."""
    if not isinstance(value, str):
        return value
    kind = str(f.type)
    text = value.strip()
    if text.lower() in ("none", "null") and "None" in kind:
        return None
    if kind.startswith("list"):
        return [part.strip() for part in text.split(";") if part.strip()]
    try:
        if kind.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError:
        raise ConfigError(f"{f.name} must be of type {kind}, got {value!r}.") from None
    return text


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}.")


def _workload(name: Any) -> None:
    if name in WORKLOADS:
        return
    if not (isinstance(name, str) and ":" in name):
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} or "
                          "give your own as module.path:factory.")
    # Imports torch and the user's module, so only for import paths; checked once per process.
    from experiments.workloads import check_workload

    check_workload(name)


def _at_least(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}.")
