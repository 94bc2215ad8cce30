"""Emulated runs: N data-parallel replicas trained in one process, one thread a rank.

`flexbench run --emulate` trains what a real run of the same settings trains, rank r on rank r's
data shard, with the method's real replicator and its real exchange (the collectives go through
PyTorch's multi-threaded process group, `experiments.run.threaded_group`), so its loss and
replica variance per step are the real run's (`tests/experiments/test_emulate.py` checks them
against gloo for every replicator). It takes every method whose replicator writes a program
(`flexdemo.program`): the program names the collectives the method runs, and the threaded
groups run every kind a program can name (`flexdemo.program.OPS`). It is data-parallel with one
rank a node (no FSDP2 sharding inside a node) and measures no time: steps.parquet has the loss,
val_loss, replica_variance and consensus_distance per step, and NaN for wall_time_s and
compute_s; there is no trace.parquet and no byte counts; run.json says `"executor":
"emulated"`. Such a run is a loss curve (`flexbench simulate RUN --loss-from EMULATED`), never
a trace to replay.

    flexbench run --emulate --method gossip --graph ring --nodes 64 --gpus-per-node 1 \\
        --workload vision-tiny --steps 200 --out runs/gossip-64-emulated
"""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path
from typing import Any

from experiments.config import RunConfig, is_plugin
from experiments.errors import ConfigError, RunFailed
from experiments.io import EMULATED
from experiments.run.folder import RankResult, RunFolder, write_emulated_run
from experiments.sizes import available_bytes as _available_bytes
from experiments.sizes import format_bytes
from flexdemo.methods import Method

__all__ = ["check_emulated", "emulate", "emulation_problem", "estimate_bytes", "inbox_peers",
           "replica_size", "unused_settings"]


def emulation_problem(record: Method, plugin: bool = False) -> str | None:
    """Why `--emulate` cannot train `record`'s method, in one sentence; None where it can.

    A built-in method is taken where its replicator writes a program: the program names the
    collectives it runs, and the threaded groups run every op kind a program can name. A
    `plugin`'s replicator runs as written over the threads' groups (`emulate` says so).
    """
    from flexdemo.build import has_program, replicator_of

    if plugin or has_program(record):
        return None
    return (f"--emulate does not cover method {record.name!r}: its replicator "
            f"{replicator_of(record).__name__} writes no program "
            "(Replicator.program), so the collectives it runs are not known.")


# Per replica: parameters, gradients and up to six more copies (AdamW's two moments, DeMo's
# momentum, DiLoCo's outer copy and momentum, exchange buffers), the activations one forward
# saves for its backward (FSDP2's all-reduce runs inside the backward, so every replica may hold
# its own at once), and a fixed allowance for the thread and the allocator's slack; measured
# against the peak of lm-tiny at 64 replicas and vision-tiny at 256 (bench_emulate.py --scale).
_COPIES = 8
_REPLICA_OVERHEAD = 24 * 2**20
_PROCESS_BASE = 600 * 2**20  # the interpreter with torch, pandas and the workload's data


# What an emulated run records without using: it measures no time (so shapes and models no
# link and waits on no GPU) and starts no processes (so pins and threads none of its own).
_UNUSED = ("inter_bw", "inter_lat", "node_links", "topology_file", "intra_bw", "intra_lat",
           "threads_per_rank", "pin_cores", "sync_phases", "profile")


def unused_settings(cfg: RunConfig) -> list[str]:
    """The settings of `cfg`, set away from their defaults, that an emulated run would record
    without using (a network, pinning, threads and GPU waits)."""
    default = RunConfig()
    return [name for name in _UNUSED if getattr(cfg, name) != getattr(default, name)]


_PRELOAD = ("flexdemo.build", "flexdemo.hsdp", "flexdemo.optimizer", "flexdemo.replicators",
            "flexdemo.consensus", "torch.distributed.tensor", "torch.distributed.fsdp")


