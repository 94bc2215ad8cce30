"""Spawning small gloo worlds on loopback for the multi-process tests.

Ranks meet through a file (a FileStore, as spawned runs do) rather than a TCPStore, which would
listen on every interface; gloo's own sockets stay on the loopback interface.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.run.launch import RANK_MODULES
from netsim import shaping
from netsim.processes import init_process_group, loopback_interface


def init_loopback(rank: int, world: int, store: str) -> None:
    """Join a gloo world of `world` ranks through the file `store`, sockets on loopback only."""
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    # Each rank gets one thread so a 4-rank world does not oversubscribe a 2-core machine.
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _entry(rank: int, world: int, store: str, fn: Callable, args: tuple) -> None:
    init_loopback(rank, world, store)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        shaping.teardown()


# mp.spawn starts fresh interpreters, which spent longer importing torch and the packages than
# most of these tests run; a forkserver imports them once and forks every rank from there. It is
# the launcher's forkserver too (started by whichever comes first), so it preloads its modules.
PRELOAD = ["tests.dist_utils", *RANK_MODULES]


def spawn(fn: Callable, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` on `nprocs` processes forked from the forkserver; joined, re-raised."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def run_ranks(fn: Callable, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; any failure re-raises."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        spawn(_entry, (world, str(Path(tmp) / "store"), fn, args), world)


class TinyBlocks(torch.nn.Module):
    """Two repeated blocks (FSDP2 shards each) and a head; sizes shard unevenly over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(9, 9) for _ in range(2)])
        self.head = torch.nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def shaped_world(rank: int, nodes: int, per_node: int, method: str, **knobs):
    """TinyBlocks under `method` on a netsim-recorded world: recorder, model, mesh, opt."""
    import flexdemo
    from netsim import Link, Topology, TraceRecorder, shaping

    recorder = TraceRecorder(rank)
    shaping.install(Topology(nodes=nodes, accelerators_per_node=per_node,
                             intra=Link("100Gbit"), inter=Link("1Gbit")), mode="off",
                    recorder=recorder)
    torch.manual_seed(0)
    model = TinyBlocks()
    mesh = flexdemo.build_mesh(nodes, per_node, backend=shaping.BACKEND)
    record = flexdemo.method_record(method).wired(knobs)
    flexdemo.parallelize(model, mesh, inter_all_reduce=record.inter_all_reduce)
    return recorder, model, mesh, flexdemo.build_optimizer(method, model, mesh, lr=0.01, **knobs)


def train_step(model, opt, recorder, rank: int, step: int) -> None:
    """One recorded training step on this rank's own data."""
    g = torch.Generator().manual_seed(step * 100 + rank)  # every rank its own data
    x, y = torch.randn(6, 9, generator=g), torch.randn(6, 3, generator=g)
    recorder.begin_step(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    recorder.end_step(step)


def inter_rows(recorder, step: int):
    """The recorder's inter-node collective rows of `step`."""
    trace = recorder.frame()
    return trace[(trace["step"] == step) & (trace["kind"] == "collective") & trace["inter"]]


def threads_after_exits(wait_s: float = 5.0) -> list[str]:
    """This process's thread names, once no gloo thread is listed or after `wait_s`.

    A joined thread can stay listed in /proc for a moment after the join returns (the kernel
    clears the thread id the join waits on before it removes the task); a thread still running,
    as gloo's are while a group is alive, stays listed for good.
    """
    deadline = time.monotonic() + wait_s
    while True:
        names = []
        for task in Path("/proc/self/task").iterdir():
            try:
                names.append((task / "comm").read_text().strip())
            except OSError:  # the task ended between the listing and the read
                continue
        if not any("gloo" in n for n in names) or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def fsdp2_shards(layout: list[list[list[int]]], per_node: int, index: int) -> list[tuple[int, ...]]:
    """The shard shapes local rank ``index`` of a node holds, from a run's FSDP2 ``layout``
    (run.json): FSDP2 cuts dim 0 as torch.chunk does."""
    out = []
    for shape in (s for unit in layout for s in unit):
        rows = -(-shape[0] // per_node)
        mine = max(0, min(rows, shape[0] - index * rows))
        out.append((mine, *shape[1:]))
    return out
