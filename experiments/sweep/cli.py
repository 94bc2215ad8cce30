"""`flexbench sweep`: methods x knobs x seeds trained once each, then timed on every network point.

    flexbench sweep experiments/configs/quick.toml                 # -> results/quick
    flexbench sweep experiments/configs/quick.toml --set grid.seeds=[0] --out results/q1
    flexbench sweep experiments/configs/paper.toml --executor slurm
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.errors import ConfigError, RunFailed, Stopped
from experiments.io import check_output_folder
from experiments.report import metrics
from experiments.sweep.estimate import estimate_text
from experiments.sweep.executors import EXECUTORS
from experiments.sweep.plan import load_config, units_of
from experiments.sweep.runner import run_sweep

__all__ = ["configure", "main"]

def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench sweep`."""
    parser.add_argument("config", type=Path, help="sweep TOML, e.g. experiments/configs/quick.toml")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default results/<name>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a setting, e.g. run.steps=50 or grid.seeds=[0]")
    parser.add_argument("--executor", choices=EXECUTORS, default=None,
                        help="local (default: one unit at a time), slurm, or debug (submitit)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run units that failed before again")
    parser.add_argument("--resimulate", action="store_true",
                        help="drop every cached simulated time axis and replay again (caches "
                        "are keyed by the run, the link and the model's code: never needed "
                        "for correctness)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the units, their number and an estimated time, and stop")
    parser.add_argument("--estimate-from", type=Path, default=None, metavar="DIR",
                        help="sweep folder whose runs time the estimate (default: --out when it "
                        "holds runs, else results/quick)")

def main(args: argparse.Namespace) -> int:
    """Run `flexbench sweep`."""
    if args.estimate_from is not None and not args.dry_run:
        raise ConfigError("--estimate-from times --dry-run's estimate, and without --dry-run "
                          "nothing is estimated; add --dry-run or leave it out.")
    try:
        cfg = load_config(args.config, args.overrides)
    except Stopped:
        raise  # SIGTERM: said by the command line, exit 143
    except RunFailed as err:  # a workload's code did not return within timeout_s
        print(f"flexbench sweep: failed: {err}", file=sys.stderr)
        return 1
    out = args.out or Path("results") / cfg.name
    check_output_folder(out, what="sweep folder", must_be_empty=False)  # a sweep resumes in it
    units = units_of(cfg)
    if args.dry_run:
        for u in units:
            where = "" if u.network is None else f" @ {u.network.label} (wall)"
            print(f"{'emulate' if u.emulated else u.kind:8s} {u.id}{where}")
        print(f"{len(units)} units, {len(cfg.networks)} network points -> {out}")
        print(estimate_text(units, out, args.estimate_from))
        return 0
    runs = run_sweep(cfg, out, executor=args.executor, retry_failed=args.retry_failed,
                     resimulate=args.resimulate)
    print(metrics.summary_markdown(runs))
    failed = sorted(set(runs.loc[runs["status"] != "done", "unit"]))
    if failed:
        print(f"{len(failed)} unit(s) did not finish: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
