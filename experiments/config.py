"""Run configuration: one typed dataclass, validated before anything is written.

TOML files and `--set key=value` overrides mirror the field names; human units ("100Mbit",
"10ms") stay strings here and become bytes/s and seconds in one place, `RunConfig.topology()`.
The method knobs (topk, graph, diloco_h, ...) are fields too, one per knob some method reads,
generated from the method records (`flexdemo.methods`): None means "the method's default", and a
knob given to a method that does not read it is refused. A plug-in method (`module.path:factory`,
`method_of`) brings knobs of its own: those no built-in method reads are held in `plugin_knobs`,
given and written flat beside the others (`--set my_knob=3`, run.json's `"my_knob": 3`), each
checked by its declared type and kind. Torch-free (a plug-in's module imports torch itself).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from experiments.deadline import bounded
from experiments.errors import ConfigError
from experiments.sizes import Cost, Count, Term, check_work
from experiments.values import (
    AT_LEAST_ONE,
    AT_LEAST_ZERO,
    COUNT,
    FRACTION,
    INTEGER,
    NUMBER,
    POSITIVE,
    POSITIVE_INT,
    SEED,
    UNIT_CLOSED,
    UNIT_OPEN_LOW,
    Kind,
)
from experiments.workload_budgets import BUILTIN_BUDGETS
from flexdemo.devices import BACKENDS
from flexdemo.graphs import graph_problem, site_blocks, site_count
from flexdemo.knobs import StepKnobs

# The one list of methods and their knobs: the optimizer package owns them.
from flexdemo.methods import METHODS, RECORDS, Method, method_record
from flexdemo.plugins import is_of_kind, is_plugin, knob_type

__all__ = ["KNOBS", "METHODS", "BACKENDS", "SCHEDULES", "SHAPING_MODES", "WORKLOADS",
           "ConfigError", "KnobSettings", "RunConfig", "RunSettings",
           "add_run_arguments", "field_help", "is_plugin", "load_site_file", "method_of",
           "parse_sets", "parse_value",
           "run_arguments", "run_flag", "shared_for", "check_algorithm_on_sites"]

if TYPE_CHECKING:
    from netsim.sites import Sites
    from netsim.topology import Topology

WORKLOADS = tuple(BUILTIN_BUDGETS)
SHAPING_MODES = ("off", "wall", "virtual", "kernel")
SCHEDULES = ("constant", "warmup", "cosine")
# RunSettings.warmup's default: a warmup other than it beside warmup_steps was set on purpose.
_DEFAULT_WARMUP = 0.05


def field_help(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), for --help texts.

    Fields of base classes count; a generated field's help is its metadata's "help".
    """
    return dict(_field_help(cls))


