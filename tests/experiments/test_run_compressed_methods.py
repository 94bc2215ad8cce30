"""`flexbench run` of sparseloco, local-sgd, diloco's outer_format and hsdp-adamw's reduce_format
on lm-tiny, 2 nodes x 2 ranks: the loss falls, each step's recorded inter-node bytes are what
the method's own sizing says (the closed forms those sizings follow are tested beside the
replicators), and the plan of the run holds every collective it recorded, rank by rank
(`tests/experiments/plan_anchor.py`)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from experiments.config import RunConfig
from experiments.run.launch import launch
from experiments.workloads import make_workload
from tests.experiments.plan_anchor import assert_plan_holds, plan_of_run

NODES, PER_NODE, STEPS, H = 2, 2, 6, 3
CASES = {
    "sparseloco": ("sparseloco", {"diloco_h": H}),
    "local-sgd": ("local-sgd", {"diloco_h": H}),
    "diloco-int8": ("diloco", {"diloco_h": H, "outer_format": "int8"}),
    "hsdp-adamw-int8": ("hsdp-adamw", {"reduce_format": "int8"}),
}


def _shard_shapes(local: int) -> list[tuple[int, ...]]:
    """lm-tiny's parameter shards on local rank `local`: FSDP2 cuts dim 0 in chunks of
    ceil(rows / ranks), the last ones short or empty."""
    out = []
    for p in make_workload("lm-tiny").model().parameters():
        shape = tuple(p.shape) or (1,)
        size = math.ceil(shape[0] / PER_NODE)
        out.append((max(0, min(size, shape[0] - local * size)), *shape[1:]))
    return out


def _bytes_per_node(method: str, knobs: dict, step: int) -> int:
    """A node's inter-node bytes sent at `step`: its ranks' sums of the method's own sizing."""
    from flexdemo.methods import method_record
    from flexdemo.replicators.diloco import outer_payload
    from flexdemo.replicators.reduce import reduce_payloads
    from flexdemo.replicators.sparseloco import sparse_payload
    from flexdemo.wire import all_gather_bytes, all_reduce_bytes, all_to_all_bytes

    per_op = {"all_reduce": all_reduce_bytes, "all_gather": all_gather_bytes,
              "all_to_all": all_to_all_bytes}
    settings, _ = method_record(method).settings(knobs)
    total = 0
    for local in range(PER_NODE):
        shapes = _shard_shapes(local)
        numels = [math.prod(s) for s in shapes]
        if method == "hsdp-adamw":
            posts = reduce_payloads(shapes, settings.reduce_format, NODES)
        elif step % H:
            posts = []
        elif method == "sparseloco":
            posts = [sparse_payload(numels, settings)]
        else:
            posts = [outer_payload(numels, outer_format=settings.outer_format)]
        total += sum(per_op[op](nbytes, NODES) for op, nbytes in posts)
    return total


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_trains_lm_tiny_on_2x2_and_records_its_closed_form(tmp_path: Path, case: str) -> None:
    method, knobs = CASES[case]
    cfg = RunConfig(method=method, workload="lm-tiny", nodes=NODES, gpus_per_node=PER_NODE,
                    steps=STEPS, batch_size=4, eval_every=STEPS, **knobs)
    out = launch(cfg, tmp_path / case, timeout_s=240, quiet=True)
    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["val_loss"].iloc[-1] < steps["loss"].iloc[0], case
    want = [_bytes_per_node(method, knobs, s) for s in range(1, STEPS + 1)]
    assert steps["inter_bytes_sent"].tolist() == want, case
    assert steps["inter_bytes_received"].tolist() == want, case
    # Its plan: the method's program at the run's shape holds every step's collectives.
    assert assert_plan_holds(*plan_of_run(out)) == STEPS * NODES * PER_NODE, case
