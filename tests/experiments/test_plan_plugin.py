"""A method of the user's own is planned from the program its replicator writes: what it sends
and when, from its own knobs, so that changing its schedule changes its plan."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments import cli

# One int8 vote an entry, all-reduced every `every` steps; its program says just that.
SOURCE = '''
from dataclasses import dataclass
import math

import torch
import torch.distributed as dist

from flexdemo import Knobs, Method, Periodic, Replicator
from flexdemo.wire import all_reduce_bytes


@dataclass(frozen=True)
class EveryKnobs(Knobs):
    every: int = 1


class EveryVote(Replicator):
    name = "every-vote"
    knobs_type = EveryKnobs
    owns_updates = True

    def replicates_on(self, step):
        return step % self.every == 0

    def replicate(self, grads, lrs, stats):
        votes = torch.cat([g.reshape(-1) for g in grads]).sign().to(torch.int8)
        dist.all_reduce(votes, group=self.group)
        n = all_reduce_bytes(votes.numel(), self.ranks)
        stats.add(n, n)
        steps = votes.sign().to(grads[0].dtype).split([g.numel() for g in grads])
        return [s.view_as(g) for s, g in zip(steps, grads)]

    @classmethod
    def program(cls, knobs, shard_shapes, replicas, *, node=0, graph=None):
        numel = sum(math.prod(s) for s in shard_shapes)
        return Periodic(lambda step: step % knobs.every == 0,
                        lambda step: [("all_reduce", numel)], period=knobs.every,
                        state_bytes=numel)


def make():
    return Method("every-vote", EveryVote, EveryKnobs())
'''


@pytest.mark.parametrize("every", [1, 4])
def test_a_plug_in_is_planned_from_its_program(tmp_path, monkeypatch, capsys, every):
    (tmp_path / f"every_vote_{every}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    method = f"every_vote_{every}:make"
    out = tmp_path / "plan.csv"
    nodes = 4
    assert cli.main(["plan", "--model", "lm-tiny", "--method", method, "--set",
                     f"every={every}", "--nodes", str(nodes), "--gpus-per-node", "1",
                     "--step-compute", "0.1", "--inter-bw", "1Gbit", "--inter-lat", "1ms",
                     "--out", str(out)]) == 0, capsys.readouterr().err
    rows = pd.read_csv(out).set_index("method")
    params = 867_072  # lm-tiny's, one byte a vote, in a ring all-reduce between 4 nodes
    assert rows.loc[method, "period_steps"] == every
    assert rows.loc[method, "bytes_per_node_round"] == pytest.approx(
        2 * (nodes - 1) / nodes * params, rel=1e-9)
    assert rows.loc[method, "bytes_per_node_step"] == pytest.approx(
        2 * (nodes - 1) / nodes * params / every, rel=1e-9)