def estimate_bytes(nodes: int, params: int, activation_bytes: int, peers: int = 0) -> int:
    """Memory an emulated run of `nodes` replicas needs, roughly: each of `params` parameters
    and `activation_bytes` saved by a forward, and `peers` gossip messages held at once."""
    from flexdemo.replicators.gossip import message_bytes

    # Every replica holds one receive buffer a peer of its exchange window while the window's
    # messages are in flight (GossipReplicator._exchange), and all replicas are in the same
    # round at once: on the exponential graph at 64 nodes that is 64 x 11 copies of the
    # parameters.
    inbox = peers * message_bytes([params])
    return _PROCESS_BASE + nodes * (_COPIES * 4 * params + activation_bytes + inbox
                                    + _REPLICA_OVERHEAD)


def inbox_peers(cfg: RunConfig) -> int:
    """The most gossip messages a replica holds at once: its graph's largest exchange window
    (its degree, or :data:`~flexdemo.replicators.gossip.RECEIVE_LIMIT` on a denser graph), for
    Ada the largest over its ladder; 0 for the other methods and on rounds that all-reduce
    (the complete graph's)."""
    from flexdemo.graphs import averages_exactly, graph_ladder, peers, period
    from flexdemo.replicators.gossip import exchange_windows

    if not cfg.record.gossips:
        return 0
    graph = cfg.knob_values().get("graph")
    graphs = [graph] if graph is not None else graph_ladder(cfg.nodes)
    return max((len(window) for g in graphs for step in range(period(g, cfg.nodes))
                if not averages_exactly(g, cfg.nodes, step) for node in range(cfg.nodes)
                for window in exchange_windows(peers(g, cfg.nodes, node, step), cfg.nodes,
                                               node)), default=0)


def replica_size(workload: Any, batch_size: int) -> tuple[int, int]:
    """One replica's parameter count, and the bytes one forward of a batch saves for backward
    (measured on a batch of one and scaled, so that a batch too large to hold is refused by
    the estimate rather than by the allocator)."""
    import torch

    model = workload.model()
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()  # views of one storage count once
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        workload.loss(model, workload.batch(0, 0, 1, 0))
    return sum(p.numel() for p in model.parameters()), sum(saved.values()) * batch_size


def check_emulated(cfg: RunConfig) -> tuple[RunConfig, int]:
    """The validated config and its memory estimate; ConfigError (one sentence) if refused."""
    cfg = cfg.validate()
    problem = emulation_problem(cfg.record, is_plugin(cfg.method))
    if problem is not None:
        raise ConfigError(problem)
    if cfg.gpus_per_node != 1:
        raise ConfigError(f"--emulate trains one data-parallel replica a node, got "
                          f"--gpus-per-node {cfg.gpus_per_node}; give --gpus-per-node 1.")
    if cfg.backend == "nccl":
        raise ConfigError("--emulate trains on this process's CPU, got --backend 'nccl'; leave "
                          "--backend auto or give gloo.")
    if cfg.shaping != "off":
        raise ConfigError(f"--emulate measures no time, so it shapes no network; got --shaping "
                          f"{cfg.shaping!r}, leave it off.")
    from experiments.workloads import make_workload

    workload = make_workload(cfg.workload)
    params, activations = replica_size(workload, cfg.batch_size or workload.default_batch_size)
    _release_memory()  # an earlier emulated run of this process (a sweep's unit) must not count
    have = _available_bytes()
    # Without gossip's messages first: counting them walks every node's peers.
    peers = inbox_peers(cfg) if estimate_bytes(cfg.nodes, params, activations) <= have else 0
    need = estimate_bytes(cfg.nodes, params, activations, peers)
    if need > have:
        inbox = f", {peers} peers' messages at once" if peers else ""
        batch = " or a smaller --batch-size" if activations > _COPIES * 4 * params else ""
        raise ConfigError(f"--emulate with {cfg.nodes} replicas of {cfg.workload} ({params:,} "
                          f"parameters, {format_bytes(activations)} of activations a "
                          f"forward{inbox}) needs about {need / 2**30:.1f} GiB and this machine "
                          f"has {have / 2**30:.1f} GiB available; give fewer --nodes{batch}"
                          + (" or a sparser graph." if peers else "."))
    return cfg, need