# Parsing a class's source takes tens of milliseconds and the knob fields ask for the same few
# schemas over a hundred times at import, in every process a run starts: parsed once each.
@functools.cache
def _field_help(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # made by make_dataclass: no source
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for item, after in zip(body, body[1:], strict=False):
            if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
                docs[item.target.id] = " ".join(str(after.value.value).split())
    docs.update({f.name: f.metadata["help"] for f in dataclasses.fields(cls)
                 if "help" in f.metadata})
    return docs


def _knob_doc(name: str, record: Method) -> tuple[str, str]:
    """(type, help) of knob ``name`` as ``record``'s schema declares it."""
    schema = StepKnobs if name in StepKnobs.names() else type(record.knobs)
    if name in schema.aliases:
        return "str", schema.aliases[name]
    kind = next(f.type for f in dataclasses.fields(schema) if f.name == name)
    return str(kind).split(" | ")[0], field_help(schema)[name]


def _knob_field(name: str, records: list[Method]) -> tuple[str, str, Any]:
    """The RunConfig field of knob ``name``: typed as its schema says, None by default."""
    docs: dict[str, list[str]] = {}
    for record in records:
        docs.setdefault(_knob_doc(name, record)[1], []).append(record.name)
    text = " ".join(doc if len(docs) == 1 else f"{', '.join(names)}: {doc}"
                    for doc, names in docs.items())
    by_default: dict[str, list[str]] = {}
    for record in records:
        by_default.setdefault(repr(record.resolved({})[name]), []).append(record.name)
    if len(by_default) == 1 and "None" in by_default:
        read = ", ".join(by_default["None"])
    else:  # the methods of each default together (e.g. base: adamw for flexdemo-adamw alone)
        read = "; ".join(f"{', '.join(names)} (default {value.strip(repr(''))})"
                         for value, names in by_default.items())
    kind = _knob_doc(name, records[0])[0]
    meta = {"knob": True, "help": f"{text} Read by {read}."}
    if name in KNOB_KINDS:
        meta["kind"] = KNOB_KINDS[name]
    return name, f"{kind} | None", field(default=None, metadata=meta)


# The kind of number each numeric knob takes, checked where a flag or key is parsed; the knob's
# schema (flexdemo.knobs) narrows it further (chunk <= MAX_DCT_CHUNK, delay 0 or 1, ada_low <
# ada_high). A numeric knob missing here is found by tests/experiments/test_values.py.
KNOB_KINDS: dict[str, Kind] = {
    "replicate_every": POSITIVE_INT, "skip_every": POSITIVE_INT, "decay": FRACTION,
    "topk": POSITIVE_INT, "chunk": POSITIVE_INT, "delay": COUNT, "beta1": FRACTION,
    "diloco_h": POSITIVE_INT, "outer_lr": POSITIVE, "outer_momentum": FRACTION,
    "sync_every": POSITIVE_INT, "num_fragments": POSITIVE_INT, "fragment_sync_delay": COUNT,
    "fragment_runs": POSITIVE_INT,
    "fragment_update_alpha": UNIT_CLOSED, "rate": UNIT_OPEN_LOW, "ada_every": POSITIVE_INT,
    "ada_high": AT_LEAST_ZERO, "ada_low": AT_LEAST_ZERO, "ada_sample": POSITIVE_INT,
    "powersgd_rank": POSITIVE_INT, "powersgd_start": COUNT, "min_compression_rate": AT_LEAST_ONE,
    "density": UNIT_OPEN_LOW,
    "error_decay": UNIT_CLOSED,  # sparseloco
}


# What a run holds or does per item (experiments.sizes): the bound on its nodes, ranks and steps.
# Every node has entries in the run's topology (10^7 nodes: 140 MB); every rank's row of a step
# (losses, times: about 100 B; a real run's trace adds about 1.5 kB for lm-tiny's) is kept
# until the run ends, then gathered by its writer; a gossip graph's checks look at every pair
# of nodes (Ada's ladder of 10^4 nodes: 11 s).
_NODE_BYTES = Cost("a node's entries in the run's topology", bytes=16)
_STEP_RECORD = Cost("a rank's row of a step, kept until the run ends", bytes=100)
_NODE_PAIR = Cost("to check a pair of nodes of the gossip graphs", seconds=1e-7)
# A torch thread's stack (glibc's default for a new thread), for every thread of a node's ranks.
_THREAD = Cost("a thread's stack", bytes=8 * 2**20)


def _knob_fields() -> list[tuple[str, str, Any]]:
    readers: dict[str, list[Method]] = {}
    for record in RECORDS:
        for name in record.takes:
            readers.setdefault(name, []).append(record)
    return [_knob_field(name, records) for name, records in readers.items()]


KnobSettings = dataclasses.make_dataclass(
    "KnobSettings", _knob_fields(),
    namespace={"__module__": __name__,
               "__doc__": "One field per knob some method reads (None: the method's default)."})
KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KnobSettings))


