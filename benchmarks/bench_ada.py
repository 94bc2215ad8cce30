"""Ada's thresholds and Ada against each fixed gossip graph, on lm-tiny (4 nodes x 1 rank).

    python benchmarks/bench_ada.py spread [--steps 300]      # what Ada would measure per graph
    python benchmarks/bench_ada.py compare [--steps 300]     # ada vs every fixed graph

``spread`` trains gossip on each graph of the 4-node ladder (gloo ranks spawned here, constant
lr, the workload's defaults) and takes Ada's measurement every round, as Ada takes it: on the
sampled entries, after the local step and before mixing. It prints the median over windows of
steps, from which ``ada_high`` and ``ada_low`` were chosen (docs/decentralized.md).

``compare`` runs ``flexbench run`` for ``ada`` and ``gossip`` on each graph of the ladder, and
``hsdp-adamw`` as the centralized reference, and prints the final validation loss, the
inter-node bytes per step and node, and for ada the steps it spent on each graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch
import torch.multiprocessing as mp
from _gloo import join_gloo

import flexdemo
from experiments.config import RunConfig, shared_for
from experiments.run.launch import launch
from experiments.workloads import make_workload
from flexdemo.replicators.sampled_spread import SampledSpread
from netsim import shaping

NODES = 4
WINDOWS = ((1, 50), (51, 100), (101, 200), (201, 300))


def _spread_rank(rank: int, graph: str, steps: int, store: str, out: str) -> None:
    """One rank of a gossip run on ``graph`` that records Ada's measurement every round."""
    join_gloo(rank, NODES, store)
    workload = make_workload("lm-tiny")
    torch.manual_seed(0)
    model = workload.model()
    opt = flexdemo.build_optimizer("gossip", model, None, graph=graph)
    rep = opt.replicator
    probe = SampledSpread([flexdemo.local_tensor(p) for p in model.parameters()])
    seen: list[float] = []
    mix = rep.after_update

    def measured_then_mixed(params, stats):
        seen.append(probe.measure(params, rep.group, rep.ranks, None, flexdemo.CommStats()))
        mix(params, stats)

    rep.after_update = measured_then_mixed
    for step in range(1, steps + 1):
        loss = workload.loss(model, workload.batch(step, rank, workload.default_batch_size, 0))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        Path(out).write_text(json.dumps(seen))
    shaping.teardown()


def spread(steps: int) -> None:
    """Print Ada's measured spread per graph of the 4-node ladder, by window of steps."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for graph in flexdemo.graph_ladder(NODES):
            out = f"{tmp}/{graph}.json"
            store = f"{tmp}/{graph}.store"
            mp.spawn(_spread_rank, args=(graph, steps, store, out), nprocs=NODES)
            rows[graph] = json.loads(Path(out).read_text())
    print(f"relative consensus distance before mixing, median over steps (lm-tiny, {NODES} nodes)")
    print("graph".ljust(22) + "".join(f"{a}-{b}".rjust(12) for a, b in WINDOWS))
    for graph, seen in rows.items():
        cells = [statistics.median(seen[a - 1:b]) if len(seen) >= b else float("nan")
                 for a, b in WINDOWS]
        print(graph.ljust(22) + "".join(f"{c:12.2e}" for c in cells))


def compare(steps: int, settings: list[str]) -> None:
    """Print final val loss and bytes of ada, each fixed graph and hsdp-adamw."""
    extra = dict(s.split("=", 1) for s in settings)
    arms = [("hsdp-adamw", {"method": "hsdp-adamw"}), ("ada", {"method": "ada"})]
    arms += [(f"gossip {g}", {"method": "gossip", "graph": g})
             for g in flexdemo.graph_ladder(NODES)]
    print(f"{'arm':24}{'final val':>10}{'MB/step':>10}  graphs (steps)")
    with tempfile.TemporaryDirectory() as tmp:
        for label, arm in arms:
            # The extra settings' knobs apply to the arms whose method reads them.
            cfg = RunConfig.from_dict(shared_for(arm["method"], {
                "workload": "lm-tiny", "nodes": NODES, "gpus_per_node": 1, "steps": steps,
                **arm, **extra}))
            out = launch(cfg.validate(), Path(tmp) / label.replace(" ", "-"), quiet=True)
            meta = json.loads((out / "run.json").read_text())
            rows = pd.read_parquet(out / "steps.parquet")
            graphs = rows["graph"].value_counts(sort=False).to_dict() if label == "ada" else {}
            print(f"{label:24}{meta['final_val_loss'] or float('nan'):10.4f}"
                  f"{meta['inter_bytes_per_step'] / 1e6:10.2f}  {graphs or ''}")


def main() -> int:
    """Run the chosen part and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("spread", "compare"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="run settings for every arm of compare (e.g. schedule=cosine)")
    args = parser.parse_args()
    if args.part == "spread":
        spread(args.steps)
    else:
        compare(args.steps, args.set)
    return 0


if __name__ == "__main__":
    sys.exit(main())
