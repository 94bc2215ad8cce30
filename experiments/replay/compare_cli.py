"""`flexbench compare`'s flags and output: one network's ranking, or a map over several.

    flexbench compare results/quick --inter-bw 200Mbit --inter-lat 30ms --out cmp.json
    flexbench compare results/standard --nodes 2 8 64 512 --inter-bw 10Mbit 100Mbit 1Gbit \\
        --inter-lat 1ms --loss-scaling linear-to-critical-batch:512 --out crossover_nodes.png

The ranking is `experiments.replay.compare`'s, the map `experiments.replay.node_map`'s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.errors import ConfigError
from experiments.io import check_output_file, write_atomic
from experiments.replay import node_map
from experiments.replay.compare import (
    OUT_SUFFIXES,
    SAME_COMPUTE,
    cells,
    compare,
    record,
    table_text,
)
from experiments.replay.simulate import add_replay_arguments, replay_inputs
from experiments.values import POSITIVE

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench compare`."""
    parser.add_argument("runs", nargs="+",
                        help="run folders (`flexbench run`) or sweep folders (`flexbench sweep`: "
                        "every training unit)")
    add_replay_arguments(parser, grid=True)
    parser.add_argument("--same-compute", choices=SAME_COMPUTE, default=None,
                        help="replay on one compute basis: each method's median recorded compute "
                        "per step over its seeds (method), or one for every run (all); default: "
                        "each run's own")
    parser.add_argument("--step-noise", action="store_true",
                        help="widen each time-to-target bracket by the runs' recorded step-time "
                        "variation (a block bootstrap of each run's compute per step)")
    parser.add_argument("--loss-from", action="append", default=None, metavar="RUN",
                        help="another recording (an emulated run at the target node count, say) "
                        "of a compared run's method, knobs and seed; repeatable; each compared "
                        "run takes the loss curve, its own included, whose global batch is "
                        "nearest the target's")
    parser.add_argument("--target", type=POSITIVE.arg,
                        help="target validation loss (default: a sweep folder's own target, "
                        "else hsdp-adamw's median final val_loss + 2%%)")
    parser.add_argument("--out", action="append", default=None, metavar="FILE",
                        help="write the comparison to FILE (.json or .csv: the ranked table, or "
                        "with several --nodes or --inter-bw the map; .png or .svg: the map's "
                        "figure); repeatable")


def _check_outs(args: argparse.Namespace, is_map: bool) -> list[Path]:
    """The --out files, checked before anything is replayed (ConfigError, one sentence)."""
    allowed = OUT_SUFFIXES + (node_map.FIGURE_SUFFIXES if is_map else ())
    outs = []
    for out in args.out or ():
        if Path(out).suffix not in allowed:
            raise ConfigError(f"--out {out!r} must end in {', '.join(allowed)}"
                              + ("" if is_map else " (a figure is drawn for a map: several "
                                 "--nodes or --inter-bw)") + ".")
        outs.append(check_output_file(out, what="--out", reads=replay_inputs(args, args.runs)))
    return outs


def main(args: argparse.Namespace) -> int:
    """Run `flexbench compare`: one network's ranking, or a map over several."""
    grid = cells(args)
    outs = _check_outs(args, is_map=len(grid) > 1)
    if len(grid) > 1:
        return node_map.main(args, grid, outs)
    result = compare(grid[0])
    print(f"time to val_loss <= {result.target:.4f} on {result.network} "
          f"({len(result.runs)} runs replayed):")
    print(result.compute_basis)
    print(table_text(result))
    print(result.sentence)
    for line in result.assumptions:
        print(f"  {line}")
    for out in outs:
        if out.suffix == ".csv":
            write_atomic(out, result.table.assign(compute_basis=result.compute_basis)
                         .to_csv(index=False))
        else:
            write_atomic(out, json.dumps(record(result), indent=2) + "\n")
        print(f"-> {out}")
    return 0