@dataclass
class RunSettings:
    """A run's own settings: method, workload, cluster shape, budget, network, launch."""

    method: str = field(default="flexdemo", metadata={
        "help": f"Training scheme: {', '.join(METHODS)}, or your own as module.path:factory "
                "(docs/methods.md#writing-your-own-method)."})
    """Training scheme: one of flexdemo.methods.METHODS, or a plug-in's "module.path:factory"."""
    workload: str = "lm-tiny"
    """Model and data: lm-tiny, lm-small, vision-tiny, or your own factory as "module.path:attr"."""
    nodes: int = field(default=2, metadata={"kind": POSITIVE_INT})
    """Nodes (replicas); the inter-node group has one rank per node."""
    gpus_per_node: int = field(default=2, metadata={"kind": POSITIVE_INT})
    """Accelerators (ranks) per node; FSDP2 shards across them."""
    steps: int | None = field(default=None, metadata={"kind": POSITIVE_INT})
    """Optimizer steps; None takes the workload's default budget."""
    lr: float | None = field(default=None, metadata={"kind": POSITIVE})
    """Learning rate; None takes the method's default (flexdemo.methods: its record's lr)."""
    schedule: str = "constant"
    """Learning-rate schedule of every method: constant, warmup
    (linear warm-up, then constant) or cosine (linear warm-up, then cosine down to 10%)."""
    warmup: float = field(default=_DEFAULT_WARMUP, metadata={"kind": FRACTION})
    """Fraction of the steps spent in linear warm-up (warmup and cosine schedules)."""
    warmup_steps: int | None = field(default=None, metadata={"kind": COUNT})
    """Steps of linear warm-up, instead of the fraction warmup (warmup and cosine schedules;
    below steps; constant ignores it); None: the fraction."""
    seed: int = field(default=0, metadata={"kind": SEED})
    """Seed for model init, data order, random replication and Ada's sample."""
    batch_size: int | None = field(default=None, metadata={"kind": POSITIVE_INT})
    """Per-rank micro-batch; None takes the workload's default."""
    eval_every: int | None = field(default=None, metadata={"kind": POSITIVE_INT})
    """Steps between validation evaluations; None takes the workload's default."""
    weight_decay: float = field(default=0.0, metadata={"kind": AT_LEAST_ZERO})
    """Decoupled weight decay."""
    inter_bw: str | None = None
    """Inter-node bandwidth ("100Mbit", "1Gbit", "25GB/s"); None: the real, unshaped link."""
    inter_lat: str = "0ms"
    """Inter-node latency ("10ms", "200us")."""
    node_links: list[str] = field(
        default_factory=list, metadata={"flag": "--node-link", "metavar": "NODE=BW[,LAT]"}
    )
    """Nodes with a link of their own instead of inter_bw/inter_lat, each "NODE=BANDWIDTH[,LATENCY]"
    (e.g. "3=100Mbit,20ms"); the flag --node-link repeats, --set takes them joined by ";"."""
    topology_file: str | None = field(default=None, metadata={"flag": "--topology"})
    """A TOML file of sites (netsim.sites: nodes, uplink, downlink, links inside, RTTs) that sets
    the links between nodes instead of inter_bw, inter_lat and node_links; nodes must be the
    file's. Shaping wall and virtual model collectives across sites hierarchically; kernel
    shaping lays the sites' rates (uplink, downlink, inside) and refuses their latencies."""
    intra_bw: str = "100GB/s"
    """Intra-node bandwidth, used by the cost model (intra links are not shaped)."""
    intra_lat: str = "5us"
    """Intra-node latency, used by the cost model."""
    shaping: str = "off"
    """off: count only; wall: wait on the modeled link; virtual: add modeled time to a clock;
    kernel: Linux tc on veth links between one network namespace per node (root only)."""
    backend: str = "auto"
    """Process-group backend: auto (nccl when every local rank has a GPU, else gloo), gloo or
    nccl; nccl runs as "cpu:gloo,cuda:nccl" (flexdemo.devices.backend_for)."""
    threads_per_rank: int = field(default=1, metadata={"kind": POSITIVE_INT})
    """torch threads per rank when the launcher spawns ranks on this machine."""
    pin_cores: bool = False
    """Pin rank r to core r mod cores, so runs compared with each other share CPUs alike."""
    sync_phases: bool = False
    """Wait for the GPU at the end of each step phase (the backward mark, the step's end), so
    the trace's times are the device's: `flexbench profile-compute` sets it. CPU runs ignore it."""
    profile: bool = False
    """Write a torch.profiler trace of each rank's training steps beside the recording
    (OUT/profile/rankR.pt.trace.json.gz), up to the first evaluation, to check `flexbench
    import-trace` against the run's own trace.parquet."""
    stall_timeout: float = field(default=90.0, metadata={"kind": POSITIVE})
    """Seconds without progress on any rank before the run is stopped as stalled."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form labels carried into run.json (e.g. sweep unit ids)."""


