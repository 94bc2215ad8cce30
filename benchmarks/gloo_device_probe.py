"""Which collectives gloo takes with tensors on a device: two ranks on this machine, one each.

    python benchmarks/gloo_device_probe.py --device cuda --out results/gpu/gloo_cuda.json

Every collective the toolkit's methods and FSDP2 issue is tried once on a 2-rank gloo group
whose tensors live on `--device` (both ranks share GPU 0 on a one-GPU machine), and its result
checked against the CPU answer; the JSON lists, per collective, "ok" or the error gloo gave.
A lent GPU machine has one GPU, so this is how the 2-node x 1-rank gloo path is checked there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gloo import join_gloo  # noqa: E402

from netsim import shaping  # noqa: E402

WORLD = 2


def _probes(device: torch.device, rank: int) -> dict:
    """Name -> a function running one collective and returning whether its result is right."""
    x = lambda: torch.full((4,), float(rank + 1), device=device)  # noqa: E731

    def all_reduce() -> bool:
        t = x()
        dist.all_reduce(t)
        return bool((t == 3).all())

    def broadcast() -> bool:
        t = x()
        dist.broadcast(t, src=0)
        return bool((t == 1).all())

    def all_gather_into_tensor() -> bool:
        out = torch.empty(8, device=device)
        dist.all_gather_into_tensor(out, x())
        return out.tolist() == [1.0] * 4 + [2.0] * 4

    def all_gather() -> bool:
        out = [torch.empty(4, device=device) for _ in range(WORLD)]
        dist.all_gather(out, x())
        return [o[0].item() for o in out] == [1.0, 2.0]

    def reduce_scatter_tensor() -> bool:
        out = torch.empty(2, device=device)
        dist.reduce_scatter_tensor(out, x())
        return bool((out == 3).all())

    def send_recv() -> bool:
        t = x()
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, got := x(), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return bool((got == peer + 1).all())

    return {f.__name__: f for f in (all_reduce, broadcast, all_gather_into_tensor, all_gather,
                                    reduce_scatter_tensor, send_recv)}


def _rank(rank: int, store: str, device_name: str, out: str) -> None:
    join_gloo(rank, WORLD, store)
    device = torch.device(device_name)
    found = {}
    for name, probe in _probes(device, rank).items():
        try:
            found[name] = "ok" if probe() else "wrong result"
        except Exception as err:  # noqa: BLE001 -- what gloo refuses is the finding
            found[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"device": device_name, "torch": torch.__version__,
                                         "collectives": found}, indent=2) + "\n")
    shaping.teardown()


def main() -> int:
    """Probe every collective on 2 gloo ranks, write the JSON, print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"), args.device, args.out),
                           nprocs=WORLD, start_method="spawn")
    print(Path(args.out).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
