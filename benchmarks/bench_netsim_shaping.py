"""Accuracy of wall-clock shaping on a real 2-process gloo group: configured vs measured.

Run: python benchmarks/bench_netsim_shaping.py
Throughput rows: latency 0, one all-reduce per repetition (each rank sends and receives n bytes
with p = 2), effective rate = wire bytes / median elapsed; target within +-5% of the configured
bandwidth for transfers >= 1 MiB (the 1 Mbit/s point uses 128 KiB so it finishes in about a
second). Latency rows: a 4-byte all-reduce (2 latency steps); its median elapsed time should be
2 x the configured latency within +-1 ms (the real op, timed unshaped as the baseline, runs inside
the modeled window).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _gloo import join_gloo

from netsim import (
    Topology,
    TraceRecorder,
    format_bandwidth,
    parse_bandwidth,
    parse_latency,
    shaping,
)

# (bandwidth, bytes per rank, repetitions)
THROUGHPUT = [
    ("1Mbit", 128 * 1024, 2),
    ("10Mbit", 1 * 2**20, 3),
    ("100Mbit", 4 * 2**20, 3),
    ("1Gbit", 16 * 2**20, 5),
    ("10Gbit", 64 * 2**20, 5),
]
LATENCY = ["1ms", "10ms", "50ms"]


def _time_op(group, nbytes: int, reps: int) -> tuple[float, float]:
    """(median, best) seconds of a blocking all-reduce of nbytes on the group.

    Other load on the machine only ever adds time (shaping never finishes early), so the best of
    the repetitions shows the shaper's own precision and the median what a loaded box gives.
    """
    x = torch.ones(nbytes // 4)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def _worker(rank: int, out: str) -> None:
    join_gloo(rank, 2, os.path.join(out, "store"))
    lines = []
    plain = dist.new_group([0, 1])
    for bandwidth, nbytes, reps in THROUGHPUT:
        topo = Topology.from_strings(2, 1, bandwidth, "0ms")
        shaping.install(topo, "wall", TraceRecorder(rank), run_dir=out)
        group = dist.new_group([0, 1], backend=shaping.BACKEND)
        median, best = _time_op(group, nbytes, reps)
        configured = parse_bandwidth(bandwidth)
        # p = 2 all-reduce: 2(p-1)/p * n = n bytes each way.
        errors = [(nbytes / t / configured - 1) * 100 for t in (median, best)]
        # The unshaped loopback rate is the floor: shaping can slow the real op, never speed it up.
        floor = nbytes / _time_op(plain, nbytes, 2)[1]
        lines.append(("bw", bandwidth, nbytes, floor, nbytes / best, errors))
    baseline = _time_op(plain, 4, 20)[0]
    for latency in LATENCY:
        topo = Topology.from_strings(2, 1, "10Gbit", latency)
        shaping.install(topo, "wall", TraceRecorder(rank), run_dir=out)
        group = dist.new_group([0, 1], backend=shaping.BACKEND)
        # The real op runs inside the modeled window, so the whole elapsed time is the latency.
        median, best = _time_op(group, 4, 10)
        expected = 2 * parse_latency(latency)
        errors = [(t - expected) * 1e3 for t in (median, best)]
        lines.append(("lat", latency, 4, expected, best, errors))
    if rank == 0:
        print(
            f"{'kind':<5}{'configured':>12}{'bytes':>10}{'best':>14}{'err best':>10}"
            f"{'err median':>12}  target  unshaped loopback"
        )
        for kind, label, nbytes, extra, measured, (err_median, err_best) in lines:
            if kind == "bw":
                note = "" if nbytes >= 2**20 else " (<1 MiB)"
                print(
                    f"{'bw':<5}{label:>12}{nbytes:>10}{format_bandwidth(measured):>14}"
                    f"{err_best:>+9.2f}%{err_median:>+11.2f}%  +-5%   "
                    f"{format_bandwidth(extra):>12}{note}"
                )
            else:
                print(
                    f"{'lat':<5}{label + ' x2':>12}{nbytes:>10}{measured * 1e3:>12.2f}ms"
                    f"{err_best:>+8.2f}ms{err_median:>+10.2f}ms  +-1 ms"
                )
        print(f"unshaped 4-byte all-reduce baseline: {baseline * 1e3:.3f} ms")
        sys.stdout.flush()
    shaping.teardown()


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(out,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
