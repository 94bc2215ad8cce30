"""Launching one run's ranks: spawned on this machine or under torchrun, watched, torn down.

On one machine the launcher spawns nodes x gpus-per-node ranks itself (gloo on CPU, one torch
thread each; with enough GPUs "cpu:gloo,cuda:nccl", a backend per device, so the ranks' small
CPU tensors cross the default group too). They rendezvous through a file and bind their
sockets to loopback, report progress to a stall watchdog and hand their records back as files in
the run's working folder (`experiments.run.folder`). Under torchrun each process runs the rank it is
given, and rank 0 gathers the records:

    torchrun --nnodes 2 --nproc-per-node 8 ... -m experiments.cli run --method flexdemo --nodes 2 \\
        --out runs/flex

Results land in OUT only when the run finished; a crash, a stall or a timeout raises RunFailed
and leaves OUT untouched.
"""

from __future__ import annotations

import math
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from experiments.config import RunConfig
from experiments.deadline import run_deadline
from experiments.errors import ConfigError, RunFailed
from experiments.io import check_output_folder
from experiments.logs import configure_logging
from experiments.run.folder import RunFolder, read_rank_result, write_run
from experiments.run.rank import (
    die_with_launcher,
    raise_on_sigterm,
    rank_error,
    run_one_rank,
)
from experiments.run.watchdog import RankStalled, Watchdog
from flexdemo.devices import backend_for, visible_cuda_devices
from netsim.processes import init_process_group, loopback_interface

__all__ = ["check_spawnable", "check_timeout", "launch", "RunFailed"]


def launch(cfg: RunConfig, out: Path | str, *, timeout_s: float | None = None,
           quiet: bool = False) -> Path:
    """Validate, run every rank of `cfg`, write OUT; on failure raise RunFailed, OUT untouched."""
    check_timeout(timeout_s)
    with run_deadline(timeout_s):  # a user's workload factory is called here the first time
        cfg.validate()
    if cfg.shaping != "kernel":
        _backend(cfg, 1)  # refuses nccl without a GPU before anything is written or spawned
    folder = RunFolder(out)
    if cfg.shaping == "kernel":
        if _under_torchrun():
            raise ConfigError("shaping 'kernel' starts its own ranks in network namespaces on "
                              "this machine; under torchrun use shaping off, wall or virtual.")
        from experiments.run.kernel import run_kernel  # imports netsim's kernel tools

        return run_kernel(cfg, folder, timeout_s=timeout_s, quiet=quiet)
    if _under_torchrun():
        return _run_torchrun(cfg, folder)
    check_spawnable(cfg.world_size)
    return _run_spawned(cfg, folder.create(), timeout_s=timeout_s, quiet=quiet)


def check_timeout(timeout_s: float | None) -> None:
    """ConfigError unless ``timeout_s`` is None or a finite positive number of seconds."""
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout_s}.")


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _backend(cfg: RunConfig, local_ranks: int) -> str:
    """The default group's backend here: one per device with CUDA (flexdemo.devices decides)."""
    try:
        return backend_for(cfg.backend, visible_cuda_devices(), local_ranks)
    except ValueError as err:  # nccl asked for on a machine without a GPU
        raise ConfigError(str(err)) from None


def _run_spawned(cfg: RunConfig, folder: RunFolder, *, timeout_s: float | None,
                 quiet: bool) -> Path:
    """Spawn every rank here; they share files in the working folder, not sockets to the world."""
    import torch.multiprocessing as mp

    backend = _backend(cfg, cfg.world_size)
    # forkserver imports torch and our modules once, then forks every rank from that warm
    # process: four cold interpreters would spend longer importing than a short run trains.
    # flexdemo imports its optimizer, replicators and FSDP2 (and through it sympy) on first use,
    # which is in the ranks: named here, they are imported once too (1-2 s a rank on 2 cores).
    mp.set_forkserver_preload(RANK_MODULES)
    watchdog = Watchdog([folder.progress(r) for r in range(cfg.world_size)], cfg.stall_timeout)
    ctx = None
    previous_handler = raise_on_sigterm()
    try:
        ctx = mp.start_processes(
            _spawned_rank, args=(cfg.to_dict(), backend, str(folder.work), quiet, os.getpid()),
            nprocs=cfg.world_size, join=False, start_method="forkserver",
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            if deadline is not None and time.monotonic() > deadline:
                raise RunFailed(f"run timed out after {timeout_s:g} s")
            watchdog.check()
        return _assemble(folder, [read_rank_result(folder.work, r) for r in range(cfg.world_size)])
    except RankStalled as err:
        raise RunFailed(str(err)) from None
    except mp.ProcessRaisedException as err:
        raise RunFailed(rank_error(str(err), folder.out)) from None
    except mp.ProcessExitedException as err:
        raise RunFailed(f"a rank died: {err}") from None
    finally:
        for p in ctx.processes if ctx is not None else ():
            if p.is_alive():
                p.kill()  # works on a stopped (SIGSTOP) rank too
        folder.discard()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)


