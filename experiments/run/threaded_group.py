"""Ranks as threads of one process: PyTorch's multi-threaded process group, with messages.

`torch.testing._internal.distributed.multi_threaded_pg` is private to PyTorch (its own tests
use it), so this is the only module that imports it, and `tests/experiments/test_threaded_group.py`
checks what we rely on against the pinned torch. It gives every thread its own default group and
group table (a thread-local `_world`) and runs each collective once, on the group's rank-0
thread, for all ranks. It has no point-to-point messages; gossip needs them
(`dist.batch_isend_irecv`), so the group made here adds send and receive through per-group
mailboxes: whichever of a send and its receive is posted second copies the sender's tensor into
the receiver's (no copy in between), and both are then complete.

Hundreds of runnable threads on a few cores spend most of their time handing the GIL and the
cores to each other (at 256 ranks the kernel's time was most of the run). So a rank runs only
while it holds one of a few run tokens (one a core), and lets its token go wherever it waits
for other ranks: in a collective, a receive, and the barrier of group creation. Every wait of
one rank on another must be one of those, or a rank holding a token could wait forever for one
that has none.

    with threaded_world(world_size) as world:
        world.run(target)  # target(rank) in one thread per rank, each in its own default group
"""

from __future__ import annotations

import collections
import functools
import os
import sys
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

# Posted and unmatched: (group name, source, destination, tag) -> sends or receives (one kind
# at a time: a post of the other kind matches the oldest), with whether each is a send.
_MAILBOXES: dict[tuple[str, int, int, int], collections.deque[tuple[bool, _Posted]]] = {}
_MAILBOX_LOCK = threading.Lock()
_STOP = threading.Event()  # set when a rank failed: receives stop waiting


class _RunTokens:
    """At most `count` rank threads run at once; a rank lets its token go while it waits."""

    def __init__(self, count: int) -> None:
        self.slots = threading.Semaphore(count)  # FIFO: waiting ranks take turns
        self.held = threading.local()

    def take(self) -> None:
        """Block until this thread holds a token."""
        self.slots.acquire()
        self.held.value = True

    def give(self) -> None:
        """Let this thread's token go (nothing if it holds none)."""
        if getattr(self.held, "value", False):
            self.held.value = False
            self.slots.release()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait on other ranks: the token goes, and comes back after (if it was held)."""
        held = getattr(self.held, "value", False)
        self.give()
        try:
            yield
        finally:
            if held:
                self.take()


_TOKENS = _RunTokens(1)  # replaced by each threaded_world


def _waits_for_peers(method: Callable) -> Callable:
    """A collective of the threaded group that lets the rank's token go while it waits."""
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _TOKENS.waiting():
            return method(*args, **kwargs)
    return wrapped


def _until(ready: Callable[[float], bool], what: str) -> None:
    """Return once `ready(timeout_s)` is true, the token let go while waiting; stop if a rank
    failed meanwhile."""
    if ready(0.0):
        return
    with _TOKENS.waiting():
        while not ready(0.5):
            if _STOP.is_set():
                raise RuntimeError(f"a peer rank failed while this one waited for {what}")


class _Posted(dist.Work):
    """A posted send or receive; done once the message was copied into the receiver's tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor, self.copied = tensor.detach(), threading.Event()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the message was copied (or a rank failed)."""
        _until(self.copied.wait, "a message")
        return True

    def is_completed(self) -> bool:
        """Whether the message was copied."""
        return self.copied.is_set()


def _post(key: tuple[str, int, int, int], sending: bool, tensor: torch.Tensor) -> _Posted:
    """Post a send or a receive on `key`; if its counterpart is there, copy the message now.

    Whichever of the two comes second copies, so a message moves while both sides are still
    posting, as a real backend's do: a rank may wait on its send before its own receive. The
    sender's tensor itself is read, so it must not change before the send is done, as with gloo.
    """
    mine = _Posted(tensor)
    with _MAILBOX_LOCK:
        posted = _MAILBOXES.setdefault(key, collections.deque())
        if not posted or posted[0][0] == sending:  # all waiting entries are of one kind
            posted.append((sending, mine))
            return mine
        other = posted.popleft()[1]
    send, receive = (mine, other) if sending else (other, mine)
    receive.tensor.copy_(send.tensor)
    send.copied.set()
    receive.copied.set()
    return mine


class _MessagingGroup(_mtpg.ProcessLocalGroup):
    """PyTorch's thread-local group plus send/recv matched in mailboxes."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Post a send of the tensor (not a copy) to `dst`."""
        return _post((self.pg_name, self._rank, dst, tag), True, tensors[0])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Post a receive from `src` into the tensor."""
        return _post((self.pg_name, src, self._rank, tag), False, tensors[0])


# Every collective of PyTorch's group waits for the group's other ranks.
for _name in ("allreduce", "allreduce_coalesced", "allgather", "all_gather_single_coalesced",
              "broadcast", "scatter", "gather", "reduce_scatter", "alltoall",
              "all_to_all_single"):
    setattr(_MessagingGroup, _name, _waits_for_peers(getattr(_mtpg.ProcessLocalGroup, _name)))


def _create(store: Any, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """Backend creator: one messaging group for this thread, after all its members arrived."""
    group = _MessagingGroup(rank, world_size)
    # Different threads may make different subgroups at once: wait for the whole group first,
    # as PyTorch's own threaded creator does.
    with _TOKENS.waiting():
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
        _TOKENS.take()
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
            _TOKENS.give()

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
def threaded_world(size: int, timeout_s: float = 600.0,
                   running: int | None = None) -> Iterator[ThreadedWorld]:
    """Install the thread-local group table for `size` thread ranks; restore it on exit.

    At most `running` ranks run at once (default: one a core this process may use).
    """
    global _TOKENS
    _TOKENS = _RunTokens(running or len(os.sched_getaffinity(0)))
    _mtpg.ProcessLocalGroup.reset()
    _STOP.clear()
    with _MAILBOX_LOCK:
        _MAILBOXES.clear()
    multithreaded_autograd = torch._C._is_multithreading_enabled()
    excepthook = sys.excepthook
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
        # Every rank's init_process_group wraps sys.excepthook to prefix "[rankN]: " and never
        # unwraps it: left, a later error of this process would print with `size` prefixes.
        sys.excepthook = excepthook
        _mtpg.ProcessLocalGroup.reset()
        with _MAILBOX_LOCK:
            _MAILBOXES.clear()
