"""The plan of a recorded method, given that recording's own compute per step, takes the step
time `flexbench simulate` replays from the recording: within 5% on 10 Mbit/s, 1 Gbit/s and
10 Gbit/s (1 ms).

The recording's own compute per step is what its replay counts on a network that takes no
time: the gaps between collectives, each segment waiting for the slowest rank (CPU ranks
jitter, so this is a few percent above the sum of the per-phase medians, `compute_phases`,
which also sets the split between forward+backward and the optimizer step). Gossip is
planned on two nodes, its messages counted by the target graph's degree, as simulate counts
them. Periodic methods (DiLoCo's outer sync every H steps, Streaming DiLoCo's fragment cycle)
compare means over the recording's whole periods, the others the median step. Both sides
price intra-node collectives on the same declared link (`intra="model"`) and overlap FSDP2's
reduces where the recording marks its units.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.plan import plan_method
from experiments.plan.synth import Precision
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from flexdemo.methods import method_record
from netsim import Link, Topology
from netsim.model import ReplayOptions, compute_phases, has_backward_marks, has_unit_marks, simulate

RESULTS = Path(__file__).resolve().parents[2] / "results"
NETWORKS = ("10Mbit", "1Gbit", "10Gbit")
PERIODIC = ("diloco", "streaming-diloco")
UNITS = ["standard/units/hsdp-adamw-s0", "standard/units/flexdemo-s0",
         "standard/units/demo-chunking=flat_topk=4-s0", "standard/units/diloco-s0",
         "quick/units/hsdp-adamw-s0", "quick/units/flexdemo-s0",
         "quick/units/flexdemo-decay=0.9-s0", "quick/units/demo-chunking=flat_topk=4-s0",
         "quick/units/diloco-s0", "overlap/units/streaming-diloco-s0",
         "overlap/units/flexdemo-async-lookahead=True-s0",
         # Gossip, planned on two nodes with the target graph's degree, against its replay.
         "decentralized/units/gossip-nodes=4_graph=ring-s0",
         "decentralized/units/gossip-nodes=8_graph=torus-s0",
         "decentralized-scale/units/gossip-nodes=16_graph=one-peer-exponential-s0",
         "decentralized-scale/units/gossip-nodes=16_graph=sites_4-s0"]


@pytest.mark.parametrize("unit", UNITS)
def test_plan_step_time_is_simulate_s_within_5_percent(unit):
    run = read_run(RESULTS / unit)
    config = json.loads((run.path / "run.json").read_text())["config"]
    model = declare_model(config["workload"])
    record = method_record(config["method"])
    knobs, _ = record.settings({k: config[k] for k in record.takes if k in config})
    overlap = "fsdp2" if has_unit_marks(run.trace) else "recorded"
    shape = (int(config["nodes"]), int(config["gpus_per_node"]))

    def typical(times):
        return times.mean() if record.name in PERIODIC else times.median()

    instant = Link(1e15, 0.0)
    own = float(typical(simulate(run.trace, Topology(*shape, instant, instant),
                                 ReplayOptions(intra="model",
                                 overlap=overlap)).frame["step_time_s"]))
    # Recordings without a "backward" mark: their compute all forward and backward.
    fb, opt = compute_phases(run.trace) if has_backward_marks(run.trace) else (1.0, 0.0)
    scale = own / (fb + opt)
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))],
                            fb * scale, opt * scale)
    topologies = [Topology.from_strings(*shape, bw, 1e-3, "100GB/s", "5us") for bw in NETWORKS]
    plan = plan_method(record, knobs, model, topologies, list(NETWORKS), compute,
                       Precision("fp32", "fp32"), backend="gloo")
    for bw, point in zip(NETWORKS, plan.points, strict=True):
        replayed = replay(run, ReplayTarget(inter_bw=bw, inter_lat="1ms", intra="model",
                                            overlap=overlap))
        simulated = float(typical(replayed.frame["step_time_s"]))
        assert point.step_time_s == pytest.approx(simulated, rel=0.05), (bw, simulated)
