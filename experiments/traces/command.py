"""`flexbench import-trace`: per-rank torch.profiler traces of a data-parallel job as a run folder.

    flexbench import-trace outputs/profile_traces/iteration_10 --gpus-per-node 8 --out runs/mine
    flexbench simulate runs/mine --inter-bw 10Gbit --inter-lat 5ms --out mine.csv

The folder replays as a recording does (docs/traces.md): steps from `ProfilerStep#N`, every
collective with its kind, size, type and ranks, the time between them as the traced timeline
spent it. What the traces did not say and the import inferred is printed and kept in run.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.io import check_output_folder
from experiments.traces.fit import fit_link
from experiments.traces.folder import IMPORTED, write_imported
from experiments.traces.job import read_job
from experiments.values import COUNT, POSITIVE_INT
from flexdemo.methods import BASELINE, METHODS

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench import-trace`."""
    parser.add_argument("trace", nargs="+", metavar="TRACE",
                        help="per-rank trace files (*.json, *.json.gz) or folders of them; ranks "
                             "not given are taken as alike to a traced one")
    parser.add_argument("--out", required=True, help="run folder to write (must be new or empty)")
    parser.add_argument("--gpus-per-node", type=POSITIVE_INT.arg, default=None,
                        help="ranks per node of the traced job (default: the GPUs its host "
                             "lists); classes each group intra- or inter-node")
    parser.add_argument("--skip-steps", type=COUNT.arg, default=0, metavar="N",
                        help="leave out the first N profiled steps (a warm-up's)")
    parser.add_argument("--method", choices=METHODS, default=BASELINE,
                        help=f"the method the job ran, as replays name it (default {BASELINE}: "
                             "every gradient reduced across nodes each step, as DDP and FSDP do)")
    parser.add_argument("--batch-size", type=POSITIVE_INT.arg, default=None,
                        help="sequences per rank a step, as the job trained: a loss curve from "
                             "another run (compare --loss-from) then carries to it")
    parser.add_argument("--workload", default=IMPORTED,
                        help="the model it trained, when it is a built-in workload (lm-tiny, "
                             "...): its FSDP2 layout re-shards exactly (default: imported)")


def main(args: argparse.Namespace) -> int:
    """Read, check and write; print what was read and what was inferred."""
    out = check_output_folder(args.out, what="--out", reads=args.trace)
    job = read_job(args.trace, args.gpus_per_node, args.skip_steps)
    meta = write_imported(job, Path(out), args.method, args.workload, args.batch_size)
    info = meta[IMPORTED]
    traced = len(info["ranks_traced"])
    print(f"read {traced} of {job.world} ranks of a {job.backend} job on {job.device}: "
          f"{job.nodes} nodes x {job.gpus_per_node} ranks, {len(job.steps)} steps "
          f"(ProfilerStep#{job.steps[0]}-#{job.steps[-1]}), "
          f"{sum(len(tl.collectives) for tl in job.timelines) / traced / len(job.steps):.4g} "
          "collectives a rank and step")
    print(f"per step: {meta['inter_bytes_per_step'] / 1e6:.4g} MB inter-node and "
          f"{meta['intra_bytes_per_step'] / 1e6:.4g} MB intra-node sent per node; "
          f"{meta['train_time_s'] / len(job.steps):.4g} s a step")
    for line in info["inferred"]:
        print(f"  inferred: {line}")
    for what, n in info["left_out"].items():
        print(f"  left out: {n} {what}")
    link = fit_link(job)
    if link is not None:
        print(f"  its collectives' own speed: {link.describe()}")
    print(f"wrote {out}")
    return 0