@dataclass
class RunConfig(KnobSettings, RunSettings):  # type: ignore[misc, valid-type]
    """Everything that defines one training run: its settings, then its method's knobs."""

    plugin_knobs: dict[str, Any] = field(default_factory=dict)
    """A plug-in method's own knobs, those no built-in method reads, by name (None: its
    default); given as any knob is (--set NAME=VALUE, a TOML key, [grid.knobs.METHOD]) and
    written flat beside the others in run.json."""

    def validate(self) -> RunConfig:
        """Raise ConfigError on the first bad field; return self so calls chain."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_type(f, value)
        method_of(self.method)
        for name, allowed in (("shaping", SHAPING_MODES), ("schedule", SCHEDULES),
                              ("backend", BACKENDS)):
            _choice(name, getattr(self, name), allowed)
        # Every numeric field is checked by its kind, the same check as its flag's; a knob's
        # schema speaks first, its sentence naming the method's rule.
        self._check_kinds(knobs=False)
        self._check_size()  # before anything that works per node or calls the user's code
        _workload(self.workload)
        self._check_knobs()
        self._check_kinds(knobs=True)
        self._check_warmup_steps()
        self._check_shaping()
        self.topology()  # parses the unit strings and node links
        return self

    def check_numbers(self) -> RunConfig:
        """Every numeric setting and knob given is of its kind; return self. For a stored
        run.json, which is not validated whole (its workload may be a module this machine
        lacks) but whose numbers a replay divides by."""
        self._check_kinds(knobs=False)
        self._check_kinds(knobs=True)
        return self

    def _check_kinds(self, *, knobs: bool) -> None:
        """Every numeric setting (or knob) given, not None, is of its kind (experiments.values)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            mine = f.metadata.get("knob", False) == knobs
            if mine and "kind" in f.metadata and value is not None:
                f.metadata["kind"].check(f.name, value)
        if knobs and self.plugin_knobs:
            schema = type(self.record.knobs)
            for name, value in self.plugin_knobs.items():
                if name in schema.names() and value is not None:
                    _check_plugin_value(schema, name, value)

    def _check_size(self) -> None:
        """Refuse nodes, ranks, steps and threads whose records or stacks pass this machine's
        memory, or a graph too large to check (experiments.sizes), before any is made."""
        nodes = Count("nodes", self.nodes, "nodes")
        ranks = Count("gpus_per_node", self.gpus_per_node, "ranks a node")
        steps = Count("steps", self.steps or BUILTIN_BUDGETS.get(self.workload, (1,))[0], "steps",
                      given=self.steps is not None)
        threads = Count("threads_per_rank", self.threads_per_rank, "threads a rank")
        terms = [Term(_NODE_BYTES, (nodes,)),
                 Term(_STEP_RECORD, (steps, nodes, ranks)),
                 Term(_THREAD, (ranks, threads))]
        if self.record.gossips:
            terms.append(Term(_NODE_PAIR, (nodes, nodes)))
        check_work("the run", terms)

    def _check_warmup_steps(self) -> None:
        """warmup_steps: a count below steps, not beside a warmup fraction of its own.

        A constant schedule ignores it, as it ignores warmup: a sweep's shared warm-up then
        stays valid for a method whose own schedule is constant.
        """
        if self.warmup_steps is None:
            return
        if self.warmup != _DEFAULT_WARMUP:
            raise ConfigError(f"warmup={self.warmup} and warmup_steps={self.warmup_steps} both "
                              "set the warm-up; give one of them.")
        if self.steps is not None and self.warmup_steps >= self.steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} must be below steps="
                              f"{self.steps}.")

    def _check_knobs(self) -> None:
        """The knobs given are ones the method reads, each valid, and fit this many nodes."""
        try:
            self.record.settings_on(self.given_knobs(), self.nodes)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def _check_shaping(self) -> None:
        """Shaping needs a bandwidth or sites; kernel shaping runs gloo ranks in namespaces."""
        if self.shaping != "off" and self.inter_bw is None and self.topology_file is None:
            raise ConfigError(f"shaping={self.shaping!r} needs an inter-node bandwidth (inter_bw).")
        if self.profile and self.shaping in ("wall", "virtual"):
            raise ConfigError(f"profile=true records the backends' own timing, and "
                              f"shaping={self.shaping!r} delays collectives only in netsim's "
                              "model; profile an unshaped run (shaping off) or a kernel-shaped "
                              "one.")
        if self.shaping == "kernel" and self.backend == "nccl":
            raise ConfigError("shaping='kernel' runs gloo ranks over the namespaces' links; use "
                              "backend auto or gloo, not nccl.")

    @property
    def record(self) -> Method:
        """The method's record: its replicator, knobs and wiring (ConfigError if unknown)."""
        return method_of(self.method)

    def given_knobs(self) -> dict[str, Any]:
        """The method knobs set here (not None), by name: what `build_optimizer` is handed."""
        given = {name: getattr(self, name) for name in KNOBS if getattr(self, name) is not None}
        return {**given, **{k: v for k, v in self.plugin_knobs.items() if v is not None}}

    def knob_values(self) -> dict[str, Any]:
        """Every knob the method reads with its value: as given, else the method's default."""
        return self.record.resolved(self.given_knobs())

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

        if self.topology_file is not None:
            return self._site_topology()
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

    def _site_topology(self) -> Topology:
        """The topology of topology_file's sites (ConfigError, one sentence, if it cannot be)."""
        from netsim.topology import Link, Topology

        path = self.topology_file
        if self.inter_bw is not None or self.node_links or self.inter_lat != "0ms":
            raise ConfigError(f"topology_file {path!r} sets the links between nodes; leave out "
                              "inter_bw, inter_lat and node_links (give one or the other).")
        sites = load_site_file(path)
        if sites.nodes != self.nodes:
            raise ConfigError(f"topology_file {path!r} holds {sites.nodes} nodes but nodes is "
                              f"{self.nodes}; give nodes = {sites.nodes}.")
        graph = self.knob_values().get("graph") if self.record.gossips else None
        problem = None if graph is None else site_graph_mismatch(graph, sites, path)
        if problem is not None:
            raise ConfigError(problem)
        try:
            return Topology.on_sites(sites, self.gpus_per_node,
                                     Link(self.intra_bw, self.intra_lat))
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (for run.json), a plug-in's own knobs flat beside the
        built-in ones."""
        data = dataclasses.asdict(self)
        own = data.pop("plugin_knobs")
        return {**data, **own}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build from a dict, rejecting unknown keys and coercing strings from the CLI; a key a
        plug-in method reads as a knob of its own goes to ``plugin_knobs``."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        own = _plugin_keys(data.get("method", RunSettings.method), unknown)
        unknown = [k for k in unknown if k not in own]
        if unknown:
            raise ConfigError(
                f"unknown run setting {unknown[0]!r}; known settings: {', '.join(sorted(names))}"
                + (f", and the knobs of {data['method']}" if own or is_plugin(data.get("method"))
                   else "") + "."
            )
        built = {k: _coerce(names[k], v) for k, v in data.items() if k not in own}
        if own:
            built["plugin_knobs"] = {**built.get("plugin_knobs", {}),
                                     **{k: _coerce_as(k, kind, data[k]) for k, kind in own.items()}}
        return cls(**built)

    @classmethod
    def from_stored(cls, data: Mapping[str, Any]) -> RunConfig:
        """Build from a run.json config, leaving out the knobs its method does not read.

        Runs recorded before the method records listed every knob for every method
        (hsdp-adamw's run.json has topk, chunk, ...): reading a stored run never refuses it.
        """
        return cls.from_dict(shared_for(data.get("method", RunSettings.method), data))

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields changed (string values coerced as from the CLI)."""
        return RunConfig.from_dict({**self.to_dict(), **changes})


def load_site_file(path: str) -> Sites:
    """netsim's Sites of a TOML site file, a bad one as one ConfigError sentence."""
    from netsim.sites import load_sites

    try:
        return load_sites(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_algorithm_on_sites(algorithm: str, path: str | None) -> None:
    """ConfigError for an --algorithm other than auto beside a site file of several sites,
    whose collectives across sites are hierarchical (netsim.sites): it would apply to nothing."""
    if algorithm == "auto" or path is None:
        return
    count = len(load_site_file(path).sites)
    if count > 1:
        raise ConfigError(f"--algorithm {algorithm} picks the collectives across nodes, and "
                          f"across the {count} sites of --topology {path} they are hierarchical "
                          "whatever it says; leave --algorithm out (auto).")


def site_graph_mismatch(graph: str, sites: Sites, path: str) -> str | None:
    """Why the gossip graph ``graph`` does not fit the sites of file ``path``, or None.

    A site graph's sites must be the topology's: the same count, each the same consecutive
    nodes. Other graphs are built on the sites' nodes as numbered, whatever the sites.
    """
    count = site_count(graph)
    if count is None or graph_problem(graph, sites.nodes) is not None:
        return None  # not a site graph, or one the node count refuses on its own
    blocks = [tuple(block) for block in site_blocks(graph, sites.nodes)]
    if blocks == [tuple(site.nodes) for site in sites.sites]:
        return None
    theirs = ", ".join(f"{site.name} {_span(site.nodes)}" for site in sites.sites)
    return (f"graph={graph!r} puts the nodes in {count} sites of {len(blocks[0])} consecutive "
            f"nodes, but topology_file {path!r} has {len(sites.sites)} sites ({theirs}); "
            f"give graph=sites:{len(sites.sites)} or a site file of {count} such sites.")


def _span(nodes: tuple[int, ...]) -> str:
    """A site's nodes in few characters: "0-7" when consecutive, else the list."""
    if list(nodes) == list(range(nodes[0], nodes[0] + len(nodes))):
        return f"{nodes[0]}-{nodes[-1]}"
    return str(list(nodes))


def method_of(name: Any) -> Method:
    """The record of method ``name``: a built-in one, or a plug-in's ``module.path:factory``,
    imported and checked once a process under the run's deadline (`experiments.deadline`;
    RunFailed when it passes). ConfigError, one sentence, for an unknown name or a plug-in that
    cannot be used (naming its file)."""
    if isinstance(name, str) and name in METHODS:
        return method_record(name)
    if not is_plugin(name):
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}, or give "
                          "your own as module.path:factory.")
    return _plugin(name)


