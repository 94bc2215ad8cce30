"""`flexbench calibrate`: time real collectives over shaped links and fit the model's overheads.

    flexbench calibrate --shaping kernel --out results/calibration/kernel.json   # root
    flexbench calibrate --shaping wall --out results/calibration/wall.json

Two ranks, one per emulated node, time all-reduces and all-gathers of a few sizes at a few rates
(the median of `--repeats` each, every one after an idle gap like the compute between steps);
`netsim.calibration.fit_calibration` turns them into a goodput factor and a per-message cost,
written to a small JSON file that `flexbench simulate` and `flexbench validate-sim` read with
`--calibration FILE`. Under `kernel` shaping each rank runs in its node's network namespace with
tbf on the links (as `flexbench run --shaping kernel`); under `wall` both ranks run here, on
loopback, through netsim's wall-clock shaper.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from experiments.errors import ConfigError
from experiments.io import check_output_file, cpu_model, write_atomic
from experiments.sizes import Cost, Count, Term, check_work
from experiments.values import BANDWIDTH, POSITIVE_INT
from netsim import parse_bandwidth
from netsim.calibration import Calibration, Sample, fit_calibration, load_calibration
from netsim.costs import collective_volume
from netsim.kernel import KernelNetwork, TcSettings, stop
from netsim.processes import init_process_group, loopback_interface
from netsim.topology import Link

__all__ = ["calibrate", "configure", "main", "DEFAULT_RATES", "DEFAULT_PAYLOADS", "OPS",
           "this_machine", "machine_calibration", "cache_path", "loopback_link",
           "machine_loopback"]

DEFAULT_RATES = ("20Mbit", "100Mbit")
DEFAULT_PAYLOADS = (32 << 10, 256 << 10, 2 << 20)
OPS = ("all_reduce", "all_gather")
_RANKS = 2
_REPO_CALIBRATIONS = Path(__file__).resolve().parents[2] / "results" / "calibration"
_TIMEOUT_S = 300.0


def _time_ops(group: Any, plan: list[tuple[str, int]], repeats: int,
              gap_s: float, group_size: int = _RANKS) -> list[list[float]]:
    """Inside a rank: the seconds of each (op, payload bytes) of `plan`, `repeats` times each."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1024), group=group)  # connections made before the clock starts
    timings = []
    for op, payload in plan:
        data = torch.ones(max(1, payload // 4))
        gathered = torch.empty(data.numel() * group_size)
        times = []
        for _ in range(repeats):
            time.sleep(gap_s)  # an idle link, as after a step's compute
            dist.barrier()  # on the default group: every rank (every group) starts together
            t0 = time.perf_counter()
            if op == "all_reduce":
                dist.all_reduce(data, group=group)
            else:
                dist.all_gather_into_tensor(gathered, data, group=group)
            times.append(time.perf_counter() - t0)
        timings.append(times)
    return timings


def _rank_main(spec: dict) -> None:
    """One rank: join the rendezvous, shape (wall) or not (kernel: tc does), time, print JSON."""
    import torch
    import torch.distributed as dist

    import netsim
    from netsim import shaping

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world, size = spec.get("world", _RANKS), spec.get("group_size", _RANKS)
    if spec.get("pin"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})  # as pinned runs place rank r
    init = spec.get("init_method", "env://")
    init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = None
        if spec["shaping"] == "wall":
            topology = netsim.Topology.from_strings(_RANKS, 1, inter_bw=spec["rate_bps"])
            shaping.install(topology, mode="wall", run_dir=spec["work"])
            group = dist.new_group(list(range(_RANKS)), backend=shaping.BACKEND)
        elif size < world:  # one group per emulated node, each timing its own collectives
            groups = [dist.new_group(list(range(k, k + size))) for k in range(0, world, size)]
            group = groups[rank // size]
        plan = [tuple(p) for p in spec["plan"]]
        timings = _time_ops(group, plan, spec["repeats"], spec["gap_s"], size)
        if rank == 0:
            print(json.dumps({"times_s": timings}), flush=True)
        dist.barrier()
    finally:
        shaping.teardown()


def _run_ranks(start: Callable[[int], subprocess.Popen], world: int = _RANKS) -> str:
    """Start the ranks (`start(rank)`), wait (killing all on a failure); rank 0's stdout."""
    procs = [start(k) for k in range(world)]
    try:
        outputs = [p.communicate(timeout=_TIMEOUT_S) for p in procs]
    finally:
        stop(procs)
    failed = [k for k, p in enumerate(procs) if p.returncode]
    if failed:
        tail = (outputs[failed[0]][1] or "").strip().splitlines()[-3:]
        raise RuntimeError(f"calibration rank {failed[0]} failed: {' / '.join(tail)}")
    return outputs[0][0]


def _measure(shaping: str, rate_bps: float, plan: list[tuple[str, int]], repeats: int,
             gap_s: float, shape: tuple[int, int] = (1, _RANKS)) -> list[float]:
    """Median seconds of each planned collective between two ranks on links of `rate_bps`.

    Unshaped (`shaping` "off"), `shape` = (groups, ranks per group) runs that many groups at
    once, rank r pinned to core r mod cores, each timing its own collectives (rank 0's group
    reports): the intra-node traffic of every node of a pinned run of that shape.
    """
    world = shape[0] * shape[1] if shaping == "off" else _RANKS
    base_env = {**os.environ, "WORLD_SIZE": str(world), "TORCH_CPP_LOG_LEVEL": "ERROR",
                "OMP_NUM_THREADS": "1"}
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with tempfile.TemporaryDirectory(prefix="flexbench-calibrate-") as work:
        spec = {"shaping": shaping, "rate_bps": rate_bps, "plan": plan, "repeats": repeats,
                "gap_s": gap_s, "work": work}
        if shaping == "off":
            spec.update(world=world, group_size=shape[1], pin=True)
        command = [sys.executable, "-m", "experiments.replay.calibrate", "--rank"]
        if shaping == "kernel":
            with KernelNetwork(_RANKS, TcSettings(rate_bps)) as net:
                argv = command + [json.dumps(spec)]
                out = _run_ranks(lambda k: net.start(k, argv, env={**base_env, "RANK": str(k)},
                                                     **pipes))
        else:
            spec["init_method"] = f"file://{Path(work) / 'store'}"
            argv = command + [json.dumps(spec)]
            out = _run_ranks(lambda k: subprocess.Popen(
                argv, env={**base_env, "RANK": str(k), "GLOO_SOCKET_IFNAME": loopback_interface()},
                start_new_session=True, **pipes), world)
    timings = json.loads(out.strip().splitlines()[-1])["times_s"]
    return [statistics.median(times) for times in timings]


def calibrate(shaping: str, rates: list[str], payloads: list[int], repeats: int = 5,
              gap_s: float = 0.1, per_op: bool = False) -> Calibration:
    """Time every (op, payload) at every rate under `shaping` and fit the calibration
    (`per_op`: the model prices each op kind with its own fit)."""
    plan = [(op, payload) for op in OPS for payload in payloads]
    samples = []
    for rate in tqdm(rates, desc=f"calibrate ({shaping})", unit="rate"):
        rate_bps = parse_bandwidth(rate)
        for (op, payload), seconds in zip(plan, _measure(shaping, rate_bps, plan, repeats, gap_s),
                                          strict=True):
            volume = collective_volume(op, _RANKS, payload)
            samples.append(Sample(op, payload, rate_bps, 0.0, volume.latency_steps,
                                  volume.bytes_sent, seconds))
    made = (f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.node()}, "
            f"{os.cpu_count()} cores, {len(samples)} samples")
    return fit_calibration(samples, shaping, made, this_machine(), per_op)


def loopback_link(payloads: list[int] | None = None, repeats: int = 5,
                  gap_s: float = 0.02, shape: tuple[int, int] = (1, _RANKS)) -> tuple[Link, float]:
    """The link unshaped gloo ranks of one node see on this machine (they talk over loopback):
    (latency per hop and bandwidth fitted by least squares on relative error over all-reduces
    and all-gathers of `payloads`, the largest relative error of the fit).

    `shape` (nodes, ranks per node): measured with every node's ranks at once, pinned as a run
    of that shape pins them, so that ranks sharing a core (more ranks than cores) pay for it
    here as they do there: a rank woken by its collective waits for the core.
    """
    # Up to 32 MiB: on a VM a small collective's wake-up is either immediate or waits for the
    # next timer tick (~4 ms, bimodal from one repeat to the next), larger than what 2 MiB
    # takes, so only payloads well above it fix the per-byte term.
    payloads = payloads or [64 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20]
    plan = [(op, payload) for op in OPS for payload in payloads]
    measured = _measure("off", 0.0, plan, repeats, gap_s, shape)
    volumes = [collective_volume(op, shape[1], payload) for op, payload in plan]
    rows = np.array([[v.latency_steps, v.paced_bytes] for v in volumes], dtype=float)
    weight = 1.0 / np.array(measured)
    (latency, per_byte), *_ = np.linalg.lstsq(rows * weight[:, None],
                                              np.array(measured) * weight, rcond=None)
    if not per_byte > 0:
        raise RuntimeError("loopback collectives did not grow with their size; time larger "
                           "payloads.")
    link = Link(1.0 / per_byte, max(0.0, float(latency)))
    fitted = rows @ np.array([link.latency, per_byte])
    return link, float(np.max(np.abs(fitted / np.array(measured) - 1.0)))


def machine_loopback(shape: tuple[int, int] = (1, _RANKS)) -> tuple[Link, str]:
    """This machine's loopback link at `shape` (`loopback_link`), from the cache or measured
    now (~10 s), and a line saying which and what it is."""
    name = "loopback" if shape == (1, _RANKS) else f"loopback-{shape[0]}x{shape[1]}"
    path = cache_path(name)
    here = this_machine()
    try:
        body = json.loads(path.read_text())
        if body.get("machine") == here:
            link = Link(float(body["bandwidth"]), float(body["latency_s"]))
            return link, (f"{_describe_link(link, shape)}, found in {path} "
                          f"({body.get('made', '')})")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none, damaged or another machine's: measure it
    print(f"measuring this machine's loopback gloo link at {shape[0]}x{shape[1]} (about 10 s)",
          file=sys.stderr, flush=True)
    link, error = loopback_link(shape=shape)
    made = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, fit error up to {error:.1%}"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"machine": here, "bandwidth": link.bandwidth,
                                   "latency_s": link.latency, "made": made}, indent=1) + "\n")
    return link, f"{_describe_link(link, shape)}, measured now ({made}), kept in {path}"


