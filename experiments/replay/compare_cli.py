"""`flexbench compare`'s flags and output: one network's ranking, or a map over several.

    flexbench compare results/quick --inter-bw 200Mbit --inter-lat 30ms --out cmp.json
    flexbench compare results/standard --nodes 2 8 64 512 --inter-bw 10Mbit 100Mbit 1Gbit \\
        --inter-lat 1ms --loss-scaling linear-to-critical-batch:512 --out crossover_nodes.png

The ranking is `experiments.replay.compare`'s, the map `experiments.replay.node_map`'s; the
flags become one `ReplayTarget` per cell (`experiments.replay.flags`) and one `Question`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.errors import ConfigError
from experiments.io import check_output_file, write_atomic
from experiments.replay import node_map
from experiments.replay.compare import OUT_SUFFIXES, Question, compare, record, table_text
from experiments.replay.flags import add_replay_arguments, replay_inputs, target_from_flags
from experiments.replay.target import SAME_COMPUTE, ReplayTarget
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


def grid_targets(args: argparse.Namespace) -> list[ReplayTarget]:
    """One target per (node count, bandwidth) of the flags, each checked as a single
    comparison's (ConfigError, one sentence, before anything is read)."""
    nodes, bws = _values(args.nodes), _values(args.inter_bw)
    if len(nodes) * len(bws) > 1 and args.topology is not None:
        raise ConfigError("--topology fixes the node count and every link; a map over --nodes "
                          "needs --inter-bw instead (drop one of them).")
    for flag, values in (("--nodes", nodes), ("--inter-bw", bws)):
        if len(set(values)) < len(values):
            raise ConfigError(f"{flag} lists a value twice ({' '.join(map(str, values))}); give "
                              "each once.")
    first = target_from_flags(args, nodes=nodes[0], inter_bw=bws[0],
                              same_compute=args.same_compute)
    return [first.at(nodes=n, inter_bw=bw) for n in nodes for bw in bws]


def _values(given: object) -> list:
    """A flag that takes one value or several, as a list ([None]: not given)."""
    return list(given) if isinstance(given, (list, tuple)) else [given]


def question_of(args: argparse.Namespace) -> Question:
    """What the flags ask beside the target: the runs, --target, --step-noise, --loss-from."""
    return Question(tuple(map(Path, args.runs)), args.target, args.step_noise,
                    tuple(map(Path, args.loss_from or ())))


def main(args: argparse.Namespace) -> int:
    """Run `flexbench compare`: one network's ranking, or a map over several."""
    outs = _check_outs(args, is_map=len(_values(args.nodes)) * len(_values(args.inter_bw)) > 1)
    question = question_of(args)
    grid = grid_targets(args)
    if len(grid) > 1:
        return node_map.main(question, grid, outs)
    result = compare(question, grid[0])
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
