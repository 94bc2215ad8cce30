"""Small real gloo jobs profiled by torch.profiler as a user's own job would be, for import tests.

`profile_jobs(folder)` spawns 4 gloo ranks (2 nodes x 2) that run four jobs, each under its own
profiler with one ProfilerStep per step, and leave one trace per rank in folder/JOB/. Plain gloo
writes no record_param_comms: no collective's group is in the trace, only its c10d op's shapes.

- "fsdp": a hand-written FSDP step over all ranks: all-gather the shards, forward and backward,
  reduce-scatter the gradient, and a DDP-style all-reduce of a gradient bucket;
- "pipeline": each rank sends its activations to the next stage (send/recv);
- "tensor": a row-parallel layer all-reduces its output in the forward;
- "hsdp": the FSDP step in a node's group and the all-reduce across nodes, on subgroups made
  after the jobs above (whose traces then know the world group alone).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from netsim.processes import loopback_interface

__all__ = ["SHARD", "STEPS", "profile_jobs"]

WORLD, PER_NODE = 4, 2
STEPS = 3
SHARD = 1024  # elements of a rank's shard of the one parameter


def _profiled(folder: Path, rank: int, steps: int, body) -> None:
    """`body(step)` for `steps` steps under torch.profiler, one ProfilerStep each."""
    from torch.profiler import ProfilerActivity, profile, schedule

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.pt.trace.json.gz"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for step in range(steps + 1):
            body(step)
            prof.step()


def _sharded(rank: int, shard_group, replicate_group):
    """One step of a sharded linear layer: gather, compute, reduce-scatter, all-reduce."""
    shard = torch.randn(SHARD, generator=torch.Generator().manual_seed(rank))
    shards = dist.get_world_size(shard_group)

    def step(_: int) -> None:
        full = torch.empty(SHARD * shards)
        dist.all_gather_into_tensor(full, shard, group=shard_group)
        weight = full.view(-1, 64).requires_grad_()
        loss = (torch.randn(8, weight.shape[0]) @ weight).square().mean()
        loss.backward()
        grad = torch.empty(SHARD)
        dist.reduce_scatter_tensor(grad, weight.grad.flatten(), group=shard_group)
        dist.all_reduce(grad, group=replicate_group)
        shard.sub_(1e-3 * grad)

    return step


def _pipeline(rank: int):
    def step(_: int) -> None:
        acts = torch.randn(256)
        if rank % 2 == 0:
            dist.send(acts, rank + 1)
        else:
            dist.recv(acts, rank - 1)

    return step


def _tensor(rank: int):
    weight = torch.randn(64, 64, requires_grad=True)

    def step(_: int) -> None:
        out = torch.randn(8, 64) @ weight
        dist.all_reduce(out.detach())  # a row-parallel layer sums its partial outputs
        out.square().mean().backward()

    return step


def _rank(rank: int, folder: str, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank,
                            world_size=WORLD)
    root = Path(folder)
    world = dist.group.WORLD
    _profiled(root / "fsdp", rank, STEPS, _sharded(rank, world, world))
    _profiled(root / "pipeline", rank, 2, _pipeline(rank))
    _profiled(root / "tensor", rank, 2, _tensor(rank))
    shards = [dist.new_group([n * PER_NODE + j for j in range(PER_NODE)])
              for n in range(WORLD // PER_NODE)]
    replicas = [dist.new_group(list(range(j, WORLD, PER_NODE))) for j in range(PER_NODE)]
    _profiled(root / "hsdp", rank, STEPS,
              _sharded(rank, shards[rank // PER_NODE], replicas[rank % PER_NODE]))
    dist.barrier()
    dist.destroy_process_group()


def profile_jobs(folder: Path) -> Path:
    """Run the three jobs on 4 spawned gloo ranks; their traces land in folder/JOB/."""
    import torch.multiprocessing as mp

    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()  # nothing listens beyond this host
    mp.start_processes(_rank, args=(str(folder), str(folder / "store")), nprocs=WORLD,
                       start_method="spawn")
    return folder
