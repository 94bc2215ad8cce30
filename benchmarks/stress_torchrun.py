"""Run the torchrun entry point many times in a row and count the runs that fail.

A run fails when torchrun exits non-zero, a rank prints an abort ("terminate called ...",
a C++ exception, a Python traceback), or run.json is missing. Expected: 0 failures.

    python benchmarks/stress_torchrun.py               # 30 runs, one at a time
    python benchmarks/stress_torchrun.py --runs 60 --jobs 2   # two at a time: more contention
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
# What a rank prints when it dies at exit: std::terminate, an unhandled C++ error, a traceback.
BAD_WORDS = ("terminate called", "Aborted", "Traceback", "SIGABRT", "core dumped")


def one_run(index: int, folder: Path, steps: int) -> tuple[int, str]:
    """One torchrun launch of a 2 x 2 vision-tiny flexdemo run; (index, '' or why it failed)."""
    out = folder / f"run{index}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "experiments.cli", "run", "--nodes", "2", "--method", "flexdemo",
           "--workload", "vision-tiny", "--steps", str(steps), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        return index, "timed out after 300 s"
    log = done.stdout + done.stderr
    tail = "\n    ".join(log.strip().splitlines()[-15:])
    if done.returncode != 0:
        return index, f"exit {done.returncode}; the log ends:\n    {tail}"
    bad = [w for w in BAD_WORDS if w in log]
    if bad:
        return index, f"rc 0 but the log says {bad[0]!r}; it ends:\n    {tail}"
    if not (out / "run.json").is_file():
        return index, "no run.json"
    return index, ""


def main() -> int:
    """Parse arguments, run, print the failure count; exit 1 if any run failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    failures: list[tuple[int, str]] = []
    with tempfile.TemporaryDirectory(prefix="stress-torchrun-") as tmp, \
            ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(lambda i: one_run(i, Path(tmp), args.steps), range(args.runs))
        for index, why in tqdm(runs, total=args.runs, desc="torchrun runs", unit="run"):
            if why:
                failures.append((index, why))
                tqdm.write(f"run {index}: {why}")
    print(f"{len(failures)} failed of {args.runs} torchrun runs (expected 0)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