@functools.lru_cache(maxsize=64)
def _plugin(spec: str) -> Method:
    """A plug-in's record whose knobs a run can hold: none named as a run setting, one named as
    a built-in knob of its type, kinds that are experiments.values kinds. Failures not kept."""
    try:
        record = bounded(f"method {spec!r}: importing its module and calling its factory",
                         lambda: method_record(spec))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    schema = type(record.knobs)
    who = f"method {spec!r} ({inspect.getsourcefile(schema) or schema.__module__})"
    settings = {f.name for f in dataclasses.fields(RunSettings)} | {"plugin_knobs"}
    fields = {f.name: f for f in dataclasses.fields(KnobSettings)}
    for f in dataclasses.fields(schema):
        kind = f.metadata.get("kind")
        if f.name in settings:
            raise ConfigError(f"{who}: knob {f.name!r} of {schema.__name__} is named as the run "
                              f"setting {f.name}, which --set {f.name} would set instead; "
                              "rename the knob.")
        if f.name in fields and knob_type(schema, f.name)[0] != _base(fields[f.name]):
            raise ConfigError(f"{who}: knob {f.name!r} of {schema.__name__} is declared "
                              f"{knob_type(schema, f.name)[0]}, but {f.name} is a built-in knob "
                              f"of type {_base(fields[f.name])}; declare it so or rename it.")
        if kind is not None and not isinstance(kind, Kind):
            raise ConfigError(f"{who}: knob {f.name!r} of {schema.__name__} has metadata kind "
                              f"{kind!r}; give an experiments.values kind (POSITIVE, FRACTION, "
                              "POSITIVE_INT, ...) or none.")
        default = getattr(record.knobs, f.name)
        if f.name in KNOB_KINDS and default is not None:  # a built-in knob's kind is its own
            KNOB_KINDS[f.name].check(f"{who}: its default {f.name}", default)
        elif f.name not in fields and default is not None:
            _check_plugin_value(schema, f.name, default, who)
    return record


