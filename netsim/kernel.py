"""Kernel-shaped links: one network namespace per emulated node, Linux traffic control between.

The third way to make a link slow, next to netsim's `wall` and `virtual` shaping, and the one
the other two are checked against: real TCP through real queues, shaped by the kernel.

Layout of one run (`run_id` = creating pid + a random tag, so stale namespaces can be told apart):

    fbk-<pid>-<tag>-hub   bridge br0; one port v<k> per node, tbf on its egress (into node k)
    fbk-<pid>-<tag>-n<k>  lo and eth0 (the other end of v<k>), address 10.77.0.<k+1>/24,
                          tbf on eth0's egress (out of node k); netem delay there where present

Sites (`sites`, a list of `SiteTc`): the hub then holds one bridge s<i> per site, which its nodes'
ports join, and a veth pair per site between its bridge (end u<i>) and br0 (end c<i>): tbf on
u<i>'s egress is the site's uplink, on c<i>'s its downlink, each shared by all traffic between
that site and the others (traffic inside a site never crosses them). Latency between sites is
not laid (refused by the launcher).

Both qdiscs of node k use node k's own settings (`node_settings`, else the run's): a packet from
node a to node b passes a's rate and delay on the way out and b's rate on the way in, so a pair
runs at the slower of the two rates and a ring at its slowest member's.

Every inter-node packet leaves its node through eth0 and enters the other node through the
hub's port, so both directions of a node's link run at the configured rate. Ranks of one node
share its namespace; traffic between them is addressed to the namespace's own eth0 address,
which the kernel routes over the namespace's loopback, so it never meets a qdisc. Addresses
exist only inside the run's namespaces, which have no default route and no interface outside
them: nothing can leave the machine, and runs side by side reuse the same addresses safely.

Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root): namespaces are made with `ip netns`, qdiscs with
`tc`. A launcher that dies leaves its namespaces behind; `clean_stale()` (called by every
`create()`) deletes namespaces of ours whose creating process is gone, never anyone else's.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netsim.processes import pid_alive

__all__ = [
    "PREFIX", "INTERFACE", "MASTER_PORT", "KernelShapingError", "TcSettings", "KernelNetwork",
    "SiteTc",
    "check_privileges", "has_netem", "clean_stale", "our_namespaces", "unavailable_reason",
    "stop",
]

PREFIX = "fbk-"
INTERFACE = "eth0"  # a node namespace's link to the hub: gloo binds here (GLOO_SOCKET_IFNAME)
MASTER_PORT = 29500  # free by construction: every run's namespaces are new
_SUBNET = "10.77.0"  # inside the namespaces only; each run has its own isolated copy
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)-(hub|n\d+|probe)$")
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_CMD_TIMEOUT_S = 30.0


class KernelShapingError(ValueError):
    """Kernel shaping cannot run here (privileges, tools, a setting the kernel cannot apply)."""


@dataclass(frozen=True)
class TcSettings:
    """The traffic-control settings of every node link (rate in bytes/s, delay in seconds)."""

    rate_bps: float
    delay_s: float = 0.0
    # Jumbo frames, as on the datacenter links between nodes these runs stand for. At 1500 the
    # kernel handles six times the packets, and on a loaded 2-core machine that per-packet CPU
    # cost, not the link, set goodput to anything from 76% to 96% of the rate (9000: 95-99%).
    mtu: int = 9000

    @property
    def burst_bytes(self) -> int:
        """tbf bucket: one full frame, plus 1 ms of rate at high rates for timer slack.

        A bucket is credit an idle link hands the next message for free: the 64 KiB bucket that
        a GSO packet needs let a 32 KiB all-reduce through a 20 Mbit/s link in 1 ms instead of
        13 ms, which no link does. GSO is off on our interfaces (`gso_max_size` = MTU), so one
        frame suffices; the credit is then under 8 ms at 10 Mbit/s and 0.4 ms at 200 Mbit/s.
        """
        return max(self.mtu + 1024, int(self.rate_bps * 0.001))

    @property
    def limit_bytes(self) -> int:
        """tbf queue: deep enough that TCP's window never overflows it (no drops, no timeouts).

        A 500 kB queue dropped packets of 2 MiB all-gathers at 20 Mbit/s, and each retransmit
        timeout cost 200 ms: 48% over the link's time. A link emulation wants the rate, not loss.
        """
        return max(64 << 20, int(self.rate_bps * 0.5))

    def tbf(self) -> list[str]:
        """`tc qdisc add` arguments after the parent: a token bucket at the rate."""
        return ["tbf", "rate", f"{int(self.rate_bps * 8)}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]

    def describe(self) -> dict:
        """What run.json records about the kernel's shaping."""
        return {"qdisc": "tbf", "rate_bit_s": int(self.rate_bps * 8),
                "burst_bytes": self.burst_bytes, "limit_bytes": self.limit_bytes,
                "netem_delay_s": self.delay_s or None, "mtu": self.mtu,
                "where": f"egress of each node's {INTERFACE} and of its port on the hub bridge"}


