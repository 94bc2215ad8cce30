"""Benchmark FlexDeMo against the reference DeMo (PyPI ``detonation``) and AdamW + all-reduce.

Runbook:
    pip install -e '.[reference]' einops mltiming   # optional: the reference implementation
    python benchmarks/bench_flexdemo.py [--steps 30] [--warmup 5]

Spawns 2 gloo ranks (2 nodes × 1 rank, one CPU thread each) on a 2.1M-parameter MLP
(4 × [Linear(256, 1024), GELU, Linear(1024, 256)], 16 tensors), topk 32, chunk 64, and prints
per method: bytes sent per step per node, collective calls per step and the median optimizer-step
time (collectives included, forward/backward excluded), then the ratios against the targets:
bytes <= 0.5× and step time <= 1/3 of the reference.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from flexdemo import FlexDeMo, all_reduce_bytes

TOPK, CHUNK, LR = 32, 64, 1e-3
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce")


def mlp() -> nn.Module:
    """The benchmark model: 4 × [Linear(256, 1024), GELU, Linear(1024, 256)]."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)]
    return nn.Sequential(*layers)


class _CallCounter:
    """Counts collective calls by wrapping the torch.distributed entry points."""

    def __init__(self) -> None:
        self.calls = 0
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn))

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return counted


def _reference(model: nn.Module, solo: dist.ProcessGroup):
    try:
        from detonation.optim.demo import DeMo
    except Exception:  # any import problem means: no reference in this environment
        return None
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its chunk sizes
        opt = DeMo(model.parameters(), compression_decay=0.999, compression_topk=TOPK,
                   compression_chunk=CHUNK, sharding_parallel_group=solo,
                   replication_parallel_group=dist.group.WORLD, lr=LR)
    return opt


class _AdamWAllReduce:
    """AdamW after one bucketed all-reduce (average) of all gradients: the full-sync baseline."""

    def __init__(self, model: nn.Module, world: int):
        self.params = list(model.parameters())
        self.inner = torch.optim.AdamW(self.params, lr=LR)
        self.world = world
        self.last_bytes = 0

    def step(self) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat)
        flat.div_(self.world)
        self.last_bytes = all_reduce_bytes(flat.numel() * flat.element_size(), self.world)
        for p, g in zip(self.params, flat.split([p.numel() for p in self.params]), strict=True):
            p.grad.copy_(g.view_as(p))
        self.inner.step()


def _record(opt, counter_calls: int) -> tuple[int, int]:
    if isinstance(opt, FlexDeMo):
        return opt.last_step_comm["bytes_sent"], counter_calls
    if isinstance(opt, _AdamWAllReduce):
        return opt.last_bytes, counter_calls
    return opt.replicators[0].data_transmitted[-1], counter_calls


def _worker(rank: int, world: int, port: int, steps: int, warmup: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    solos = [dist.new_group([r]) for r in range(world)]  # reference: no sharding
    counter = _CallCounter()
    makers = [
        ("flexdemo bf16", lambda m: FlexDeMo(m.parameters(), lr=LR, compression_topk=TOPK,
                                             compression_chunk=CHUNK)),
        ("flexdemo fp32", lambda m: FlexDeMo(m.parameters(), lr=LR, compression_topk=TOPK,
                                             compression_chunk=CHUNK,
                                             value_dtype=torch.float32)),
        ("reference DeMo", lambda m: _reference(m, solos[rank])),
        ("AdamW+all-reduce", lambda m: _AdamWAllReduce(m, world)),
    ]
    runs = []
    for name, make in makers:
        model = mlp()
        opt = make(model)
        if opt is not None:
            runs.append({"name": name, "model": model, "opt": opt, "ms": [], "cpu_ms": [],
                         "bytes": [], "calls": []})
    # Methods take turns step by step, so background load hits all of them alike.
    for step in range(warmup + steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(16, 256, generator=g)
        for run in runs:
            run["model"].zero_grad()
            run["model"](x).pow(2).mean().backward()
            dist.barrier()
            before = counter.calls
            t0, c0 = time.perf_counter(), time.thread_time()
            run["opt"].step()
            elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
            sent, calls = _record(run["opt"], counter.calls - before)
            if step >= warmup:
                run["ms"].append(elapsed * 1e3)
                run["cpu_ms"].append(cpu * 1e3)
                run["bytes"].append(sent)
                run["calls"].append(calls)
    if rank == 0:
        _report([{"name": r["name"], "bytes": statistics.median(r["bytes"]),
                  "calls": statistics.median(r["calls"]), "ms": statistics.median(r["ms"]),
                  "cpu_ms": statistics.median(r["cpu_ms"])}
                 for r in runs], steps)
    dist.barrier()
    dist.destroy_process_group()


def _report(rows, steps) -> None:
    print(f"2 nodes x 1 rank, gloo, 1 thread/rank, MLP 2.1M params, topk {TOPK}, chunk {CHUNK}, "
          f"median of {steps} steps, methods interleaved step by step; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    # CPU ms (process time, gloo threads included) is what the step costs when the machine is
    # shared; wall ms is the target's measure and suffers most from waiting on a busy peer.
    print(f"{'method':<18}{'bytes/step/node':>17}{'calls/step':>12}{'step ms':>10}"
          f"{'CPU ms':>9}")
    for r in rows:
        print(f"{r['name']:<18}{int(r['bytes']):>17,}{r['calls']:>12g}{r['ms']:>10.1f}"
              f"{r['cpu_ms']:>9.1f}")
    ref = next((r for r in rows if r["name"] == "reference DeMo"), None)
    if ref is None:
        print("reference DeMo not importable: pip install detonation==0.5.2 einops mltiming")
        return
    for r in rows:
        if r["name"].startswith("flexdemo"):
            b, t = r["bytes"] / ref["bytes"], r["ms"] / ref["ms"]
            c = r["cpu_ms"] / ref["cpu_ms"]
            # The byte target is for the default bf16 values; fp32 reproduces DeMo's numbers.
            verdict = ("ok" if b <= 0.5 else "MISSED") if "bf16" in r["name"] else "n/a"
            print(f"{r['name']}: bytes {b:.3f}x reference (target <= 0.5 for bf16: "
                  f"{verdict}), step time {t:.3f}x reference "
                  f"(target <= 0.333: {'ok' if t <= 1 / 3 else 'MISSED'}), CPU time {c:.3f}x")


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run the benchmark on two spawned ranks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, args.steps, args.warmup), nprocs=2, join=True)


if __name__ == "__main__":
    main()
