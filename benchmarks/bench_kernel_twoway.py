"""Are kernel-shaped links as fast for gloo's all-gather as for a plain two-way TCP exchange?

    python benchmarks/bench_kernel_twoway.py [--rate 20Mbit] [--repeats 7]   # root, idle machine

Two emulated nodes (`netsim.kernel.KernelNetwork`, tbf on both ends of each link) exchange a
payload both ways at once, timed over `--repeats` rounds (each after an idle gap, as after a
step's compute), as

- `1 socket`: one TCP connection carrying both directions (as gloo's one connection per pair);
- `2 sockets`: one connection per direction;
- gloo's all-gather and all-reduce between two ranks (what training sends).

Prints the median time over the link's time (payload / rate; 1.00 is the rate) with the range:
the figures behind the per-op-kind calibration (`netsim.calibration`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from netsim import parse_bandwidth  # noqa: E402
from netsim.kernel import KernelNetwork, TcSettings, stop  # noqa: E402

PORT = 29600
_PEER = r'''
import json, socket, sys, threading, time
role, addr, nbytes, reps, sockets = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
def connect(port):
    if role == "server":
        ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((addr, port)); ls.listen(1); s = ls.accept()[0]
    else:
        for _ in range(200):
            try:
                s = socket.create_connection((addr, port)); break
            except OSError:
                time.sleep(0.05)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
conns = [connect(PORT + k) for k in range(sockets)]
out, inn = (conns[0], conns[-1]) if role == "server" else (conns[-1], conns[0])
def recv(s, n):
    while n:
        n -= len(s.recv(min(1 << 20, n)))
payload, times = b"x" * nbytes, []
for _ in range(reps):
    time.sleep(0.3)
    if role == "client":
        out.sendall(b"s"); recv(inn, 1)
    else:
        recv(inn, 1); out.sendall(b"s")
    t0 = time.perf_counter()
    sender = threading.Thread(target=out.sendall, args=(payload,)); sender.start()
    recv(inn, nbytes); sender.join()
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
'''.replace("PORT", str(PORT))


def _sockets(net: KernelNetwork, nbytes: int, repeats: int, sockets: int) -> list[float]:
    """Seconds of each two-way exchange of `nbytes` between node 0 and node 1."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_PEER)
    args = [net.address(1), str(nbytes), str(repeats), str(sockets)]
    procs = [net.start(1, [sys.executable, f.name, "server", *args], stdout=subprocess.PIPE,
                       text=True),
             net.start(0, [sys.executable, f.name, "client", *args], stdout=subprocess.PIPE,
                       text=True)]
    try:
        out = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        stop(procs)
        os.unlink(f.name)
    return json.loads(out[1])


def _gloo(net: KernelNetwork, op: str, nbytes: int, repeats: int) -> list[float]:
    """Seconds of each gloo `op` of `nbytes` per rank between one rank on each node."""
    spec = {"shaping": "kernel", "rate_bps": 0, "plan": [[op, nbytes]], "repeats": repeats,
            "gap_s": 0.3, "work": ""}
    argv = [sys.executable, "-m", "experiments.replay.calibrate", "--rank", json.dumps(spec)]
    env = {**os.environ, "WORLD_SIZE": "2", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "OMP_NUM_THREADS": "1"}
    procs = [net.start(k, argv, env={**env, "RANK": str(k)}, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True) for k in range(2)]
    try:
        out = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        stop(procs)
    return json.loads(out[0].strip().splitlines()[-1])["times_s"][0]


def main() -> int:
    """Time every case through tbf; print the ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="20Mbit")
    p.add_argument("--payloads", nargs="+", type=int, default=[256 << 10, 2 << 20])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rate = parse_bandwidth(args.rate)
    cases = [("1 socket", lambda n, b: _sockets(n, b, args.repeats, 1)),
             ("2 sockets", lambda n, b: _sockets(n, b, args.repeats, 2)),
             ("gloo all_gather", lambda n, b: _gloo(n, "all_gather", b, args.repeats)),
             ("gloo all_reduce", lambda n, b: _gloo(n, "all_reduce", b, args.repeats))]
    print(f"time / (payload / rate) at {args.rate}, median [min-max] of {args.repeats}")
    print("| case | payload | time / link time |")
    print("| --- | --- | --- |")
    for name, measure in cases:
        for nbytes in args.payloads:
            with KernelNetwork(2, TcSettings(rate)) as net:
                ratios = [t * rate / nbytes for t in measure(net, nbytes)]
            print(f"| {name} | {nbytes:,} | {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}] |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
