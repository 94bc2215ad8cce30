"""Run the timing-sensitive tests (`-m timing`) many times under busy-loop load; count failures.

Two pure-Python busy processes (as `stress --cpu 2` would) keep a 2-core machine loaded while
`python -m pytest -m timing` runs again and again. Each run's pass or fail is printed; a failing
run's output is printed in full and kept in --keep, so the flake can be hunted. Expected: 0 failed.

    PYTHONPATH=$PWD python benchmarks/stress_tests.py              # 20 runs, 2 busy processes
    PYTHONPATH=$PWD python benchmarks/stress_tests.py --runs 5 --busy 4 -- -k shaping
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _spin() -> None:
    """A busy process: one core's worth of pure-Python work, until it is terminated."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, inherited by fork
    while True:
        pass


def start_load(count: int) -> list[mp.Process]:
    """Start `count` busy processes (daemons, so they also end with this one)."""
    procs = [mp.Process(target=_spin, daemon=True, name=f"busy-{i}") for i in range(count)]
    for proc in procs:
        proc.start()
    return procs


def stop_load(procs: list[mp.Process]) -> None:
    """End the busy processes and reap them."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def one_run(extra: list[str], timeout_s: float) -> tuple[bool, str, float]:
    """One pytest run of the timing tests: (passed, its output, seconds).

    pytest runs in a session of its own, so that a timeout or an interrupt ends the ranks and
    launchers its tests started as well (one kill of the whole process group).
    """
    cmd = [sys.executable, "-m", "pytest", "-m", "timing", "-q", "-p", "no:cacheprovider", *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return False, f"{output}\ntimed out after {timeout_s:g} s", time.monotonic() - start
    except BaseException:  # Ctrl-C or a kill of this script: take the tests' processes along
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc.returncode == 0, output, time.monotonic() - start


def _summary(output: str) -> str:
    """pytest's last line ('3 passed in 12.3s'), or the output's last line."""
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the machine, run the tests, print the failure count; 1 if any."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes alongside")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    parser.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()) / "stress-tests",
                        help="folder for the output of failing runs")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    # Ctrl-C, and a plain kill, end the busy processes too; a shell that starts this in the
    # background ignores SIGINT for it, so the handler is put back explicitly.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    failed: list[int] = []
    done = 0
    load = start_load(args.busy)
    try:
        for index in range(1, args.runs + 1):
            passed, output, seconds = one_run(args.pytest_args, args.timeout)
            print(f"run {index}/{args.runs}: {'passed' if passed else 'FAILED'} "
                  f"({_summary(output)}; {seconds:.0f} s)", flush=True)
            if not passed:
                failed.append(index)
                args.keep.mkdir(parents=True, exist_ok=True)
                log = args.keep / f"run{index}.log"
                log.write_text(output)
                print(f"--- output of run {index} (kept in {log}) ---\n{output}", flush=True)
            done = index
    except KeyboardInterrupt:
        print(f"interrupted: counting the {done} complete runs", flush=True)
    finally:
        stop_load(load)
    print(f"timing tests: {done} runs under {args.busy} busy processes: {len(failed)} failed"
          + (f" (runs {', '.join(map(str, failed))})" if failed else ""))
    return 1 if failed or done < args.runs else 0


if __name__ == "__main__":
    sys.exit(main())
