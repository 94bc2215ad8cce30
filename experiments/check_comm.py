"""CI regression check: fail when any method's bytes (or calls) per step change from before.

    flexbench check-comm                       # compare with results/baselines/comm_volume.json
    flexbench check-comm --update              # re-record the baseline on purpose
    flexbench check-comm --update --method flexdemo    # re-record flexdemo's row, keep the rest
    flexbench check-comm --method mymethods:make       # measure a plug-in (docs/methods.md)

Every method runs a couple of steps of a fixed tiny setting (lm-tiny, 2 nodes x 2 ranks, seed 0,
shaping off) through the real launcher; the per-step inter-node bytes sent and received, the
inter-node calls and the intra-node bytes are compared with the committed baseline. A figure
that grows or drops by more than the tolerance (1%), or a method that disappears, fails the
check: a method that silently stops communicating is as wrong as one that sends more. `--update`
merges: only the measured methods' rows change, and a method whose run fails keeps its old row
and fails the command, so an update can never switch the gate off. The committed baseline
holds the built-in methods; a plug-in given to --methods is measured through the same launcher
and shown as new unless a --baseline of its own holds it.
Byte counts depend only on tensor shapes and the method's settings, so they are deterministic.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from experiments.aliases import add_old_spelling
from experiments.config import METHODS, RunConfig, is_plugin, method_of, shared_for
from experiments.io import check_output_file, read_json, write_atomic
from experiments.values import AT_LEAST_ZERO

log = logging.getLogger(__name__)

__all__ = ["FIGURES", "SETTINGS", "compare", "configure", "main", "measure", "render"]

DEFAULT_BASELINE = Path("results/baselines/comm_volume.json")
TOLERANCE = 0.01
FIGURES = ("inter_bytes_sent", "inter_bytes_received", "inter_calls", "intra_bytes")
# The fixed setting every method is measured on. diloco_h, sync_every and replicate_every are
# small so that methods which synchronise only every few steps still communicate within the
# measured steps (streaming-diloco at sync_every 4: step 1 posts fragment 0, step 2 applies it),
# and powersgd_start 1 so that powersgd's second step sends its compressed factors.
SETTINGS: dict[str, Any] = {
    "workload": "lm-tiny", "nodes": 2, "gpus_per_node": 2, "steps": 2, "seed": 0,
    "shaping": "off", "diloco_h": 2, "sync_every": 4, "replicate_every": 1, "eval_every": 1000,
    "powersgd_start": 1,
}

Measurer = Callable[[Iterable[str], dict[str, Any]], dict[str, dict[str, float]]]


def measure(methods: Iterable[str], settings: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Run each method for a few steps and return its mean per-step communication figures."""
    import pandas as pd
    from tqdm import tqdm

    from experiments.run.launch import launch

    methods = list(methods)
    found: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="check-comm-") as tmp:
        for method in tqdm(methods, desc="check-comm", unit="method"):
            # The fixed setting's knobs apply to the methods that read them.
            cfg = RunConfig.from_dict(shared_for(method, {**settings, "method": method}))
            cfg.validate()
            try:
                out = launch(cfg, Path(tmp) / method, timeout_s=600)
            except Exception as err:  # reported as a missing method by compare()
                log.warning("%s: run failed: %s", method, err)
                continue
            steps = pd.read_parquet(Path(out) / "steps.parquet")
            found[method] = {name: float(steps[name].mean()) for name in FIGURES}
    return found


def compare(
    baseline: dict[str, dict[str, float]],
    current: dict[str, dict[str, float]],
    *,
    tolerance: float = TOLERANCE,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Row-by-row differences and the list of failures (changes over tolerance, lost methods)."""
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for method in sorted(set(baseline) | set(current), key=_method_order):
        old, new = baseline.get(method), current.get(method)
        if new is None:
            failures.append(f"{method}: missing from this run (it is in the baseline)")
            rows.append({"method": method, "figure": "-", "baseline": math.nan, "now": math.nan,
                         "change": "missing", "verdict": "FAIL"})
            continue
        for figure in FIGURES:
            before = math.nan if old is None else float(old.get(figure, math.nan))
            after = float(new.get(figure, math.nan))
            change, verdict = _judge(before, after, tolerance)
            if verdict == "FAIL":
                moved = "grew" if after > before or math.isnan(after) else "fell"
                failures.append(f"{method}: {figure} {moved} from {_num(before)} to "
                                f"{_num(after)} ({change})")
            rows.append({"method": method, "figure": figure, "baseline": before, "now": after,
                         "change": change, "verdict": verdict})
    return rows, failures


def _judge(before: float, after: float, tolerance: float) -> tuple[str, str]:
    """The change as text and its verdict: ok, FAIL (beyond the tolerance either way) or new."""
    if math.isnan(before):
        return "new", "new"
    if math.isnan(after):
        return "missing", "FAIL"
    if before == 0:
        return ("+inf%", "FAIL") if after > 0 else ("+0.0%", "ok")
    rel = (after - before) / before
    # Fewer bytes fail too: a method that stops communicating must be re-recorded on purpose.
    return f"{rel:+.1%}", ("FAIL" if abs(rel) > tolerance else "ok")


def render(rows: list[dict[str, Any]]) -> str:
    """The per-method diff as an aligned plain-text table."""
    head = ("method", "figure", "baseline", "now", "change", "verdict")
    body = [(r["method"], r["figure"], _num(r["baseline"]), _num(r["now"]), r["change"],
             r["verdict"]) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]
    lines = []
    for line in (head, *body):
        cells = [str(c).ljust(w) if i < 2 else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _num(value: float) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _method_order(method: str) -> tuple[int, str]:
    return (METHODS.index(method) if method in METHODS else len(METHODS), method)


def _read_baseline(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"no baseline at {str(path)!r}; record one with --update.")
    data = read_json(path, "baseline")
    if not isinstance(data, dict) or not isinstance(data.get("methods"), dict):
        raise ValueError(f"baseline {str(path)!r} has no 'methods' table; re-record it with "
                         "--update.")
    return data


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench check-comm`."""
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE,
                        help=f"baseline JSON (default {DEFAULT_BASELINE})")
    parser.add_argument("--update", action="store_true",
                        help="measure and record instead of comparing; with --method, only "
                        "their rows change")
    parser.add_argument("--tolerance", type=AT_LEAST_ZERO.arg, default=None,
                        help="allowed relative change per figure (default 0.01 = 1%%); not "
                        "with --update, which compares nothing")
    methods = parser.add_argument("--method", nargs="+", default=None, metavar="METHOD",
                                  help="check only these methods (default: all, and every one the "
                                  "baseline knows must still run)")
    add_old_spelling(parser, "--methods", methods)