def emulate(cfg: RunConfig, out: Path | str, *, timeout_s: float | None = None,
            quiet: bool = False) -> Path:
    """Train `cfg`'s replicas as threads of this process and write OUT (RunFailed: untouched)."""
    from experiments.run.launch import check_timeout

    check_timeout(timeout_s)
    cfg, need = check_emulated(cfg)
    if not quiet:
        print(f"emulating {cfg.nodes} replicas in this process (1 rank a node, data-parallel; "
              f"about {need / 2**30:.1f} GiB); no time is measured")
        if is_plugin(cfg.method):
            print(f"{cfg.method} is a plug-in: its replicator runs as written, over threads' "
                  "groups; that its emulated loss equals a real run's is checked for the "
                  "built-in methods only")
    folder = RunFolder(out).create()
    try:
        results = _train_replicas(cfg, timeout_s, quiet)
        write_emulated_run(results, folder.build, {"executor": EMULATED,
                                                   "emulated": _described(cfg), **folder.code})
        return folder.commit()
    finally:
        folder.discard()


def _release_memory() -> None:
    """Hand freed replicas' memory back to the machine, so that an emulated run is refused by
    the memory it has available, not by what an earlier run of this process held."""
    import ctypes
    import gc

    while gc.collect():  # the replicas sit in reference cycles; freeing some frees more
        pass
    try:  # glibc keeps freed heap pages in its arenas (one a thread) unless asked
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # another C library: what it keeps is its own


def _described(cfg: RunConfig) -> dict[str, Any]:
    """What run.json says about how the run was made."""
    return {"replicas": cfg.nodes, "ranks_per_node": 1,
            "parallelism": "data-parallel, one rank a node (no sharding inside a node)",
            "measured": "loss, val_loss, replica_variance, consensus_distance per step; no "
                        "time (wall_time_s and compute_s are NaN) and no trace"}


def _train_replicas(cfg: RunConfig, timeout_s: float | None, quiet: bool) -> list[RankResult]:
    """Every rank's RankResult, trained in threads of this process."""
    import torch

    from experiments.run import threaded_group
    from experiments.run.train import RankSetting, train_rank
    from experiments.workloads import make_workload

    # Imported here, once: flexdemo imports its pieces on first use, which threads importing
    # together would do under Python's import locks, one after the other, slowly.
    for name in _PRELOAD:
        importlib.import_module(name)
    quiet = quiet or bool(os.environ.get("TQDM_DISABLE"))  # as a real rank reads it
    setting = RankSetting(backend=None, init_lock=threading.Lock(), quiet=quiet,
                          workload=make_workload(cfg.workload))
    threads = torch.get_num_threads()
    # One intra-op thread: the ranks are the parallelism, as one thread a spawned rank.
    torch.set_num_threads(1)
    try:
        # The rendezvous of a collective waits at most this long for a slow peer.
        with threaded_group.threaded_world(cfg.nodes, max(600.0, 2 * cfg.stall_timeout)) as w:
            try:
                return w.run(lambda rank: train_rank(cfg, setting), deadline_s=timeout_s)
            except TimeoutError:
                raise RunFailed(f"run timed out after {timeout_s:g} s") from None
            except (ConfigError, RunFailed):
                raise
            except Exception as err:  # a rank's error, as a spawned rank's is reported
                raise RunFailed(f"an emulated rank failed: {type(err).__name__}: {err}") from err
    finally:
        torch.set_num_threads(threads)
