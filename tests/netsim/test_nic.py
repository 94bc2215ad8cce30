"""NIC reservation timelines shared through a file, and the ring's NIC share."""

import pytest

from netsim import Topology
from netsim.nic import Timeline
from netsim.topology import ring_nic_share


def test_two_handles_on_one_file_queue_behind_each_other(tmp_path):
    path = tmp_path / "node0.nic"
    first, second = Timeline(path), Timeline(path)  # as two processes of one node would
    assert first.reserve(10.0, 1e6, 1e6, 1e6) == pytest.approx(11.0)
    assert second.reserve(10.0, 1e6, 0.0, 1e6) == pytest.approx(12.0)  # egress busy until 11
    assert second.reserve(10.5, 0.0, 0.5e6, 1e6) == pytest.approx(11.5)  # ingress free at 11
    assert first.reserve(20.0, 1e6, 1e6, 1e6) == pytest.approx(21.0)  # idle again later
    private = Timeline()
    assert private.reserve(10.0, 1e6, 0.0, 1e6) == pytest.approx(11.0)
    first.close()
    second.close()


def test_ring_nic_share():
    topo = Topology.from_strings(2, 2)
    assert ring_nic_share([0, 2], topo) == 1.0  # one rank per node: all traffic crosses
    assert ring_nic_share([0, 1, 2, 3], topo) == 0.5  # 2 of 4 ring edges cross nodes
    assert ring_nic_share([0, 1], topo) == 0.0
