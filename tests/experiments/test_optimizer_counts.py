"""One counter: what FlexDeMo reports for a step equals what netsim recorded crossing nodes.

Two nodes × one rank over gloo; the replication group is made with netsim's counting backend,
as a run makes it (experiments/run/train.py), so every byte that crosses is recorded from the
tensors actually sent. ``opt.last_step_comm`` must agree with that record, step by step.
"""

import pytest
import torch
import torch.distributed as dist

from flexdemo import (
    AdaReplicator,
    DeMoReplicator,
    DiLoCoReplicator,
    FlexDeMo,
    FullReplicator,
    RandomReplicator,
    StreamingDiLoCoReplicator,
    StridingReplicator,
)
from netsim import Link, Topology, TraceRecorder, shaping
from tests.dist_utils import run_ranks

CASES = {
    "demo bf16": lambda: DeMoReplicator(topk=5, chunk=6),
    "demo fp32, every 2nd step": lambda: DeMoReplicator(topk=5, chunk=6,
                                                        value_dtype=torch.float32,
                                                        replicate_every=2),
    "full": FullReplicator,
    "random": lambda: RandomReplicator(rate=0.3),
    "striding": lambda: StridingReplicator(rate=0.3, chunk=4),
    "diloco": lambda: DiLoCoReplicator(diloco_h=2),
    # An all-reduce waited on a step after it is posted; then the all-gather of 4-bit codes.
    "streaming-diloco fp32, delay 1": lambda: StreamingDiLoCoReplicator(
        sync_every=4, num_fragments=2, fragment_sync_delay=1),
    "streaming-diloco 4bit": lambda: StreamingDiLoCoReplicator(
        sync_every=2, num_fragments=2, fragment_sync_delay=0, outer_format="4bit"),
    # Gossip with the complete graph of 2 nodes, plus the spread all-reduce every 2nd round.
    "ada": lambda: AdaReplicator(ada_every=2),
}
STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))


def _recorded(recorder: TraceRecorder, step: int) -> dict[str, int]:
    """This rank's inter-node collectives of ``step`` in netsim's trace."""
    trace = recorder.frame()
    rows = trace[(trace["step"] == step) & (trace["kind"] == "collective") & trace["inter"]]
    return {"bytes_sent": int(rows["bytes_sent"].sum()),
            "bytes_received": int(rows["bytes_received"].sum()), "calls": len(rows)}


def _agree(rank, world):
    recorder = TraceRecorder(rank)
    shaping.install(Topology(nodes=world, accelerators_per_node=1, intra=Link("100Gbit"),
                             inter=Link("1Gbit")), mode="off", recorder=recorder)
    try:
        group = dist.new_group(list(range(world)), backend=shaping.BACKEND)
        step = 0
        for name, make in CASES.items():
            model = _model()
            opt = FlexDeMo(model.parameters(), lr=0.01, replicator=make(),
                           replication_group=group)
            communicated = 0
            for _ in range(STEPS):
                step += 1
                g = torch.Generator().manual_seed(step * 10 + rank)
                x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
                recorder.begin_step(step)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                recorder.end_step(step)
                assert opt.last_step_comm == _recorded(recorder, step), (name, step)
                communicated += opt.last_step_comm["calls"]
            opt.drain()
            assert communicated > 0, name  # each case really crossed nodes
    finally:
        shaping.uninstall()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_last_step_comm_equals_netsim_record():
    run_ranks(_agree, 2)