def _plugin_keys(method: Any, keys: list[str]) -> dict[str, str]:
    """Of ``keys`` (none a RunConfig field), those plug-in ``method`` reads as its own knobs,
    each with its declared type."""
    if not keys or not is_plugin(method):
        return {}
    schema = type(method_of(method).knobs)
    types = {k: knob_type(schema, k) for k in keys if k in schema.names()}
    return {k: (kind or "str") + (" | None" if optional else "")
            for k, (kind, optional) in types.items()}


def _check_plugin_value(schema: type, name: str, value: Any, who: str = "") -> None:
    """A plug-in knob's value is of its declared type, and of its kind where the field's
    metadata names one (else any finite number, for a number)."""
    kind_text, _ = knob_type(schema, name)
    prefix = f"{who}: its default " if who else ""
    if kind_text is not None and not is_of_kind(value, kind_text):
        raise ConfigError(f"{prefix}{name} must be of type {kind_text}, got {value!r}.")
    field_of = next(f for f in dataclasses.fields(schema) if f.name == name)
    kind = field_of.metadata.get("kind") or (
        {"int": INTEGER, "float": NUMBER}.get(kind_text or ""))
    if kind is not None:
        kind.check(f"{prefix}{name}", value)


def _base(f: dataclasses.Field) -> str:
    """A field's declared type without None: "int" of "int | None"."""
    return str(f.type).split(" | ")[0]


