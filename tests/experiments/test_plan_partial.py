"""Random and striding replication (no committed recording): the plan's bytes per step are the
ones the real optimizer counts (`last_step_comm`) on a 2-rank gloo group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.synth import Precision, Shape, synthesize
from flexdemo.methods import method_record
from tests.dist_utils import run_ranks
from tests.experiments.plan_factories import on_meta

FACTORY = "tests.experiments.plan_factories:on_meta"
STEPS = 6
CASES = [("random", {}), ("random", {"rate": 0.3, "replicate_every": 2}),
         ("striding", {}), ("striding", {"rate": 0.2, "chunk": 16, "skip_every": 3})]


def _train(rank: int, world: int, method: str, knobs: dict, out: str) -> None:
    from flexdemo.build import build_optimizer

    torch.manual_seed(rank)
    model = on_meta()  # on the default device here: CPU
    optimizer = build_optimizer(method, model, None, **knobs)
    sent = []
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        sent.append(optimizer.last_step_comm["bytes_sent"])
    if rank == 0:
        Path(out).write_text(json.dumps(sent))


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("method", "knobs"), CASES)
def test_plan_sends_what_the_optimizer_counts(tmp_path, method, knobs):
    out = tmp_path / "sent.json"
    run_ranks(_train, 2, method, knobs, str(out))
    counted = json.loads(out.read_text())
    record = method_record(method)
    settings, _ = record.settings(knobs)
    model = declare_model(FACTORY)
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], 0.1)
    trace = synthesize(record, settings, model, Shape(2, 1), compute, Precision("fp32", "fp32"),
                       STEPS, backend="gloo")
    inter = trace[(trace["kind"] == "collective") & trace["inter"] & (trace["rank"] == 0)]
    planned = [float(inter.loc[inter["step"] == s, "bytes_sent"].sum())
               for s in range(1, STEPS + 1)]
    assert planned == [float(n) for n in counted]
    assert sum(counted) > 0 and (0 in counted) == ("replicate_every" in knobs
                                                    or "skip_every" in knobs)
