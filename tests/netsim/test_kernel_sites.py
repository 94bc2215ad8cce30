"""Kernel-shaped sites: a bridge per site, its uplink and downlink tbf shared by the site's
traffic to the others, asymmetric rates; traffic inside a site never crosses them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from netsim import kernel
from netsim.units import parse_bandwidth

_REASON = kernel.unavailable_reason()
needs_kernel = pytest.mark.skipif(_REASON is not None, reason=f"kernel shaping: {_REASON}")
PAYLOAD = 2 << 20
PORT = 29600

# Node `to` listens, node `frm` sends PAYLOAD bytes to it over TCP, both inside the namespaces.
SERVER = f"""
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT}))
s.listen(1)
c, _ = s.accept()
n = 0
while b := c.recv(1 << 16):
    n += len(b)
print(n)
"""
CLIENT = f"""
import socket, sys, time
for _ in range(100):  # until the server listens
    try:
        c = socket.create_connection((sys.argv[1], {PORT}), timeout=60)
        break
    except OSError:
        time.sleep(0.1)
c.sendall(bytes({PAYLOAD}))
c.close()
"""


def _send(net: kernel.KernelNetwork, frm: int, to: int) -> None:
    server = net.start(to, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    client = net.start(frm, [sys.executable, "-c", CLIENT, net.address(to)])
    try:
        assert client.wait(timeout=90) == 0
        out, _ = server.communicate(timeout=30)
    finally:
        kernel.stop([server, client])
    assert int(out) == PAYLOAD


@pytest.mark.dist
@needs_kernel
@pytest.mark.timeout(240)
def test_site_uplinks_and_downlinks_carry_only_traffic_between_sites():
    mbit = parse_bandwidth("1Mbit")
    tc = kernel.TcSettings
    sites = [kernel.SiteTc((0, 1), tc(40 * mbit), tc(80 * mbit)),
             kernel.SiteTc((2, 3), tc(20 * mbit), tc(160 * mbit))]
    inside = {k: tc(200 * mbit) for k in range(4)}
    net = kernel.KernelNetwork(4, tc(20 * mbit), node_settings=inside, sites=sites)
    with net:
        rates = {dev: subprocess.run(["tc", "-n", net.hub, "qdisc", "show", "dev", dev],
                                     capture_output=True, text=True, check=True).stdout
                 for dev in ("u0", "c0", "u1", "c1", "v2")}
        _send(net, 0, 1)  # inside site 0
        inside_only = net.sent_bytes()
        _send(net, 0, 2)  # site 0 -> site 1
        after = net.sent_bytes()
    assert "rate 40Mbit" in rates["u0"] and "rate 80Mbit" in rates["c0"]
    assert "rate 20Mbit" in rates["u1"] and "rate 160Mbit" in rates["c1"]
    assert "rate 200Mbit" in rates["v2"]
    # Inside a site: node 0's link out, node 1's in; the site's uplink saw no payload.
    assert inside_only["n0"] >= PAYLOAD and inside_only["v1"] >= PAYLOAD
    assert inside_only["u0"] < PAYLOAD // 10, inside_only
    # Across: out of site 0 by its uplink, into site 1 by its downlink; ACKs only back.
    crossed = {k: after[k] - inside_only[k] for k in after}
    assert crossed["u0"] >= PAYLOAD and crossed["c1"] >= PAYLOAD, crossed
    assert crossed["u1"] < PAYLOAD // 10 and crossed["c0"] < PAYLOAD // 10, crossed
    assert kernel.our_namespaces() == [] or all(
        int(n.split("-")[1]) != os.getpid() for n in kernel.our_namespaces())