@dataclass(frozen=True)
class SiteTc:
    """A site of a kernel-shaped run: its nodes, and the tc settings of its uplink and downlink."""

    nodes: tuple[int, ...]
    up: TcSettings
    down: TcSettings


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """One `ip`/`tc` command; a failure raises KernelShapingError with the kernel's own words."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise KernelShapingError(f"`{' '.join(args)}` failed: {why[-1] if why else 'no output'}.")
    return proc


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges() -> None:
    """Raise KernelShapingError (one sentence) unless namespaces and qdiscs can be made here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise KernelShapingError(
            f"--shaping kernel needs the iproute2 tools, and {' and '.join(missing)} "
            "is not on the PATH.")
    try:
        caps = _effective_caps()
    except OSError:
        raise KernelShapingError("--shaping kernel needs Linux network namespaces "
                                 "(/proc/self/status is not readable here).") from None
    lacking = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                      (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
    if lacking:
        raise KernelShapingError(
            f"--shaping kernel needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN to make network "
            f"namespaces and qdiscs), and this process lacks {' and '.join(lacking)}.")


def our_namespaces() -> list[str]:
    """Every namespace on this machine whose name follows our pattern (any creator)."""
    proc = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME.match(n)]


def clean_stale() -> list[str]:
    """Delete our namespaces whose creating process is gone; return their names."""
    removed = []
    for name in our_namespaces():
        pid = int(_NAME.match(name).group(1))  # type: ignore[union-attr]
        if pid != os.getpid() and not pid_alive(pid):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def has_netem() -> bool:
    """Whether this kernel has netem: add one to a throwaway namespace's loopback, then delete."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    _run(["ip", "netns", "add", name])
    try:
        added = _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem",
                      "delay", "1ms"], check=False)
        return added.returncode == 0
    finally:
        _run(["ip", "netns", "del", name], check=False)


def unavailable_reason() -> str | None:
    """Why kernel shaping cannot run here (tested by making and deleting a namespace), or None."""
    try:
        check_privileges()
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
        _run(["ip", "netns", "add", name])
        _run(["ip", "netns", "del", name])
    except (KernelShapingError, OSError, subprocess.SubprocessError) as err:
        return str(err)
    return None


def stop(procs: Iterable[subprocess.Popen]) -> None:
    """Kill the session of each process that still runs (each in a session of its own, as
    `KernelNetwork.start` makes them); reap all."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its session: the process and what it started
            except ProcessLookupError:
                pass
        p.wait()


