"""The SimPy side of the model: one process per (node speed class, accelerator position).

Programs are first compiled for the target topology into few, cheap steps (`Delay`, `InterOp`,
`IntraOp`, `Exchange`, `Wait`); a collective is a rendezvous of its member processes, then its
latency steps and a processor-shared transfer of its wire bytes over the NICs (`SharedLink`).

A round of point-to-point messages (gossip) is one `Exchange`: no rendezvous with other nodes,
the node's messages to and from its neighbours leave through its NIC's egress and arrive through
its ingress at once, processor-shared with the node's other traffic, and end one latency later.
On a vertex-transitive graph every node does this at the same time, so the class's one process
stands for all of its nodes, and the cost grows with the degree, not with the node count.

Nodes of one compute speed form one class whatever their links: the slowest of their links paces
every op of theirs exactly (`Cluster._node_classes`), so 10^4 nodes, each with a link of its
own, cost what 10^4 alike do.

On sites (`Topology.sites`) a class is a (site, speed) pair, its NICs at the site's inside link,
and every site has an uplink and a downlink shared by its nodes' flows. A collective across
several sites runs its `netsim.sites.hierarchical_plan`: phase by phase, every site's latency
and then its flows on its classes' NICs, its uplink and its downlink; a phase ends with the
slowest site. One site is the flat model on the site's inside link.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Generator
from typing import NamedTuple

import simpy

from netsim.costs import (
    P2P_OPS,
    CollectiveVolume,
    choose_algorithm,
    collective_volume,
    default_algorithm,
)
from netsim.model.options import ReplayOptions
from netsim.model.programs import Compute, Issue, Item, OpSpec, Programs, Wait
from netsim.model.shared_link import SharedLink
from netsim.sites import SITE_OPS, SitePhase, SiteRound, hierarchical_plan
from netsim.topology import Link, Topology

__all__ = ["Cluster", "Delay", "Exchange", "InterOp", "IntraOp", "StreamOp", "Step"]


class Delay(NamedTuple):
    """A timeout of compute_s * (compute_scale / node speed) + fixed_s."""

    compute_s: float
    fixed_s: float


class InterOp(NamedTuple):
    """Issue inter-node collective `op` of spec `spec`, moving `volume` per rank."""

    op: int
    spec: int
    volume: CollectiveVolume


class IntraOp(NamedTuple):
    """Issue intra-node op `op` lasting `seconds`; with a spec it starts when its members meet."""

    op: int
    spec: int | None
    seconds: float


class Exchange(NamedTuple):
    """Issue one round of point-to-point messages, named `op`, of recorded step index `step`.

    `sent` and `received` are one message's bytes each way (the largest recorded); `sends` and
    `recvs` the recorded message counts, kept when no graph rebuilds the round's peers.
    """

    op: int
    step: int
    sent: float
    received: float
    sends: int
    recvs: int


class StreamOp(NamedTuple):
    """Issue `inner` (an InterOp or IntraOp named `op`) once the ops `after` are done.

    FSDP2's reduce of a unit on a GPU's communication stream (overlap "fsdp2"): the rank's
    program goes on computing; its place in the rendezvous order is taken at issue, so the
    members of a group pair up as in program order whenever each one's stream gets there.
    """

    op: int
    after: tuple[int, ...]
    inner: InterOp | IntraOp


Step = Delay | InterOp | IntraOp | Exchange | Wait | StreamOp


class Cluster:
    """One process per (speed class, position); NICs per class, or per position per-accelerator."""

    # Private switch for tests: True keeps one class per distinct (speed, link), as the model
    # did before classes merged per speed; it predicts the same, only slower.
    _class_per_link = False
    # Private switch for tests: False runs one process per position even where a node's
    # positions are alike (`_alike_positions`); it predicts the same, only slower.
    _merge_alike = True

    def __init__(self, topology: Topology, recorded: Topology, programs: Programs,
                 options: ReplayOptions, compiled_cache: dict | None = None) -> None:
        """`programs` recorded on `recorded`, to replay on `topology` as `options` say;
        `compiled_cache` holds compiled programs across the topologies of one grid."""
        self.env = simpy.Environment()
        self.site_rounds = options.site_rounds
        self.topo = topology
        self.recorded = recorded
        specs = programs.specs
        self.specs = specs
        self.n_recorded = programs.n_steps
        self.compute_scale = float(options.compute_scale)
        self.intra = options.intra
        # A node standing for several (a replica across nodes): modeled intra-node collectives
        # cross their NICs, shared with the inter-node traffic (`_across_span`).
        self.spans_nodes = topology.node_span > 1 and self.intra == "model"
        self.algorithm = options.algorithm
        self.degrees = options.degrees
        self.step_numbers = programs.step_numbers or list(range(programs.n_steps))
        # Carried op id -> steps after its own that a program waits for it (Programs.carried).
        self.carried = programs.carried or {}
        self.on_step: Callable[[], None] | None = None
        self._degree_cache: dict[tuple[int, int], int] = {}
        self._round_cache: dict[tuple[int, int], SiteRound] = {}
        self.p2p_degrees: set[int] = set()  # peers per node in the rounds replayed, for reporting
        self.node_egress_bytes = 0.0  # bytes out of the first class's node, for reporting
        # (op, algorithm run, group size, one rank per node) -> message sizes, for reporting.
        self.choices: dict[tuple[str, str, int, bool], set[int]] = defaultdict(set)
        # Class c runs at speed classes[c] and its NICs at links[c] (sorted by speed), in site
        # class_site[c] (0 without sites).
        if topology.sites is None:
            self.classes, self.links = self._node_classes(topology, self._class_per_link)
            self.class_site = [0] * len(self.classes)
        else:
            self.classes, self.links, self.class_site = self._site_classes(topology)
        self._init_sites(specs)
        # Every inter-node op spans all nodes here: it pays the largest latency of any of them.
        self.path = topology.inter_link()
        # A calibration's own fit per op kind: (bandwidth factor, latency per hop added).
        self.op_costs = {op: (factor, extra) for op, factor, extra in topology.op_costs}
        self.nics = self._make_nics(topology)
        # Messages arrive through a NIC's other direction: only traces with messages need it, so
        # collectives keep their one (busier-direction) link and their speed everywhere else.
        self.ingress: dict | None = None
        if any(spec.scope == "p2p" for spec in specs):
            self.ingress = {key: SharedLink(self.env, nic.bandwidth)
                            for key, nic in self.nics.items()}
        self.rendezvous: dict[tuple, list] = {}
        self.step_end: list[float] = []
        self._volumes: dict[int, tuple[int, CollectiveVolume]] = {}  # spec id -> (p, volume)
        self.compiled, alike = self._compiled(programs.by_slot, compiled_cache)
        # Positions of a node one process stands for (`_alike_positions`); 1 = each its own.
        self.weight = self._alike_positions(alike)

    def _make_nics(self, topology: Topology) -> dict:
        """One shared link per node class (per accelerator of each class with per-accelerator
        NICs), at the class's link."""
        if topology.nic == "per-accelerator":
            return {(c, j): SharedLink(self.env, link.effective_bandwidth)
                    for c, link in enumerate(self.links)
                    for j in range(topology.accelerators_per_node)}
        return {c: SharedLink(self.env, link.effective_bandwidth)
                for c, link in enumerate(self.links)}

    def _compiled(self, programs: dict[tuple[int, int], list[Item]],
                  cache: dict | None) -> tuple[dict, bool]:
        """(compiled programs per slot, whether they are alike), from `cache` when it holds them.

        Programs compile alike on every topology that gives each spec the same group size and
        volume and the same intra-node link: a grid of inter-node bandwidths compiles once.
        """
        key = self._compile_key()
        if cache is not None and key is not None and key in cache:
            return cache[key]
        self.compiled = {slot: self._compile(program, slot[1])
                         for slot, program in programs.items()}
        alike = self._programs_alike()  # reads self.compiled
        if cache is not None and key is not None:
            cache[key] = (self.compiled, alike)
        return self.compiled, alike

    @staticmethod
    def _node_classes(topology: Topology, per_link: bool = False,
                      ) -> tuple[list[float], list[Link]]:
        """One class per node speed, its NICs at the slowest link among the nodes of that speed.

        Nodes of one speed run the same program at the same times: every op starts on all of
        them at once (a meeting of all classes), so their NICs carry the same flows, started
        together; a link's own latency enters only through the path's largest. Processor
        sharing is monotone in bandwidth (at every instant a faster NIC has moved at least as
        much of every flow: it carries a subset of the slower one's flows, each at a larger
        share), so the slowest NIC ends each op last among them, and it alone sets the pace.
        """
        links = [topology.node_link(k) for k in range(topology.nodes)]
        kinds: dict[tuple, Link] = {}
        for speed, link in zip(topology.node_speed, links, strict=True):
            key = (speed, link.effective_bandwidth, link.latency) if per_link else (speed,)
            if key not in kinds or link.effective_bandwidth < kinds[key].effective_bandwidth:
                kinds[key] = link
        keys = sorted(kinds)  # by speed first, so uniform links keep the old class order
        return [key[0] for key in keys], [kinds[key] for key in keys]

    @staticmethod
    def _site_classes(topology: Topology) -> tuple[list[float], list[Link], list[int]]:
        """One class per (site, node speed), its NICs at the site's inside link."""
        sites = topology.sites
        site_of = sites.site_of()
        keys = sorted({(site_of[k], speed) for k, speed in enumerate(topology.node_speed)})
        inside = [Link(site.intra_bw, site.intra_lat) for site in sites.sites]
        return [speed for _, speed in keys], [inside[s] for s, _ in keys], [s for s, _ in keys]

    def _init_sites(self, specs: list[OpSpec]) -> None:
        """Uplinks and downlinks of several sites, and the refusal of ops they cannot place."""
        sites = self.topo.sites
        self.hierarchical = sites is not None and len(sites.sites) > 1
        self._plans: dict[tuple[str, int], tuple[SitePhase, ...]] = {}
        if not self.hierarchical:
            return
        self.uplinks = [SharedLink(self.env, site.uplink) for site in sites.sites]
        self.downlinks = [SharedLink(self.env, site.downlink) for site in sites.sites]
        self.site_members = [[c for c, s in enumerate(self.class_site) if s == site]
                             for site in range(len(sites.sites))]
        for spec in specs:
            if spec.scope == "p2p" and self.site_rounds is not None:
                continue  # gossip's messages: a round per site (`_site_exchange`)
            if spec.scope == "p2p":
                raise ValueError("the trace has point-to-point messages (gossip), whose peers on "
                                 "sites are unknown; pass site_rounds= (each site's messages "
                                 "per round, netsim.sites.gossip_round), as flexbench simulate "
                                 "does from the run's graph.")
            if spec.inter and (spec.scope != "replicate" or spec.op not in SITE_OPS):
                raise ValueError(
                    f"the site model replays collectives of one rank per node over all nodes "
                    f"({', '.join(SITE_OPS)}); this trace has a {spec.op} over a {spec.scope} "
                    "group, which it cannot place on sites."
                )

    def _compile_key(self) -> tuple | None:
        """What compiling depends on besides the programs (None: not cached, as with messages)."""
        if any(spec.scope == "p2p" for spec in self.specs):
            return None
        return (tuple(self._volume(i) for i in range(len(self.specs))), self.topo.intra,
                self.intra, self.topo.accelerators_per_node, self.recorded.accelerators_per_node)

    def _alike_positions(self, alike: bool) -> int:
        """How many positions each process stands for: a node's all, or 1.

        A node's positions that run the same compiled program (`alike`), meet for every
        intra-node op as a whole node, send their inter-node ops one per node (replicate
        groups) and share the node's one NIC start and end every op together: one process,
        its flows weighted by the positions (`SharedLink.transfer_each`), replays them at the
        cost of one.
        """
        g = self.topo.accelerators_per_node
        if (not alike or not self._merge_alike or g == 1 or self.topo.nic == "per-accelerator"
                or self.ingress is not None or self.hierarchical):
            return 1
        g_rec = self.recorded.accelerators_per_node
        for spec in self.specs:
            if spec.inter and spec.scope != "replicate":
                return 1
            if not spec.inter and spec.size != g_rec and spec.size > 1:
                return 1
        return g

    def _programs_alike(self) -> bool:
        """Whether every recorded position runs the same compiled program, step by step, its
        ops named apart (an op's id is its row in its own rank's trace)."""
        g_rec = self.recorded.accelerators_per_node
        steps = sorted({s for _, s in self.compiled})
        first = self._canonical(0, steps)
        return all(self._canonical(jr, steps) == first for jr in range(1, g_rec))

    def _canonical(self, position: int, steps: list[int]) -> list[tuple]:
        """A position's compiled steps with each op id replaced by its order of first use,
        whether it is carried and how far (Programs.carried), and each spec by what it is but
        its members (a replicate group or a whole node's: the same meeting at every position)."""
        names: dict[int, tuple] = {}

        def name(op: int) -> tuple:
            if op not in names:
                names[op] = (len(names), op < 0, self.carried.get(op))
            return names[op]

        def spec(index: int | None) -> tuple | None:
            if index is None:
                return None
            s = self.specs[index]
            return (s.op, s.algorithm, s.nbytes, s.inter, s.scope, s.size, s.nic_share)

        def op(item: InterOp | IntraOp) -> tuple:
            return (type(item), name(item[0]), spec(item[1]), item[2])

        out: list[tuple] = []
        for s in steps:
            for item in self.compiled.get((position, s), ()):
                kind = type(item)
                if kind is Delay:
                    out.append(item)
                elif kind is StreamOp:
                    out.append((kind, name(item.op), tuple(name(a) for a in item.after),
                                op(item.inner)))
                elif kind is InterOp or kind is IntraOp:
                    out.append(op(item))
                else:
                    out.append((kind, name(item.op), *item[1:]))
            out.append(s)
        return out

    # -- compiling programs for the target topology -------------------------------------------
    def _group_size(self, spec: OpSpec) -> int:
        t, r = self.topo, self.recorded
        if spec.scope == "replicate":
            return t.nodes
        if spec.scope == "world":
            return t.world_size
        if spec.scope == "intra":
            if spec.size == r.accelerators_per_node:
                return t.accelerators_per_node
            if spec.size > t.accelerators_per_node:
                raise ValueError(
                    f"the trace has intra-node groups of {spec.size} ranks, more than the target "
                    f"topology's {t.accelerators_per_node} accelerators per node."
                )
        return spec.size

    def _volume(self, spec_id: int) -> tuple[int, CollectiveVolume]:
        """Target group size and per-rank volume of a spec (computed once per spec)."""
        if spec_id not in self._volumes:
            spec = self.specs[spec_id]
            p = self._group_size(spec)
            rooted = spec.op in ("gather", "scatter")
            algorithm = spec.algorithm or default_algorithm(spec.op)
            if spec.inter and self.hierarchical:
                algorithm = "hierarchical"
                self.choices[(spec.op, algorithm, p, True)].add(spec.nbytes)
            elif spec.inter:
                # Intra-node ops keep the recorded algorithm: the choice matters across nodes.
                algorithm = choose_algorithm(
                    spec.op, p, spec.nbytes, self.path, algorithm, self.algorithm,
                    one_per_node=spec.scope == "replicate",
                )  # fmt: skip
                self.choices[(spec.op, algorithm, p, spec.scope == "replicate")].add(spec.nbytes)
            volume = collective_volume(spec.op, p, spec.nbytes,
                                       spec.algorithm if spec.inter and self.hierarchical
                                       else algorithm, is_root=rooted)
            self._volumes[spec_id] = (p, volume)
        return self._volumes[spec_id]

    def _compile(self, program: list[Item], step: int) -> list[Step]:
        """Resolve a program for this topology: intra ops become delays or meetings, delays merge.

        A round of messages (those issued before the first of them is waited on) becomes one
        Exchange, waited on where the first of them was. Folding keeps SimPy events per step
        few, which keeps replay fast.
        """
        out: list[Step] = []
        waited_at_once: set[int] = set()
        round_: list | None = None  # [index in out, first op, sizes sent, sizes received]
        in_round: set[int] = set()  # messages of the open round
        folded: set[int] = set()  # messages of closed rounds: their waits are the round's
        for n, item in enumerate(program):
            if type(item) is Compute:
                self._add_delay(out, item.seconds, 0.0)
            elif type(item) is Issue and self.specs[item.spec].scope == "p2p":
                spec = self.specs[item.spec]
                if round_ is None:
                    round_ = [len(out), item.op, [], []]
                    out.append(None)  # the round's Exchange, filled in when it closes
                round_[2 if spec.op == "send" else 3].append(spec.nbytes)
                in_round.add(item.op)
            elif type(item) is Issue:
                following = program[n + 1] if n + 1 < len(program) else None
                if self._compile_issue(out, item, following):
                    waited_at_once.add(item.op)
            elif item.op in in_round:
                out.append(Wait(round_[1]))
                self._close_round(out, round_, step)
                folded |= in_round
                round_, in_round = None, set()
            elif item.op in waited_at_once:
                waited_at_once.discard(item.op)
            elif item.op not in folded:
                out.append(item)
        if round_ is not None:  # never waited on: the step's end waits for it
            self._close_round(out, round_, step)
        return out

    @staticmethod
    def _close_round(out: list[Step], round_: list, step: int) -> None:
        at, op, sent, received = round_
        out[at] = Exchange(op, step, float(max(sent, default=0)), float(max(received, default=0)),
                           len(sent), len(received))

    def _compile_streamed(self, out: list[Step], item: Issue) -> None:
        """Append a streamed op: its InterOp or IntraOp, started after the ops it follows."""
        inner: list[Step] = []
        # No following Wait: a streamed op is never folded into a plain delay of the program.
        self._compile_issue(inner, item._replace(after=None), None)
        out.append(StreamOp(item.op, item.after, inner[0]))

    def _compile_issue(self, out: list[Step], item: Issue, following: Item | None) -> bool:
        """Append the steps of one issued op; True if it became a plain delay (drop its wait)."""
        if item.after is not None:
            self._compile_streamed(out, item)
            return False
        spec = self.specs[item.spec]
        p, volume = self._volume(item.spec)
        if spec.inter:
            out.append(InterOp(item.op, item.spec, volume))
            return False
        seconds = item.recorded_s if self.intra == "recorded" else volume.time(self.topo.intra)
        if p == 1 and spec.size > 1:
            # The recorded node's group is one rank on the target (1 accelerator per node): a
            # collective of one moves nothing, so FSDP2's intra-node traffic is gone, not kept.
            seconds = 0.0
        if p > 1 and spec.op not in P2P_OPS:
            # A real collective holds every member until the last one arrives; a plain delay
            # would let a node's positions drift a step apart, and the one ahead would then use
            # the shared NIC alone while the other is still behind.
            out.append(IntraOp(item.op, item.spec, seconds))
            return False
        if type(following) is Wait and following.op == item.op:
            self._add_delay(out, 0.0, seconds)
            return True
        out.append(IntraOp(item.op, None, seconds))
        return False

    @staticmethod
    def _add_delay(out: list[Step], compute: float, fixed: float) -> None:
        if out and type(out[-1]) is Delay:
            last = out[-1]
            out[-1] = Delay(last.compute_s + compute, last.fixed_s + fixed)
        else:
            out.append(Delay(compute, fixed))

    # -- meetings and transfers ---------------------------------------------------------------
    def _nic(self, c: int, j: int) -> SharedLink:
        return self.nics[(c, j)] if self.topo.nic == "per-accelerator" else self.nics[c]

    def _members(self, spec: OpSpec, j: int) -> tuple[tuple, int]:
        """Rendezvous key and member count of an inter-node op issued at position j."""
        n_classes = len(self.classes)
        g, g_rec = self.topo.accelerators_per_node, self.recorded.accelerators_per_node
        if spec.scope == "replicate":
            return ("rep", j), n_classes
        if spec.scope == "world":
            return ("world",), n_classes * g
        count = sum(1 for jj in range(g) if jj % g_rec in spec.positions)
        return ("other", spec.positions), n_classes * count

    def _meet(self, key: tuple, n_members: int, counters: dict) -> list:
        """Count one arrival at the next meeting of `key`: [arrived, done event, longest time]."""
        occurrence = counters[key]
        counters[key] += 1
        return self._arrive(key, occurrence, n_members)

    def _arrive(self, key: tuple, occurrence: int, n_members: int) -> list:
        """Count one arrival at meeting `occurrence` of `key`: [arrived, done event, longest]."""
        entry = self.rendezvous.setdefault((key, occurrence), [0, self.env.event(), 0.0])
        entry[0] += 1
        if entry[0] == n_members:
            del self.rendezvous[(key, occurrence)]
        return entry

    def _launch(
        self, spec: OpSpec, volume: CollectiveVolume, j: int, counters: dict
    ) -> simpy.Event:
        key, n_members = self._members(spec, j)
        entry = self._meet(key, n_members, counters)
        if entry[0] == n_members:
            self.env.process(self._collective(spec, volume, j, entry[1]))
        return entry[1]

    def _launch_streamed(
        self, item: StreamOp, pending: dict, c: int, j: int, counters: dict
    ) -> simpy.Event:
        """Start a streamed op once the ops it follows are done; its meeting is booked now."""
        before = [pending[op] for op in item.after if op in pending]
        return self._launch_after(item.inner, before, c, j, counters)

    def _launch_after(
        self, inner: InterOp | IntraOp, before: list, c: int, j: int, counters: dict
    ) -> simpy.Event:
        """Start op `inner` once the `before` events are done; its meeting is booked now."""
        if type(inner) is InterOp:
            spec = self.specs[inner.spec]
            key, n_members = self._members(spec, j)
        elif inner.spec is not None:
            spec = self.specs[inner.spec]
            key, n_members = self._intra_members(spec, c, j)
        else:  # a group of one: a plain duration on the stream
            return self.env.process(self._after(before, lambda: self.env.timeout(inner.seconds)))
        occurrence = counters[key]
        counters[key] += 1

        def start() -> simpy.Event:
            if type(inner) is IntraOp:
                return self._arrive_intra(key, occurrence, n_members, inner.seconds,
                                          inner.spec, c)
            entry = self._arrive(key, occurrence, n_members)
            if entry[0] == n_members:
                self.env.process(self._collective(spec, inner.volume, j, entry[1]))
            return entry[1]

        return self.env.process(self._after(before, start))

    def _after(self, before: list, start: Callable[[], simpy.Event]) -> Generator:
        """Wait for the `before` events, then for the event `start()` returns."""
        if before:
            yield self.env.all_of(before)
        yield start()

    def _intra_members(self, spec: OpSpec, c: int, j: int) -> tuple[tuple, int]:
        """Rendezvous key and member count of an intra-node op issued by process (c, j)."""
        g, g_rec = self.topo.accelerators_per_node, self.recorded.accelerators_per_node
        if spec.size == g_rec:
            return ("intra", c), g // self.weight  # whole-node groups grow with the node
        # Smaller groups repeat in blocks of the recorded node size when nodes grow.
        block = j // g_rec
        span = range(block * g_rec, min(g, (block + 1) * g_rec))
        members = sum(1 for jj in span if jj % g_rec in spec.positions)
        return ("intra", c, block, spec.positions), members

    def _launch_intra(
        self, spec_id: int, seconds: float, c: int, j: int, counters: dict
    ) -> simpy.Event:
        key, n_members = self._intra_members(self.specs[spec_id], c, j)
        occurrence = counters[key]
        counters[key] += 1
        return self._arrive_intra(key, occurrence, n_members, seconds, spec_id, c)

    def _arrive_intra(self, key: tuple, occurrence: int, n_members: int,
                      seconds: float, spec_id: int, c: int) -> simpy.Event:
        """Arrive at an intra-node meeting; the last member starts its (longest) duration, or
        on a node standing for several (`Topology.node_span`) its transfer over their NICs."""
        entry = self._arrive(key, occurrence, n_members)
        entry[2] = max(entry[2], seconds)
        if entry[0] == n_members:
            done = entry[1]
            if self.spans_nodes:
                self.env.process(self._across_span(spec_id, c, done))
            else:
                timer = self.env.timeout(entry[2])
                timer.callbacks.append(lambda _event: done.succeed())
        return entry[1]

    def _across_span(self, spec_id: int, c: int, done: simpy.Event) -> Generator:
        """An intra-node collective of a node standing for K nodes: its ring is paced by the
        slower of its hops (`intra`, the link across the K nodes), and the bytes of the hop
        between nodes cross each of their NICs once (K equal flows on the K NICs side by side),
        shared there with the inter-node traffic."""
        _, volume = self._volume(spec_id)
        intra, span = self.topo.intra, self.topo.node_span
        yield self.env.timeout(volume.latency_steps * intra.latency)
        paced = volume.paced_bytes
        flows = [self.env.timeout(paced / intra.effective_bandwidth),
                 self._nic(c, 0).transfer_each(paced, span)]
        if self.ingress is not None:  # a ring's edge also arrives at each node
            flows.append(self._ingress(c, 0).transfer_each(paced, span))
        yield self.env.all_of(flows)
        done.succeed()

    def _collective(
        self, spec: OpSpec, volume: CollectiveVolume, j: int, done: simpy.Event
    ) -> Generator:
        if self.hierarchical:
            yield from self._across_sites(spec, j)
            done.succeed()
            return
        factor, extra = self.op_costs.get(spec.op, (1.0, 0.0)) if spec.inter else (1.0, 0.0)
        yield self.env.timeout(volume.latency_steps * max(0.0, self.path.latency + extra))
        share = 1.0 if spec.scope in ("replicate", "world") else spec.nic_share
        weight = self.weight
        for _ in range(weight):  # each position its op's bytes, summed as one by one
            self.node_egress_bytes += volume.paced_bytes * share
        # An op kind calibrated apart moves its bytes at its own goodput: as if it moved
        # 1/factor times them at the shared one.
        nbytes = volume.paced_bytes / factor
        # Each class moves its bytes through its own NICs; the op ends with the slowest, so a
        # slow link paces the whole ring (every class's NIC carries the same flows).
        flows = []
        for c in range(len(self.classes)):
            if spec.scope == "replicate":
                flows.append(self._nic(c, j).transfer_each(nbytes, weight))
            elif spec.scope == "world":
                # Ring over sorted ranks: each node has one edge leaving it, from its last rank.
                flows.append(self._nic(c, self.topo.accelerators_per_node - 1).transfer(nbytes))
            else:
                flows.append(self._nic(c, j).transfer(nbytes * spec.nic_share))
        if self.ingress is not None:
            # Messages share the arriving direction: a collective moves its bytes both ways.
            for c, flow_bytes in enumerate(self._collective_bytes(spec, nbytes)):
                flows.append(self._ingress(c, j, spec).transfer(flow_bytes))
        yield self.env.all_of(flows)
        done.succeed()

    def _across_sites(self, spec: OpSpec, j: int) -> Generator:
        """A collective over several sites, phase by phase; a phase ends with its slowest site."""
        key = (spec.op, spec.nbytes)
        if key not in self._plans:
            self._plans[key] = hierarchical_plan(spec.op, spec.nbytes, self.topo.sites)
        for phase in self._plans[key]:
            self.node_egress_bytes += phase.nic_bytes[self.class_site[0]]
            yield self.env.all_of([self.env.process(self._site_phase(phase, s, j))
                                   for s in range(len(self.site_members))])

    def _site_phase(self, phase: SitePhase, s: int, j: int) -> Generator:
        """Site s's part of a phase: its latency, then its NIC, uplink and downlink flows."""
        if phase.latency_s[s] > 0:
            yield self.env.timeout(phase.latency_s[s])
        flows = [self._nic(c, j).transfer(phase.nic_bytes[s]) for c in self.site_members[s]]
        flows.append(self.uplinks[s].transfer(phase.up_bytes[s]))
        flows.append(self.downlinks[s].transfer(phase.down_bytes[s]))
        yield self.env.all_of(flows)

    def _collective_bytes(self, spec: OpSpec, nbytes: float) -> list[float]:
        """Bytes each class's NIC carries for a collective (as booked on the egress side)."""
        share = 1.0 if spec.scope in ("replicate", "world") else spec.nic_share
        return [nbytes * share] * len(self.classes)

    def _ingress(self, c: int, j: int, spec: OpSpec | None = None) -> SharedLink:
        if self.topo.nic != "per-accelerator":
            return self.ingress[c]
        if spec is not None and spec.scope == "world":
            return self.ingress[(c, self.topo.accelerators_per_node - 1)]
        return self.ingress[(c, j)]

    def _degree(self, step: int, round_: int) -> int:
        """Peers per node in gossip round `round_` of recorded step index `step` on the target."""
        key = (self.step_numbers[step], round_)
        if key not in self._degree_cache:
            self._degree_cache[key] = int(self.degrees(*key))
        return self._degree_cache[key]

    def _launch_p2p(self, item: Exchange, j: int, round_: int, counters: dict) -> simpy.Event:
        """Start a round of messages; with several node classes they meet, so the slowest paces."""
        _op, step, sent, received, sends, recvs = item
        if self.hierarchical:
            return self._launch_site_p2p(item, j, round_, counters)
        if self.degrees is not None:
            degree = self._degree(step, round_)
            sends, recvs = (degree if sends else 0), (degree if recvs else 0)
        self.p2p_degrees.add(max(sends, recvs))
        entry = self._meet(("p2p", j), len(self.classes), counters)
        if entry[0] == len(self.classes):
            self.env.process(self._exchange(sends, sent, recvs, received, j, entry[1]))
        return entry[1]

    def _launch_site_p2p(self, item: Exchange, j: int, round_: int,
                         counters: dict) -> simpy.Event:
        """A round of messages on sites: the classes meet, then every site's part at once."""
        key = (self.step_numbers[item.step], round_)
        if key not in self._round_cache:
            self._round_cache[key] = self.site_rounds(*key)
        info = self._round_cache[key]
        self.p2p_degrees.add(max(info.peers))
        entry = self._meet(("p2p", j), len(self.classes), counters)
        if entry[0] == len(self.classes):
            sent = item.sent if item.sends else 0.0
            received = item.received if item.recvs else 0.0
            self.node_egress_bytes += info.peers[self.class_site[0]] * sent
            self.env.process(self._site_exchange(info, sent, received, j, entry[1]))
        return entry[1]

    def _site_exchange(self, info: SiteRound, sent: float, received: float, j: int,
                       done: simpy.Event) -> Generator:
        """Every site's messages at once; the round ends with the last site's."""
        yield self.env.all_of([self.env.process(self._site_messages(info, s, sent, received, j))
                               for s in range(len(self.site_members))])
        done.succeed()

    def _site_messages(self, info: SiteRound, s: int, sent: float, received: float,
                       j: int) -> Generator:
        """Site s's part of a round: its busiest node's messages on its classes' NICs, the
        site's remote ones on its uplink and downlink (one weighted flow each), one latency."""
        peers, remote = info.peers[s], info.remote[s]
        flows = []
        for c in self.site_members[s]:
            if peers and sent:
                flows.append(self._nic(c, j).transfer(peers * sent, peers))
            if peers and received:
                flows.append(self._ingress(c, j).transfer(peers * received, peers))
        if remote and sent:
            flows.append(self.uplinks[s].transfer(remote * sent, remote))
        if remote and received:
            flows.append(self.downlinks[s].transfer(remote * received, remote))
        if flows:
            yield self.env.all_of(flows)
            yield self.env.timeout(info.latency_s[s])

    def _exchange(
        self, sends: int, sent: float, recvs: int, received: float, j: int, done: simpy.Event
    ) -> Generator:
        """Every class sends `sends` messages and receives `recvs` at once, then one latency."""
        flows = []
        self.node_egress_bytes += sends * sent
        for c in range(len(self.classes)):
            # One weighted flow per direction: the equal messages share the NIC and end together.
            if sends:
                flows.append(self._nic(c, j).transfer(sends * sent, sends))
            if recvs:
                flows.append(self._ingress(c, j).transfer(recvs * received, recvs))
        if flows:
            yield self.env.all_of(flows)
            yield self.env.timeout(self.path.latency)
        done.succeed()

    # -- the processes ------------------------------------------------------------------------
    def _rank(self, c: int, j: int, n_steps: int) -> Generator:
        factor = self.compute_scale / self.classes[c]
        g_rec = self.recorded.accelerators_per_node
        counters: dict = defaultdict(int)
        env = self.env
        rounds = 0  # gossip rounds so far: a time-varying graph's peers depend on it
        # Ops of earlier steps a later one waits for (carried ids < 0): id -> (event, due step).
        carried: dict[int, tuple[simpy.Event, int]] = {}
        for s in range(n_steps):
            pending: dict[int, simpy.Event] = {}
            # Hot loop: records are unpacked positionally, which is cheaper than by field name.
            for item in self.compiled.get((j % g_rec, s % self.n_recorded), []):
                kind = type(item)
                if kind is Delay:
                    compute_s, fixed_s = item
                    yield env.timeout(compute_s * factor + fixed_s)
                elif kind is InterOp:
                    pending[item.op] = self._launch_inter(item, carried, c, j, counters)
                elif kind is StreamOp:
                    pending[item.op] = self._launch_streamed(item, pending, c, j, counters)
                elif kind is Exchange:
                    pending[item.op] = self._launch_p2p(item, j, rounds, counters)
                    rounds += 1
                elif kind is IntraOp:
                    op, spec, seconds = item
                    pending[op] = (
                        env.timeout(seconds)
                        if spec is None
                        else self._launch_intra(spec, seconds, c, j, counters)
                    )
                elif item.op < 0:
                    if item.op in carried:
                        yield carried.pop(item.op)[0]
                elif item.op in pending:
                    yield pending.pop(item.op)
            yield env.all_of(self._step_end_waits(pending, carried, s))
            if len(self.step_end) <= s:
                self.step_end.append(env.now)
                if self.on_step is not None:  # the first process to end step s counts it
                    self.on_step()
            else:
                self.step_end[s] = max(self.step_end[s], env.now)

    def _launch_inter(self, item: InterOp, carried: dict, c: int, j: int,
                      counters: dict) -> simpy.Event:
        """Start an inter-node op; a carried one (id < 0) after the carried ops in flight."""
        op, spec, volume = item
        if op < 0 and carried:
            # One communicator runs its ops in order: a carried op starts when the earlier ones
            # still in flight have ended (rather than share the link with them).
            return self._launch_after(item, [event for event, _ in carried.values()], c, j,
                                      counters)
        return self._launch(self.specs[spec], volume, j, counters)

    def _step_end_waits(self, pending: dict, carried: dict, s: int) -> list[simpy.Event]:
        """What step s ends by: its ops, and carried ops now due that no program waited for.

        Ops never waited on in the trace still finish within their step. This step's carried
        ops move to `carried`, due Programs.carried steps later; one still there when due (a
        replay cycling past the recording's last step into its first, which waits for none)
        ends this step, and after the last step none is waited for (the run's drain).
        """
        due = [op for op, (_, when) in carried.items() if when <= s]
        ends = [carried.pop(op)[0] for op in due]
        for op in [op for op in pending if op < 0]:
            carried[op] = (pending.pop(op), s + self.carried.get(op, 1))
        return ends + list(pending.values())

    def run(self, n_steps: int, on_step: Callable[[], None] | None = None) -> list[float]:
        """Replay n_steps on every process; returns when each step ended (the slowest process).

        ``on_step`` is called once per step, when the first process has ended it (progress).
        """
        self.on_step = on_step
        for c in range(len(self.classes)):
            for j in range(0, self.topo.accelerators_per_node, self.weight):
                self.env.process(self._rank(c, j, n_steps))
        self.env.run()
        if self.rendezvous:
            raise ValueError(
                "the trace's collectives do not pair up across nodes (some ranks issue ops the "
                "others never do); check that the trace holds every rank of the run."
            )
        return self.step_end