def _describe_link(link: Link, shape: tuple[int, int]) -> str:
    return (f"loopback gloo at {shape[0]}x{shape[1]} {link.bandwidth * 8 / 1e9:.3g} Gbit/s, "
            f"{link.latency * 1e6:.3g} us a hop")


def this_machine() -> str:
    """This machine as a calibration names it: host, usable cores, CPU model, kernel release.

    A calibration prices links by what this machine's CPUs and kernel make of them, so one made
    elsewhere (or before a kernel upgrade) is not taken as this machine's.
    """
    return (f"{platform.node()}, {len(os.sched_getaffinity(0))} cores, "
            f"{cpu_model() or 'unknown CPU'}, {platform.system()} {platform.release()}")


def cache_path(shaping: str) -> Path:
    """Where `machine_calibration` keeps the calibration it makes ($XDG_CACHE_HOME/flexbench)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "flexbench" / f"calibration-{shaping}.json"


def machine_calibration(shaping: str, search: list[Path] | None = None) -> tuple[Calibration, str]:
    """This machine's calibration for `shaping`, found or made now, and a line saying which.

    Looks in the cache (`cache_path`) and then in `search` (default: the repository's
    results/calibration/SHAPING.json) for a file fitted on this machine (`this_machine`); else
    runs `calibrate` with the default rates and payloads and keeps the result in the cache.
    """
    search = search if search is not None else [_REPO_CALIBRATIONS / f"{shaping}.json"]
    here = this_machine()
    for path in [cache_path(shaping), *search]:
        if not path.is_file():
            continue
        try:
            found = load_calibration(path, shaping)
        except ValueError:
            continue  # a damaged or foreign file is not this machine's: look further
        if found.machine == here:
            return found, f"found {path}, fitted on this machine ({found.made})"
    print(f"no {shaping} calibration of this machine found; measuring one "
          "(`flexbench calibrate`, about a minute)", file=sys.stderr, flush=True)
    found = calibrate(shaping, list(DEFAULT_RATES), list(DEFAULT_PAYLOADS))
    path = cache_path(shaping)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, found.to_json())
    return found, f"made now on this machine, kept in {path}"


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench calibrate`."""
    parser.add_argument("--shaping", choices=("wall", "kernel"), default="wall",
                        help="the links to calibrate: netsim's wall-clock shaper or Linux tc")
    parser.add_argument("--rates", nargs="+", default=list(DEFAULT_RATES), type=BANDWIDTH.arg,
                        help=f"link rates to time at (default {' '.join(DEFAULT_RATES)})")
    parser.add_argument("--payloads", nargs="+", type=POSITIVE_INT.arg,
                        default=list(DEFAULT_PAYLOADS), metavar="BYTES",
                        help="payload sizes per rank (default 32 KiB, 256 KiB, 2 MiB)")
    parser.add_argument("--repeats", type=POSITIVE_INT.arg, default=5,
                        help="timings per point (median kept)")
    parser.add_argument("--per-op", action="store_true",
                        help="let the model price each op kind with its own fit (fitted and "
                        "written either way; off by default, see docs/shaping.md)")
    parser.add_argument("--out", required=True, help="JSON file for the calibration")


