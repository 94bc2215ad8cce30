"""Goodput of kernel-shaped links: one gloo rank per node namespace all-reduces a known payload.

    python -m netsim.kernel_probe --nodes 2 --rate 20Mbit --payload 4MiB --repeats 3

The parent (`measure_goodput`) makes a `KernelNetwork`, starts one rank per node inside its
namespace (`KernelNetwork.start`: torchrun-style environment, rendezvous on node 0's address) and
reads back rank 0's timings. A ring all-reduce of n bytes over p ranks moves 2(p-1)/p * n bytes
each way through every node's link, so goodput = that / the median time; the ratio to the
configured rate is what TCP, framing and gloo leave of the link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from netsim.kernel import KernelNetwork, TcSettings, stop
from netsim.processes import init_process_group
from netsim.units import parse_bandwidth

__all__ = ["measure_goodput", "main"]


def _rank_main(payload: int, repeats: int) -> None:
    """Inside a namespace: time `repeats` all-reduces of `payload` bytes; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from netsim import shaping

    torch.set_num_threads(1)
    init_process_group("gloo")  # env:// rendezvous on MASTER_ADDR:MASTER_PORT
    try:
        data = torch.ones(payload // 4, dtype=torch.float32)
        dist.all_reduce(torch.ones(1024))  # connections made before the clock starts
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(data)
            times.append(time.perf_counter() - t0)
        if dist.get_rank() == 0:
            print(json.dumps({"times_s": times}), flush=True)
    finally:
        shaping.teardown()


def measure_goodput(rate_bps: float, payload: int = 4 << 20, repeats: int = 3,
                    nodes: int = 2, timeout_s: float = 120.0, mtu: int | None = None,
                    node_rates: dict[int, float] | None = None) -> dict:
    """All-reduce `payload` bytes across `nodes` kernel-shaped namespaces; goodput in bytes/s.

    node_rates: {node: bytes/s} for nodes with a rate of their own; the ratio is then taken to
    the slowest rate, which paces the ring.
    """
    settings = TcSettings(rate_bps) if mtu is None else TcSettings(rate_bps, mtu=mtu)
    own = {k: TcSettings(rate, mtu=settings.mtu) for k, rate in (node_rates or {}).items()}
    net = KernelNetwork(nodes, settings, node_settings=own)
    pace = min([rate_bps, *(s.rate_bps for s in own.values())])
    with net:
        argv = [sys.executable, "-m", "netsim.kernel_probe", "--rank", "--payload", str(payload),
                "--repeats", str(repeats)]
        env = {**os.environ, "WORLD_SIZE": str(nodes), "TORCH_CPP_LOG_LEVEL": "ERROR"}
        procs = [net.start(node, argv, env={**env, "RANK": str(node)}, stdout=subprocess.PIPE,
                           text=True) for node in range(nodes)]
        try:
            outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            stop(procs)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a probe rank failed (exit codes {[p.returncode for p in procs]})")
        counters, shown = net.sent_bytes(), net.shaped_rates()
    times = json.loads(outputs[0].strip().splitlines()[-1])["times_s"]
    wire = 2 * (nodes - 1) / nodes * payload
    median = statistics.median(times)
    return {"rate_bps": rate_bps, "mtu": settings.mtu, "payload_bytes": payload,
            "wire_bytes_each_way": wire, "times_s": times, "goodput_bps": wire / median,
            "goodput_ratio": wire / median / pace, "qdisc_sent_bytes": counters,
            "qdisc_rates_bps": shown,
            "asked_rates_bps": {f"{end}{k}": own.get(k, settings).rate_bps
                                for k in range(nodes) for end in "nv"},
            "repeats": repeats}


def main(argv: list[str] | None = None) -> None:
    """Command line: `--rank` inside a namespace; otherwise measure and print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", default="20Mbit")
    p.add_argument("--payload", default=str(4 << 20), help="bytes (or e.g. 4MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mtu", type=int, default=None, help="link MTU (default: TcSettings')")
    args = p.parse_args(argv)
    payload = int(args.payload) if args.payload.isdigit() else int(parse_bandwidth(
        args.payload + "/s"))
    if args.rank:
        _rank_main(payload, args.repeats)
        return
    print(json.dumps(measure_goodput(parse_bandwidth(args.rate), payload, args.repeats,
                                     args.nodes, mtu=args.mtu)))


if __name__ == "__main__":
    main()
