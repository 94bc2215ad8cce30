"""One launcher-watched rank: join the group, train, hand the result back, leave cleanly.

The launcher (`experiments.run.launch`, `experiments.run.kernel`) starts processes; each of them
runs `run_one_rank`, which calls the training body in `experiments.run.train`.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from experiments.config import RunConfig
from experiments.errors import Stopped, is_users_file
from experiments.logs import configure_logging
from experiments.run.folder import RunFolder, write_rank_result
from experiments.run.watchdog import Heartbeat
from netsim.processes import init_process_group, pid_alive

__all__ = ["die_with_launcher", "pin_to_core", "raise_on_sigterm", "rank_error", "run_one_rank"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def raise_on_sigterm():
    """Make SIGTERM (Slurm's, a user's kill) stop the ranks and clean up; the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise Stopped("stopped by SIGTERM")

    return signal.signal(signal.SIGTERM, stop)


def run_one_rank(rank: int, cfg: RunConfig, backend: str, folder: RunFolder, quiet: bool,
                 store: Any) -> None:
    """One launcher-watched rank: join `store`, train, leave its result in the working folder."""
    import torch
    import torch.distributed as dist

    from netsim import shaping

    torch.set_num_threads(cfg.threads_per_rank)
    if cfg.pin_cores:
        pin_to_core(rank)
    _quiet_tqdm_internals()
    configure_logging(rank)
    if quiet:
        os.environ["TQDM_DISABLE"] = "1"
    heartbeat = Heartbeat(folder.progress(rank))
    # The launcher's watchdog ends stalled runs; the collective timeout is only a backstop.
    init_process_group(backend, store=store, rank=rank, world_size=cfg.world_size,
                       timeout=timedelta(seconds=max(600.0, 2 * cfg.stall_timeout)))
    try:
        from experiments.run.train import run_rank

        result = run_rank(cfg, heartbeat=heartbeat.beat, run_dir=str(folder.work))
        write_rank_result(result, folder.work)
        dist.barrier()  # leave together: no rank tears down while a peer still talks to it
    finally:
        shaping.teardown()
        heartbeat.close()


def pin_to_core(rank: int) -> None:
    """Run this process on one core, rank mod the cores it may use (ranks of a node differ).

    With more ranks than cores the scheduler otherwise moves ranks around differently in every
    run, so a recording and a shaped run of the same step see different contention.
    """
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _quiet_tqdm_internals() -> None:
    """A thread lock instead of tqdm's process-shared semaphore and no monitor thread.

    A killed rank would leave the semaphore to the resource tracker, which then warns on the
    launcher's stderr; the monitor thread would outlive the run into interpreter shutdown.
    """
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    tqdm.tqdm.monitor_interval = 0


def die_with_launcher(launcher_pid: int) -> None:
    """End this rank when the launcher dies, even by SIGKILL: orphans would train on for nothing.

    A kernel rank's parent is the launcher itself (the kernel's parent-death signal suffices);
    a spawned rank's parent is the launcher's forkserver, which outlives the launcher as long as
    its children hold its pipe, so a thread waits on the launcher's exit too.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        exited = os.pidfd_open(launcher_pid)  # readable once the launcher has exited
    except (AttributeError, OSError):  # not Linux >= 5.3, or the launcher is already gone
        exited = None
    if exited is None and not pid_alive(launcher_pid):
        os._exit(1)
    if exited is not None:
        threading.Thread(target=_exit_when_readable, args=(exited,), daemon=True,
                         name="die-with-launcher").start()


def _exit_when_readable(fd: int) -> None:
    """Block until `fd` (a pidfd) is readable, i.e. its process has exited; then leave at once."""
    select.select([fd], [], [])
    os._exit(1)


def rank_error(text: str, out: Path) -> str:
    """A rank's error in one line, pointing at the user's own code and the whole traceback.

    The traceback goes to a log file beside OUT (OUT itself is never written on failure).
    """
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else text
    log = out.parent / f"{out.name}.error.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text.strip() + "\n")
    except OSError:
        return last
    frames = re.findall(r'File "([^"]+)", line (\d+)', text)
    theirs = [(f, n) for f, n in frames if is_users_file(f)]
    where = f" at {theirs[-1][0]}:{theirs[-1][1]}" if theirs else ""
    return f"{last}{where} (the whole traceback: {log})"
