"""SimPy cluster model: replay a recorded trace on any topology and predict per-step times.

How it scales: nodes with the same speed and link behave identically, so the model runs one
SimPy process per (node class, accelerator position) instead of one per rank, and one NIC per
class at that class's link (per class and position with nic="per-accelerator"). A collective is
one rendezvous of its member processes followed by its latency steps and a processor-shared
transfer of its wire bytes over the NICs; ring phases are aggregated analytically. Cost
therefore grows with steps x accelerators_per_node x node classes x events per step, and not
with the node count.

Point-to-point messages (gossip) are not collectives: a round of a node's messages is one
exchange with its neighbours, with no rendezvous of all nodes, priced on the node's NIC egress
and ingress by the target graph's degree (`simulate(degrees=...)`). On a vertex-transitive graph
every node does the same at the same time, so the class's process stands for all its nodes and
a step's cost grows with the degree, not with the node count (P2P_NOTE).

Assumptions (also returned in the result's `Replay.note`):
- Compute between a rank's collectives (gaps in its trace where it was not blocked in wait()) is
  the per-step compute; it is scaled by compute_scale and divided by the node's speed. Explicit
  "compute" rows are informational: the gaps already hold them. Only the "train" phase is
  replayed (evaluation is left out), and traffic outside a step's begin/end span is left out.
  A warm-up step is replayed like any other; drop it from the trace to leave it out.
- Per-node links (`Topology.node_links`): every inter-node op spans all nodes, pays the largest
  member latency per hop and ends when its slowest NIC has moved its bytes, so the slowest link
  paces it.
- Payload sizes and the per-step program are kept from the recorded run when nodes, accelerators
  or steps grow (weak scaling); steps beyond the recording cycle through the recorded steps.
- Inter-node groups with one rank per node that span all recorded nodes span all target nodes;
  groups of all ranks span all target ranks; intra-node ops start when their node's members
  have all arrived and then take their closed-form time (or, with intra="recorded", the time
  their last-arriving member recorded, which holds no wait for peers). On a node standing for
  K nodes (`Topology.node_span`, a replica spanning them) a modeled intra-node op's ring edge
  between nodes crosses each of their NICs once, sharing them with the inter-node flows.

Per-phase compute (`simulate(phase_seconds=...)`): the "backward" mark splits each step's
compute into forward+backward and optimizer; given seconds per step for each (a compute profile
measured on the target's accelerator), each phase is scaled to them (`Replay.phases`).

FSDP2 overlap (`simulate(overlap="fsdp2")`, OVERLAP_NOTE): runs mark where each FSDP2 unit's
backward ends; each unit's gradient reduce-scatter and all-reduce then run on per-rank streams
alongside the next unit's backward, and the optimizer step waits for them all. "recorded" (the
default) keeps the trace's order, which on CPU gloo is serial.

Ops carried into a later step (CARRY_NOTE): an op waited on after its own step ended (an
exchange a method overlaps with the next step's compute, flexdemo-async) is issued where
recorded and waited on where the trace waited, in the later step; a communicator's carried ops
run one after the other.

Where things live: `programs` turns a trace into typed per-step programs, `cluster` compiles and
replays them in SimPy over `shared_link.SharedLink` NICs, `replay.simulate` ties them together.
"""

from netsim.model.replay import (
    CARRY_NOTE,
    MODEL_NOTE,
    OVERLAP_NOTE,
    P2P_NOTE,
    AlgorithmChoice,
    PhaseCompute,
    Replay,
    ReplayOptions,
    algorithm_summary,
    compute_phases,
    has_backward_marks,
    has_unit_marks,
    simulate,
    simulate_each,
)
from netsim.model.shared_link import SharedLink

__all__ = ["SharedLink", "simulate", "simulate_each", "Replay", "ReplayOptions", "AlgorithmChoice",
           "algorithm_summary", "MODEL_NOTE", "P2P_NOTE", "OVERLAP_NOTE", "CARRY_NOTE",
           "has_unit_marks", "has_backward_marks", "PhaseCompute", "compute_phases"]