class KernelNetwork:
    """The namespaces, veth pairs, bridge and qdiscs of one run; `with` deletes them all."""

    def __init__(self, nodes: int, settings: TcSettings, run_id: str | None = None,
                 node_settings: dict[int, TcSettings] | None = None,
                 sites: Sequence[SiteTc] = ()) -> None:
        """Plan (not yet make) a star of `nodes` namespaces around a hub bridge.

        node_settings: {node: TcSettings} for nodes whose link differs from `settings`.
        sites: the nodes grouped into sites with a shared uplink and downlink each (module
        docstring); every node in exactly one.
        """
        self.sites = tuple(sites)
        placed = sorted(k for site in self.sites for k in site.nodes)
        if self.sites and placed != list(range(nodes)):
            raise KernelShapingError(f"kernel shaping's sites must hold nodes 0..{nodes - 1} "
                                     f"each once, got {placed}.")
        if nodes < 1:
            raise KernelShapingError(f"kernel shaping needs at least 1 node, got {nodes}.")
        self.node_settings = dict(node_settings or {})
        outside = sorted(k for k in self.node_settings if not 0 <= k < nodes)
        if outside:
            raise KernelShapingError(f"kernel shaping got settings for node {outside[0]}, "
                                     f"outside the run's nodes 0..{nodes - 1}.")
        links = [s for site in self.sites for s in (site.up, site.down)]
        for each in (settings, *self.node_settings.values(), *links):
            if not each.rate_bps > 0:
                raise KernelShapingError(f"kernel shaping needs a positive rate, got "
                                         f"{each.rate_bps} bytes/s.")
        self.nodes = nodes
        self.settings = settings
        self.run_id = run_id or f"{os.getpid()}-{secrets.token_hex(3)}"
        self.hub = f"{PREFIX}{self.run_id}-hub"
        self._made: list[str] = []

    def settings_for(self, node: int) -> TcSettings:
        """The tc settings of node `node`'s link (both of its qdiscs)."""
        return self.node_settings.get(node, self.settings)

    def describe_nodes(self) -> dict[str, dict]:
        """Rate and delay of each node with settings of its own (for run.json); {} if uniform."""
        return {str(k): {"rate_bit_s": int(s.rate_bps * 8), "netem_delay_s": s.delay_s or None}
                for k, s in sorted(self.node_settings.items())}

    def namespace(self, node: int) -> str:
        """The namespace that node `node`'s ranks run in."""
        return f"{PREFIX}{self.run_id}-n{node}"

    def address(self, node: int) -> str:
        """Node `node`'s address on its eth0 (node 0's hosts the rendezvous)."""
        return f"{_SUBNET}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        """Command prefix that runs a program inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def rendezvous_env(self) -> dict[str, str]:
        """torchrun's rendezvous variables for this run: node 0's address, our port, eth0."""
        return {"MASTER_ADDR": self.address(0), "MASTER_PORT": str(MASTER_PORT),
                "GLOO_SOCKET_IFNAME": INTERFACE}

    def start(self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **popen_kwargs: Any) -> subprocess.Popen:
        """Start `argv` inside node `node`'s namespace, in a session of its own (see `stop`).

        env: the process's environment (default: ours), with `rendezvous_env()` laid over it.
        popen_kwargs: the rest of `subprocess.Popen`'s arguments (stdin, stdout, stderr, text).
        """
        # A fresh process is the only way in: Python 3.11 has no os.setns, and setns in a
        # process that already runs threads (torch starts some at import) does not move them.
        # Its own session, so that `stop` kills whatever it starts in turn.
        return subprocess.Popen([*self.exec_prefix(node), *argv],
                                env={**(os.environ if env is None else env),
                                     **self.rendezvous_env()},
                                start_new_session=True, **popen_kwargs)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this run (hub first)."""
        return [self.hub] + [self.namespace(k) for k in range(self.nodes)]

    def create(self) -> KernelNetwork:
        """Clean stale namespaces of ours, then make this run's; on any failure delete them."""
        clean_stale()
        try:
            self._add_namespace(self.hub)
            self._ip(self.hub, "link", "add", "br0", "type", "bridge")
            self._ip(self.hub, "link", "set", "br0", "up")
            for s in range(len(self.sites)):
                self._add_site(s)
            for node in range(self.nodes):
                self._add_node(node)
        except BaseException:
            self.delete()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        self._ip(name, "link", "set", "lo", "up")

    def _bridge_of(self, node: int) -> str:
        """The hub bridge node `node`'s port joins: its site's, or br0 without sites."""
        for s, site in enumerate(self.sites):
            if node in site.nodes:
                return f"s{s}"
        return "br0"

    def _add_site(self, s: int) -> None:
        """Site s's bridge, and its uplink (u<s>) and downlink (c<s>) to br0."""
        bridge, up, down = f"s{s}", f"u{s}", f"c{s}"
        self._ip(self.hub, "link", "add", bridge, "type", "bridge")
        self._ip(self.hub, "link", "set", bridge, "up")
        self._ip(self.hub, "link", "add", up, "type", "veth", "peer", "name", down)
        gso = ["gso_max_size", str(self.settings.mtu), "gso_max_segs", "1"]
        for dev, master in ((up, bridge), (down, "br0")):
            self._ip(self.hub, "link", "set", dev, "master", master, "mtu",
                     str(self.settings.mtu))
            self._ip(self.hub, "link", "set", dev, *gso)
            self._ip(self.hub, "link", "set", dev, "up")
        self._shape(self.hub, up, self.sites[s].up, delay=False)
        self._shape(self.hub, down, self.sites[s].down, delay=False)

    def _add_node(self, node: int) -> None:
        ns, port = self.namespace(node), f"v{node}"
        self._add_namespace(ns)
        # Made in the hub, then one end moved: interface names only need to be unique per
        # namespace, so every node's end can be called eth0.
        self._ip(self.hub, "link", "add", port, "type", "veth", "peer", "name", INTERFACE,
                 "netns", ns)
        # One MTU on the whole bridge: ports of differing MTUs would drop jumbo frames.
        self._ip(self.hub, "link", "set", port, "master", self._bridge_of(node), "mtu",
                 str(self.settings.mtu))
        self._ip(self.hub, "link", "set", port, "up")
        self._ip(ns, "link", "set", INTERFACE, "mtu", str(self.settings.mtu))
        # No GSO super-packets: frames of one MTU keep the tbf bucket at one frame (burst_bytes).
        gso = ["gso_max_size", str(self.settings.mtu), "gso_max_segs", "1"]
        self._ip(self.hub, "link", "set", port, *gso)
        self._ip(ns, "link", "set", INTERFACE, *gso)
        self._ip(ns, "addr", "add", f"{self.address(node)}/24", "dev", INTERFACE)
        self._ip(ns, "link", "set", INTERFACE, "up")
        # A collective follows the compute after an idle gap; by default TCP then restarts from
        # its initial window, and every ACK waits behind the other direction's data in the
        # deep queue: a 2 MiB all-gather took 1.5x its time at 20 Mbit/s. Keep the window.
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
              "net.ipv4.tcp_slow_start_after_idle=0"])
        self._shape(ns, INTERFACE, self.settings_for(node), delay=True)
        self._shape(self.hub, port, self.settings_for(node), delay=False)

    def _shape(self, ns: str, dev: str, settings: TcSettings, delay: bool) -> None:
        """tbf at the rate; with a delay, netem at the root and the tbf under it."""
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        if delay and settings.delay_s > 0:
            # Only on the node side: every inter-node packet leaves exactly one node, so it is
            # delayed once, the one-way latency the cost model calls inter_lat.
            _run(tc + ["root", "handle", "1:", "netem", "delay",
                       f"{settings.delay_s * 1e6:.0f}us"])
            _run(tc + ["parent", "1:1", "handle", "10:"] + settings.tbf())
        else:
            _run(tc + ["root", "handle", "1:"] + settings.tbf())

    def _ip(self, ns: str, *args: str) -> None:
        _run(["ip", "-n", ns, *args])

    def sent_bytes(self) -> dict[str, int]:
        """Bytes each shaped qdisc has sent so far ("n<k>" out of node k, "v<k>" into it; with
        sites "u<s>" out of site s, "c<s>" into it)."""
        where = [(ns, dev, key) for node in range(self.nodes)
                 for ns, dev, key in ((self.namespace(node), INTERFACE, f"n{node}"),
                                      (self.hub, f"v{node}", f"v{node}"))]
        where += [(self.hub, dev, dev) for s in range(len(self.sites))
                  for dev in (f"u{s}", f"c{s}")]
        out = {}
        for ns, dev, key in where:
            stats = _run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev]).stdout
            found = re.search(r"Sent (\d+) bytes", stats)
            out[key] = int(found.group(1)) if found else 0
        return out

    def shaped_rates(self) -> dict[str, float]:
        """The tbf rate tc reports on each node's two qdiscs, in bytes/s ("n<k>", "v<k>")."""
        out = {}
        for node in range(self.nodes):
            for ns, dev, key in ((self.namespace(node), INTERFACE, f"n{node}"),
                                 (self.hub, f"v{node}", f"v{node}")):
                shown = _run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout
                found = re.search(r"tbf .*?rate (\d+(?:\.\d+)?)([kKMG]?)bit", shown)
                if found:  # tc prints SI multiples of bits per second
                    scale = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}[found.group(2)]
                    out[key] = float(found.group(1)) * scale / 8
        return out

    def delete(self) -> None:
        """Delete every namespace this object made (their veths and qdiscs go with them)."""
        while self._made:
            _run(["ip", "netns", "del", self._made.pop()], check=False)

    def __enter__(self) -> KernelNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()
