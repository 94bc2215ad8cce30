"""What the emulator relies on in PyTorch's private multi-threaded process group (torch 2.13)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from experiments.run.threaded_group import threaded_world


def _collectives(rank: int) -> tuple[list[float], list[float], list[float], int]:
    """An all-reduce, an all-gather on a subgroup, and a ring of messages, on this rank."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    pair = dist.new_group([0, 1])
    gathered = [torch.zeros(1), torch.zeros(1)]
    if rank in (0, 1):
        dist.all_gather(gathered, torch.tensor([10.0 * rank]), group=pair)
    world = dist.get_world_size()
    inbox = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.tensor([rank, 2.0 * rank]), (rank + 1) % world),
           dist.P2POp(dist.irecv, inbox, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return total.tolist(), [g.item() for g in gathered], inbox.tolist(), dist.get_rank()


@pytest.mark.timeout(60)
def test_threads_are_ranks_with_collectives_and_messages():
    assert torch.__version__.startswith("2.13"), "the threaded group is checked on torch 2.13"
    hook = sys.excepthook
    with threaded_world(4, timeout_s=30) as world:
        results = world.run(_collectives, deadline_s=50)
    for rank, (total, gathered, inbox, me) in enumerate(results):
        assert me == rank and total == [10.0]
        assert gathered == ([0.0, 10.0] if rank < 2 else [0.0, 0.0])
        source = (rank - 1) % 4
        assert inbox == [source, 2.0 * source]
    assert not dist.is_initialized()  # the calling thread's world is restored
    assert torch._C._is_multithreading_enabled()  # and autograd's setting
    assert sys.excepthook is hook  # and the process's excepthook, unwrapped by no rank


def _every_program_op(rank: int) -> dict[str, list[float]]:
    """One collective of every op kind a program can name, called as the replicators call
    them (flat all-gathers, a single-tensor all-to-all), and a message each way."""
    world = dist.get_world_size()
    out = {}
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out["all_reduce"] = total.tolist()
    gathered = torch.zeros(world)
    dist.all_gather_single(gathered, torch.tensor([float(rank)]))
    out["all_gather"] = gathered.tolist()
    swapped = torch.zeros(world)
    dist.all_to_all_single(swapped, torch.arange(world, dtype=torch.float32) + 10 * rank)
    out["all_to_all"] = swapped.tolist()
    mine = torch.zeros(1)
    dist.reduce_scatter_single(mine, torch.arange(world, dtype=torch.float32))
    out["reduce_scatter"] = mine.tolist()
    root = torch.tensor([float(rank)])
    dist.broadcast(root, src=1)
    out["broadcast"] = root.tolist()
    inbox = torch.zeros(1)
    peer = world - 1 - rank
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([float(rank)]), peer),
                                        dist.P2POp(dist.irecv, inbox, peer)]):
        work.wait()
    out["send"] = out["recv"] = inbox.tolist()
    return out


@pytest.mark.timeout(60)
def test_every_op_kind_a_program_names_runs_on_the_threaded_groups():
    # The emulator takes any method with a program (experiments/run/emulate.py) because its
    # groups run every kind in flexdemo.program.OPS, as the replicators call them.
    from flexdemo.program import OPS

    with threaded_world(4, timeout_s=30) as world:
        results = world.run(_every_program_op, deadline_s=50)
    for rank, out in enumerate(results):
        assert set(out) == set(OPS)
        assert out["all_reduce"] == [10.0] and out["all_gather"] == [0.0, 1.0, 2.0, 3.0]
        assert out["all_to_all"] == [rank + 10.0 * r for r in range(4)]
        assert out["reduce_scatter"] == [4.0 * rank] and out["broadcast"] == [1.0]
        assert out["recv"] == [3.0 - rank]


@pytest.mark.timeout(60)
def test_a_failing_rank_ends_the_run_with_its_error():
    def target(rank: int) -> None:
        if rank == 2:
            raise ValueError("rank 2 broke")
        dist.all_reduce(torch.ones(1))

    with threaded_world(4, timeout_s=30) as world, pytest.raises(ValueError, match="rank 2"):
        world.run(target, deadline_s=50)


def _send_before_receive(rank: int) -> list[float]:
    """A ring where every rank waits on its send before its receive (a real backend moves it)."""
    world = dist.get_world_size()
    inbox = torch.zeros(1)
    send = dist.isend(torch.tensor([float(rank)]), (rank + 1) % world)
    receive = dist.irecv(inbox, (rank - 1) % world)
    send.wait()
    receive.wait()
    dist.barrier()
    return inbox.tolist()


@pytest.mark.timeout(60)
def test_one_running_rank_at_a_time_still_completes_every_wait():
    # One run token: every wait on another rank must let it go, or this never ends.
    with threaded_world(4, timeout_s=30, running=1) as world:
        collectives = world.run(_collectives, deadline_s=40)
    assert [total for total, *_ in collectives] == [[10.0]] * 4
    with threaded_world(4, timeout_s=30, running=1) as world:
        assert world.run(_send_before_receive, deadline_s=40) == [[3.0], [0.0], [1.0], [2.0]]