def shared_for(method: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` meant for several methods as ``method`` takes them: other knobs left out.

    For settings shared across methods (a sweep's [run] table, check-comm's fixed setting, a
    stored run.json); knobs given to one method alone are checked, not dropped.
    """
    known = method in METHODS or is_plugin(method)
    takes = set(method_of(method).takes) if known else set(KNOBS)
    return {k: v for k, v in settings.items() if k not in KNOBS or k in takes}


def add_run_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One `--name` flag per RunConfig field (typed, documented by the field's docstring).

    Flags default to None, so that `run_arguments` can tell what was given on the command line.
    """
    docs = {k: v.replace("%", "%%") for k, v in field_help(RunConfig).items()}  # argparse
    for f in dataclasses.fields(RunConfig):
        if f.name in skip or f.name in ("extra", "plugin_knobs"):
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
        # A numeric field's flag parses by its kind; one without a kind keeps the bare type,
        # which tests/experiments/test_values.py refuses.
        typed = f.metadata["kind"].arg if "kind" in f.metadata else _CLI_TYPES.get(base, str)
        parser.add_argument(f.metadata.get("flag", flag), dest=f.name, default=None,
                            metavar=base.upper(), type=typed, help=docs.get(f.name))


def run_flag(name: str) -> str:
    """The command-line flag of RunConfig field `name` (`--gpus-per-node`, `--node-link`)."""
    found = next(f for f in dataclasses.fields(RunConfig) if f.name == name)
    return found.metadata.get("flag", "--" + name.replace("_", "-"))


def run_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields given as flags (see `add_run_arguments`)."""
    names = [f.name for f in dataclasses.fields(RunConfig)]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


_CLI_TYPES = {"int": int, "float": float, "str": str}


def parse_value(text: str) -> Any:
    """A --set value, every command's one grammar: a TOML value where the text is one (true,
    3, 0.5, inf, "text", [0, 1]), else the text itself (ring, 100Mbit, 1=100Mbit;2=1Gbit)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs as one mapping, each value by `parse_value`; an item without
    '=' and a key given twice with two values (which one was meant cannot be told) refused."""
    out: dict[str, Any] = {}
    texts: dict[str, str] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes key=value, got {pair!r}.")
        key, text = key.strip(), text.strip()
        value = parse_value(text)
        if key in out and out[key] != value:
            raise ConfigError(f"--set gives {key} twice, {key}={texts[key]} and {key}={text}; "
                              "give it once.")
        out[key], texts[key] = value, text
    return out


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Turn a CLI string into the field's type; leave typed values (from TOML) alone, but for a
    number given to a text setting (`--set inter_bw=100`), which is read as its text."""
    return _coerce_as(f.name, str(f.type), value)


def _coerce_as(name: str, kind: str, value: Any) -> Any:
    """Turn a CLI string into a value of type ``kind`` (as a field declares it, "int | None")."""
    if not isinstance(value, str):
        return _number_as_text(kind, value)
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
        raise ConfigError(f"{name} must be of type {kind}, got {value!r}.") from None
    return text


def _number_as_text(kind: str, value: Any) -> Any:
    """A number given to a text setting as its text; any other typed value as it is."""
    if isinstance(value, int | float) and not isinstance(value, bool) and kind.startswith("str"):
        return str(value)
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(allowed)}.")


# A field's declared type -> the Python types its values may have (booleans are not numbers).
# Lists (node_links) have a check of their own that shows the syntax.
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,),
}


def _check_type(f: dataclasses.Field, value: Any) -> None:
    """ConfigError unless `value` has the field's type (as a TOML file could get it wrong)."""
    kind = str(f.type)
    if value is None and "None" in kind:
        return
    base = kind.split(" | ")[0].split("[")[0]
    allowed = _TYPES.get(base)
    if allowed is None:
        return
    if isinstance(value, bool) and base != "bool" or not isinstance(value, allowed):
        raise ConfigError(f"{f.name} must be of type {kind}, got {value!r}.")


def _workload(name: Any) -> None:
    if name in WORKLOADS:
        return
    if not (isinstance(name, str) and ":" in name):
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} or "
                          "give your own as module.path:factory.")
    # Imports torch and the user's module, so only for import paths; checked once per process.
    from experiments.workloads import check_workload

    check_workload(name)