def _assemble(folder: RunFolder, results: list) -> Path:
    """Write OUT from the ranks' results; if that fails (a full disk), keep them and say where."""
    try:
        write_run(results, folder.build, folder.code)
        return folder.commit()
    except OSError as err:
        folder.keep = True  # the training is done: its records must not go with the failure
        raise RunFailed(f"the run finished but {str(folder.out)!r} could not be written "
                        f"({err.strerror or err}); every rank's results are kept in "
                        f"{str(folder.work)!r}.") from None


def _spawned_rank(rank: int, cfg_dict: dict, backend: str, work: str, quiet: bool,
                  launcher_pid: int) -> None:
    import torch.distributed as dist

    die_with_launcher(launcher_pid)

    cfg = RunConfig.from_dict(cfg_dict)
    folder = RunFolder(work, work)
    # Every rank is on this machine: gloo's and nccl's sockets listen on loopback only.
    loopback = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = loopback  # forced: an inherited interface could be public
    os.environ["NCCL_SOCKET_IFNAME"] = loopback
    run_one_rank(rank, cfg, backend, folder, quiet,
                 dist.FileStore(str(folder.store), cfg.world_size))


def _run_torchrun(cfg: RunConfig, folder: RunFolder) -> Path:
    """Run the rank torchrun gave us; ranks may be on other hosts, so results travel by gather."""
    import torch.distributed as dist

    from experiments.run.train import run_rank
    from netsim import shaping

    world = int(os.environ["WORLD_SIZE"])
    if world % cfg.nodes:
        raise ConfigError(
            f"torchrun world size {world} is not divisible by --nodes {cfg.nodes}."
        )
    cfg = cfg.replace(gpus_per_node=world // cfg.nodes)
    configure_logging(int(os.environ["RANK"]))
    is_writer = int(os.environ["RANK"]) == 0
    check_output_folder(folder.out)  # on every rank: a refusal must not leave peers waiting
    if is_writer:
        folder.create()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.gpus_per_node))
    # No launcher watches these ranks: a peer that stalls makes the collectives time out.
    init_process_group(_backend(cfg, local), timeout=timedelta(seconds=cfg.stall_timeout))
    try:
        result = run_rank(cfg)  # netsim's NIC files: its default folder, shared by a host's ranks
        gathered: list[Any] | None = [None] * world if is_writer else None
        dist.gather_object(result, gathered, dst=0)
        if is_writer:
            write_run(gathered, folder.build, folder.code)
            folder.commit()
        dist.barrier()
        return folder.out
    finally:
        if is_writer:
            folder.discard()
        shaping.teardown()


# What a spawned rank imports, imported once by the forkserver (_run_spawned says why);
# torch._dynamo comes with the first call of a torch function that disables it (FSDP2's
# DTensor.from_local): another second a rank.
RANK_MODULES = ["experiments.run.train", "flexdemo.build", "flexdemo.hsdp", "flexdemo.optimizer",
                "flexdemo.replicators", "torch._dynamo"]

# What one spawned rank needs at least: an interpreter with torch imported, a model, buffers.
RANK_MEMORY_BYTES = 512 * 2**20
RANKS_PER_CORE = 16


def check_spawnable(world: int) -> None:
    """Refuse more ranks than this machine can hold (cores and memory), before any starts."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = max(1, min(RANKS_PER_CORE * (cores or 1), memory // RANK_MEMORY_BYTES))
    if world > limit:
        raise ConfigError(f"{world} ranks cannot be spawned on this machine ({cores} cores, "
                          f"{memory / 2**30:.0f} GiB): at most {limit}; run across hosts with "
                          "torchrun, or replay a smaller run at this size with `flexbench "
                          "simulate`.")
