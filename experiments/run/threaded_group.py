"""Ranks as threads of one process: PyTorch's multi-threaded process group, with messages.

`torch.testing._internal.distributed.multi_threaded_pg` is private to PyTorch (its own tests
use it), so this is the only module that imports it, and `tests/experiments/test_threaded_group.py`
checks what we rely on against the pinned torch. It gives every thread its own default group and
group table (a thread-local `_world`) and runs each collective once, on the group's rank-0
thread, for all ranks. It has no point-to-point messages; gossip needs them
(`dist.batch_isend_irecv`), so the group made here adds send and receive through per-group
mailboxes: a send copies its tensor into the receiver's mailbox and completes at once, a
receive waits for it, so posting every send and receive before waiting cannot deadlock.

    with threaded_world(world_size) as world:
        world.run(target)  # target(rank) in one thread per rank, each in its own default group
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg as _mtpg

__all__ = ["BACKEND", "ThreadedWorld", "threaded_world"]

BACKEND = "emulated"
"""The backend name threads' groups are made with (registered on import)."""

# Messages in flight: (group name, source, destination, tag) -> tensors sent, oldest first.
_MAILBOXES: dict[tuple[str, int, int, int], queue.Queue] = {}
_MAILBOX_LOCK = threading.Lock()
_STOP = threading.Event()  # set when a rank failed: receives stop waiting


def _mailbox(key: tuple[str, int, int, int]) -> queue.Queue:
    with _MAILBOX_LOCK:
        return _MAILBOXES.setdefault(key, queue.Queue())


class _Receive(dist.Work):
    """A pending receive: wait() takes the sender's tensor from the mailbox and copies it."""

    def __init__(self, box: queue.Queue, tensor: torch.Tensor) -> None:
        super().__init__()
        self.box, self.tensor, self.done = box, tensor, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the message is there (or a rank failed), then fill the tensor."""
        while not self.done:
            try:
                sent = self.box.get(timeout=0.5)
            except queue.Empty:
                if _STOP.is_set():
                    raise RuntimeError("a peer rank failed while this one waited for its "
                                       "message") from None
                continue
            self.tensor.detach().copy_(sent)
            self.done = True
        return True

    def is_completed(self) -> bool:
        """Whether wait() has copied the message."""
        return self.done


class _MessagingGroup(_mtpg.ProcessLocalGroup):
    """PyTorch's thread-local group plus send/recv through mailboxes."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Copy the tensor into `dst`'s mailbox; complete at once."""
        _mailbox((self.pg_name, self._rank, dst, tag)).put(tensors[0].detach().clone())
        return _mtpg.ret_work(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """A receive from `src` that wait() completes."""
        return _Receive(_mailbox((self.pg_name, src, self._rank, tag)), tensors[0])


def _create(store: Any, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """Backend creator: one messaging group for this thread, after all its members arrived."""
    group = _MessagingGroup(rank, world_size)
    # Different threads may make different subgroups at once: wait for the whole group first,
    # as PyTorch's own threaded creator does.
    dist.distributed_c10d._store_based_barrier(rank, store, "", world_size, timeout)
    return group


if not hasattr(dist.Backend, BACKEND.upper()):
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


class ThreadedWorld:
    """A world of `size` thread ranks sharing one store; run() starts them and joins them."""

    def __init__(self, size: int, timeout_s: float) -> None:
        """`timeout_s` bounds group creation and each wait of a collective's rendezvous."""
        self.size, self.timeout = size, timedelta(seconds=timeout_s)
        self.store = dist.HashStore()
        self.errors: list[BaseException | None] = [None] * size

    def _rank(self, rank: int, target: Callable[[int], Any], out: list[Any]) -> None:
        try:
            dist.init_process_group(BACKEND, rank=rank, world_size=self.size, store=self.store,
                                    timeout=self.timeout)
            out[rank] = target(rank)
        except BaseException as err:  # noqa: BLE001 - handed to the caller, peers woken
            self.errors[rank] = err
            _STOP.set()
            _mtpg.ProcessLocalGroup.exception_handle(err)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def run(self, target: Callable[[int], Any], deadline_s: float | None = None) -> list[Any]:
        """`target(rank)` in one thread per rank; their results, or the first rank's error.

        TimeoutError if they are not done within `deadline_s` (the threads are told to stop).
        """
        out: list[Any] = [None] * self.size
        threads = [threading.Thread(target=self._rank, args=(r, target, out), daemon=True,
                                    name=f"rank-{r}") for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(deadline_s)  # a rough bound: each join waits at most deadline_s more
            if thread.is_alive():
                _STOP.set()
                _mtpg.ProcessLocalGroup.exception_handle(TimeoutError())
                raise TimeoutError(f"the emulated ranks were not done after {deadline_s:g} s")
        first = next((e for e in self.errors if e is not None and not isinstance(e, SystemExit)),
                     None)
        if first is None:
            first = next((e for e in self.errors if e is not None), None)
        if first is not None:
            raise first
        return out


@contextmanager
def threaded_world(size: int, timeout_s: float = 600.0) -> Iterator[ThreadedWorld]:
    """Install the thread-local group table for `size` thread ranks; restore it on exit."""
    _mtpg.ProcessLocalGroup.reset()
    _STOP.clear()
    with _MAILBOX_LOCK:
        _MAILBOXES.clear()
    multithreaded_autograd = torch._C._is_multithreading_enabled()
    _mtpg._install_threaded_pg()
    # The C++ registry of groups by name is per thread too (every thread names its groups alike).
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        yield ThreadedWorld(size, timeout_s)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _mtpg._uninstall_threaded_pg()
        # Each threaded group turns autograd's multithreading off when made and never back on.
        torch.autograd.set_multithreading_enabled(multithreaded_autograd)
        _mtpg.ProcessLocalGroup.reset()
        with _MAILBOX_LOCK:
            _MAILBOXES.clear()
