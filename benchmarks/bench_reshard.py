"""Re-shard on replay: the bytes a replayed 2xG hsdp-adamw step moves per node, against the closed
form from the parameter count.

Run: python benchmarks/bench_reshard.py
     [--run results/quick-2026-11-30/units/hsdp-adamw-s0 --gpus-per-node 8]
Replays the committed 2x2 hsdp-adamw run as nodes x G with `flexbench simulate`'s model, re-sharded
(experiments.replay.reshard) and, for comparison, with the recorded 2-rank shards (what the replay
did before it re-sharded). A real run of that shape all-reduces each rank's FSDP2 shard across the
nodes, so one node sends, per step, G x ring_share x 4 bytes x its shard: for lm-tiny, whose
dim 0 sizes all divide by 8, that is ring_share x 4 bytes x the parameter count whatever G is
(ring_share = 2 (N - 1) / N, the ring all-reduce's bytes per rank over its payload).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.replay.engine import replay  # noqa: E402
from experiments.replay.recordings import read_run  # noqa: E402
from experiments.replay.reshard import run_layout, shard_elements  # noqa: E402
from experiments.replay.target import ReplayTarget  # noqa: E402
from netsim.model import ReplayOptions, simulate  # noqa: E402


def closed_form(layout: list, nodes: int, per_node: int, itemsize: int = 4) -> float:
    """Bytes one node sends per step in a real nodes x per_node hsdp-adamw run."""
    shard = sum(shard_elements(shape, per_node) for unit in layout for shape in unit)
    return per_node * 2 * (nodes - 1) / nodes * shard * itemsize


def main() -> None:
    """Print the closed form, the re-sharded replay and the as-recorded replay per node."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run",
                        default=str(ROOT / "results/quick-2026-11-30/units/hsdp-adamw-s0"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--inter-bw", default="10Mbit")
    parser.add_argument("--inter-lat", default="1ms")
    args = parser.parse_args()
    run = read_run(args.run)
    layout, source = run_layout(run.meta, run.config)
    want = closed_form(layout, args.nodes, args.gpus_per_node)
    network = dict(inter_bw=args.inter_bw, inter_lat=args.inter_lat, nodes=args.nodes)
    resharded = replay(run, ReplayTarget(gpus_per_node=args.gpus_per_node, **network))
    steps = len(resharded.frame)
    got = resharded.node_egress_bytes / steps
    # The recorded shards on the target, as the replay did before it re-sharded.
    target = run.config.replace(gpus_per_node=args.gpus_per_node, **network).topology()
    as_recorded = simulate(run.trace, target,
                           ReplayOptions(intra="recorded")).node_egress_bytes / steps
    print(f"{run.config.method} recorded {run.config.nodes}x{run.config.gpus_per_node}, "
          f"replayed as {args.nodes}x{args.gpus_per_node} at {args.inter_bw}, {args.inter_lat} "
          f"(layout {source}, {run.meta['params']:,} parameters)")
    print(f"  closed form, a real {args.nodes}x{args.gpus_per_node} run: {want:,.0f} bytes per "
          "node and step")
    print(f"  replay, re-sharded:                {got:,.0f} bytes ({got / want - 1:+.3%}), median "
          f"step {resharded.frame['step_time_s'].median():.3f} s")
    print(f"  recorded shards on {args.gpus_per_node} ranks:       {as_recorded:,.0f} bytes "
          f"(x{as_recorded / want:.3g})")
    ok = math.isclose(got, want, rel_tol=0.01)
    print(f"  within 1%: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