def _check_size(args: argparse.Namespace, gap_s: float = 0.1) -> None:
    """Refuse payloads the ranks cannot hold, or timings the slowest rate cannot finish within
    a measurement's timeout (`_TIMEOUT_S`), before any rank starts (experiments.sizes)."""
    largest = Count("--payloads", max(args.payloads), "bytes a rank")
    # Each of the ranks holds the payload and an all-gather's result of every rank's.
    held = Cost(f"for {_RANKS} ranks' payload and all-gathered copies", bytes=_RANKS * (1 + _RANKS))
    slowest = min(args.rates, key=parse_bandwidth)
    sent = Count("--payloads", sum(args.payloads), "bytes a rank",
                 said=f"--payloads {' '.join(map(str, args.payloads))}")
    repeats = Count("--repeats", args.repeats, "repeats")
    ops = Count("OPS", len(OPS), "collectives")
    points = Count("--payloads", len(args.payloads), "payloads",
                   said=f"--payloads with {len(args.payloads)} sizes")
    wire = Cost(f"to send a byte at {slowest}, as a collective of {_RANKS} ranks sends it at "
                "most twice", seconds=2 / parse_bandwidth(slowest))
    gap = Cost("of idle link before each timing", seconds=gap_s)
    check_work("the calibration", [Term(held, (largest,))])
    check_work(f"timing at {slowest}", [Term(wire, (ops, repeats, sent)),
                                        Term(gap, (ops, repeats, points))],
               budget_s=_TIMEOUT_S, budget=f"the {_TIMEOUT_S:g} s a rate's timings may take")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench calibrate`."""
    out = check_output_file(args.out, what="--out")
    for rate in args.rates:
        parse_bandwidth(rate)  # one sentence on a bad rate, before anything runs
    for flag, values in (("--rates", args.rates), ("--payloads", args.payloads)):
        if len(set(values)) < len(values):  # a point timed twice; two equal sizes fit nothing
            raise ConfigError(f"{flag} lists a value twice ({' '.join(map(str, values))}); "
                              "give each once.")
    if len(args.payloads) < 2 or min(args.payloads) < 4:
        raise ConfigError(f"--payloads needs at least two sizes of 4 bytes or more, got "
                          f"{args.payloads}.")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}.")
    _check_size(args)
    if args.shaping == "kernel":
        from netsim.kernel import check_privileges

        check_privileges()
    try:
        found = calibrate(args.shaping, args.rates, args.payloads, args.repeats,
                          per_op=args.per_op)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"flexbench calibrate: {err}", file=sys.stderr)
        return 1
    write_atomic(out, found.to_json())
    print(f"{found.describe()}; largest fit error {found.max_error():.1%} over "
          f"{len(found.samples)} samples -> {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        _rank_main(json.loads(sys.argv[2]))