def main(args: argparse.Namespace, *, measurer: Measurer | None = None) -> int:
    """Run `flexbench check-comm`; 0 when nothing changed (or the update is whole), else 1."""
    methods = _checked_methods(args)
    if args.update:  # where the measurement goes is checked before anything is measured
        check_output_file(args.baseline, what="--baseline")
    baseline = _baseline_for(args)
    current = (measurer or measure)(methods, dict(SETTINGS))
    if args.update:
        return _record(args.baseline, baseline, methods, current)
    expected = baseline["methods"]
    if args.method is not None:  # an explicit subset is compared on that subset only
        expected = {m: v for m, v in expected.items() if m in methods}
    return _report(expected, current, TOLERANCE if args.tolerance is None else args.tolerance)


def _checked_methods(args: argparse.Namespace) -> list[str]:
    """The methods to measure, once --method and --tolerance are known to be valid."""
    methods = list(METHODS) if args.method is None else list(args.method)
    unknown = [m for m in methods if m not in METHODS and not is_plugin(m)]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}, or "
                         "give your own as module.path:factory.")
    for method in methods:
        method_of(method)  # a plug-in that cannot be used: one sentence before any run
    if len(set(methods)) < len(methods):
        raise ValueError(f"--method lists a method twice ({' '.join(methods)}).")
    if args.tolerance is not None and args.update:
        raise ValueError(f"--tolerance {args.tolerance:g} judges a comparison, and --update "
                         "records without comparing; leave one of them out.")
    if args.tolerance is not None and not 0 <= args.tolerance < 1:
        raise ValueError(f"--tolerance must be in [0, 1), got {args.tolerance}.")
    return methods


def _baseline_for(args: argparse.Namespace) -> dict[str, Any] | None:
    """The baseline to compare with or merge into (None: a whole first recording)."""
    if args.update and not args.baseline.exists():
        if args.method is not None:
            raise ValueError(f"no baseline at {str(args.baseline)!r} to update; record every "
                             "method first (--update without --method).")
        return None
    baseline = _read_baseline(args.baseline)
    if baseline.get("settings") == SETTINGS:
        return baseline
    if args.update and args.method is None:
        return None  # re-recorded whole under the new settings
    raise ValueError(f"baseline {str(args.baseline)!r} was recorded with other settings "
                     f"({baseline.get('settings')}); re-record every method with --update "
                     "(without --method).")


def _record(path: Path, baseline: dict[str, Any] | None, methods: list[str],
            current: dict[str, dict[str, float]]) -> int:
    """`--update`: merge `current` into the baseline at `path`, print it; 1 if a method failed.

    Rows of methods not measured stay; a method whose run failed keeps its old row.
    """
    from experiments.io import provenance

    merged = {**(baseline["methods"] if baseline else {}), **current}
    about = provenance()
    body = {"settings": SETTINGS, "figures": list(FIGURES),
            "methods": {m: merged[m] for m in sorted(merged, key=_method_order)},
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": about["versions"], "git_commit": about["git_commit"]}
    write_atomic(path, json.dumps(body, indent=2, sort_keys=False) + "\n")
    rows, _ = compare({}, current)
    print(render(rows))
    log.info("baseline written to %s", path)
    failed = [m for m in methods if m not in current]
    if failed:
        kept = [m for m in failed if m in merged]
        print(f"{len(failed)} method(s) failed to run and were not re-recorded: "
              f"{', '.join(failed)}" + (f" (old rows kept: {', '.join(kept)})" if kept else "")
              + ".", file=sys.stderr)
        return 1
    return 0


def _report(expected: dict[str, Any], current: dict[str, dict[str, float]],
            tolerance: float) -> int:
    """Print the comparison with the baseline and what grew; 1 if anything did, else 0."""
    rows, failures = compare(expected, current, tolerance=tolerance)
    print(render(rows))
    if failures:
        print(f"\ncommunication changed beyond {tolerance:.0%}:", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        print("if this is intended, re-record those methods with `flexbench check-comm "
              "--update --method METHOD ...`.", file=sys.stderr)
        return 1
    new = [m for m in current if m not in expected]
    if new:  # a plug-in, or a method added since the baseline: measured, nothing to hold it to
        print(f"\nnot in the baseline, measured only: {', '.join(new)} (record with --update "
              f"--methods {' '.join(new)}).")
    if len(new) < len(current):
        print(f"\nevery method sends what its baseline does (within {tolerance:.0%}).")
    return 0
