"""Shaping real gloo groups on sites: a collective across sites takes its hierarchical plan's
time, the site's uplink shared by its nodes (4 ranks: 2 sites x 2 nodes x 1)."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from netsim import Link, Topology, TraceRecorder, shaping
from netsim.sites import hierarchical_plan, parse_sites, plan_time
from tests.dist_utils import init_loopback, spawn

SITES = {
    "site": [{"name": "a", "nodes": 2, "uplink": "80Mbit", "downlink": "160Mbit",
              "intra_bw": "800Mbit", "intra_lat": "1ms"},
             {"name": "b", "nodes": 2, "uplink": "40Mbit", "intra_bw": "400Mbit"}],
    "rtt": {"matrix": [["0ms", "30ms"], ["30ms", "0ms"]]},
}
N_FLOATS = 100_000  # 400 kB


def _ranks(rank: int, world: int, store: str, out: str) -> None:
    init_loopback(rank, world, store)
    topo = Topology.on_sites(parse_sites(SITES), 1, Link("100GB/s"))
    rec = TraceRecorder(rank)
    shaping.install(topo, "virtual", rec, run_dir=out)
    everyone = dist.new_group([0, 1, 2, 3], backend=shaping.BACKEND)
    x = torch.full((N_FLOATS,), float(rank + 1))
    for step in range(2):
        rec.begin_step(step)
        dist.all_reduce(x, group=everyone)
        gathered = [torch.empty(N_FLOATS) for _ in range(world)]
        dist.all_gather(gathered, x, group=everyone)
        rec.end_step(step)
    rows = rec.frame().query("kind == 'collective'")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"ops": rows["op"].tolist(), "modeled": rows["modeled_s"].tolist(),
                   "value": x[0].item()}, fh)
    shaping.teardown()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_shaped_collectives_across_sites_take_their_plans_time(tmp_path):
    world = 4
    spawn(_ranks, (world, str(tmp_path / "store"), str(tmp_path)), world)
    sites = parse_sites(SITES)
    nbytes = 4 * N_FLOATS
    want = {op: plan_time(hierarchical_plan(op, nbytes, sites), sites)
            for op in ("all_reduce", "all_gather")}
    # The uplink of site b (40 Mbit/s) sets the pace across: 2 x 15 ms + 400 kB / 5 MB/s.
    assert want["all_reduce"] > 2 * 0.015 + nbytes / 5e6
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["value"] == 40.0  # 1 + 2 + 3 + 4 = 10, all-reduced again: 40
        assert res["ops"] == ["all_reduce", "all_gather"] * 2
        expected = [want["all_reduce"], want["all_gather"]] * 2
        # Times are absolute (epoch seconds) in float64: a microsecond is their resolution.
        assert res["modeled"] == pytest.approx(expected, rel=0, abs=1e-6), (r, res)
