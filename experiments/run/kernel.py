"""`--shaping kernel`: every emulated node's ranks in a network namespace of their own.

The launcher checks privileges and settings, makes a `netsim.kernel.KernelNetwork` (one
namespace per node around a hub bridge, tbf on both ends of each node's veth pair), then starts
every rank as a fresh interpreter inside its node's namespace:

    ip netns exec fbk-<pid>-<tag>-n<k> python -m experiments.run.kernel WORK

with a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR =
node 0's address, MASTER_PORT, GLOO_SOCKET_IFNAME = the namespace's eth0). A fresh process is the
only reliable way in: Python 3.11 has no os.setns, and setns in a process that already runs
threads (torch starts some at import) does not move them. Each rank joins a TCPStore on node 0's
address and then runs exactly like a spawned rank (`rank.run_one_rank`): heartbeats for the
stall watchdog, its result left as files in the run's working folder, which the ranks share
through the file system (namespaces separate networks, not files). So the launcher, not a rank,
assembles OUT, and a crash, stall or timeout writes nothing to it.

netsim runs in count-only mode (the trace still records every byte); run.json says
`"shaping": "kernel"` and the tc settings used. Whatever happens, the launcher kills its ranks'
process groups and deletes its namespaces; a launcher killed outright leaves them to the next
start, which deletes namespaces of ours whose creating process is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from experiments.config import RunConfig
from experiments.errors import RunFailed
from experiments.run.folder import RunFolder, read_rank_result, write_run
from experiments.run.rank import die_with_launcher, raise_on_sigterm, rank_error, run_one_rank
from experiments.run.watchdog import RankStalled, Watchdog
from netsim.kernel import (
    KernelNetwork,
    KernelShapingError,
    SiteTc,
    TcSettings,
    check_privileges,
    has_netem,
    stop,
)
from netsim.topology import Topology

__all__ = ["run_kernel", "kernel_settings", "kernel_node_settings", "kernel_sites"]

_CONFIG = "kernel-config.json"
_LAUNCHER_PID = "FLEXBENCH_KERNEL_LAUNCHER_PID"


def kernel_settings(topology: Topology) -> TcSettings:
    """Check that this machine can shape `topology`'s links in the kernel; its tc settings."""
    check_privileges()
    if topology.sites is not None:
        _check_site_latency(topology)
    if topology.inter.latency and not has_netem():
        latency = f"{topology.inter.latency * 1e3:g}ms"
        raise KernelShapingError(
            f"inter_lat {latency!r} needs the kernel's netem qdisc, which this kernel lacks; use "
            f"inter_lat 0ms with shaping 'kernel', or shaping 'wall' for latency.")
    delayed = [(k, link.latency) for k, link in topology.node_links if link.latency]
    if delayed and not has_netem():
        node, latency = delayed[0]
        raise KernelShapingError(
            f"the node link of node {node} has latency {latency * 1e3:g} ms, which needs the "
            f"kernel's netem qdisc, which this kernel lacks; give node links no latency "
            f"(\"{node}=BANDWIDTH,0ms\") with shaping 'kernel', or use shaping 'wall' for latency.")
    return TcSettings(rate_bps=topology.inter.bandwidth, delay_s=topology.inter.latency)


def _check_site_latency(topology: Topology) -> None:
    """KernelShapingError for sites with latency: kernel shaping of sites lays rates only."""
    sites = topology.sites
    rtts = [v for row in sites.rtt for v in row if v]
    inside = [site.name for site in sites.sites if site.intra_lat]
    if rtts or inside:
        what = (f"an rtt of {rtts[0] * 1e3:g} ms" if rtts
                else f"site {inside[0]!r}'s intra_lat")
        raise KernelShapingError(
            f"kernel shaping of sites lays their rates only, and the site file gives {what}; "
            "give rtt and intra_lat 0 with shaping 'kernel', or use shaping 'wall' for latency.")


def kernel_node_settings(topology: Topology, settings: TcSettings) -> dict[int, TcSettings]:
    """tc settings of the nodes with a link of their own (`node_links`, or every node of a
    site at its site's inside rate); the run's MTU."""
    if topology.sites is not None:
        return {k: TcSettings(rate_bps=site.intra_bw, mtu=settings.mtu)
                for site in topology.sites.sites for k in site.nodes}
    return {k: TcSettings(rate_bps=link.bandwidth, delay_s=link.latency, mtu=settings.mtu)
            for k, link in topology.node_links}


def kernel_sites(topology: Topology, settings: TcSettings) -> list[SiteTc]:
    """Each site's nodes and uplink and downlink tc settings (none without sites)."""
    if topology.sites is None:
        return []
    return [SiteTc(site.nodes, TcSettings(rate_bps=site.uplink, mtu=settings.mtu),
                   TcSettings(rate_bps=site.downlink, mtu=settings.mtu))
            for site in topology.sites.sites]


def run_kernel(cfg: RunConfig, folder: RunFolder, *, timeout_s: float | None,
               quiet: bool) -> Path:
    """Run every rank of `cfg` in kernel-shaped namespaces; write OUT or raise RunFailed."""
    topology = cfg.topology()
    settings = kernel_settings(topology)  # before anything exists: a refusal leaves nothing behind
    folder.create()
    net = KernelNetwork(cfg.nodes, settings, node_settings=kernel_node_settings(topology, settings),
                        sites=kernel_sites(topology, settings))
    procs: list[subprocess.Popen] = []
    previous_handler = raise_on_sigterm()
    try:
        (folder.work / _CONFIG).write_text(json.dumps(cfg.to_dict()))
        net.create()
        procs = [_start_rank(net, cfg, folder, rank, quiet) for rank in range(cfg.world_size)]
        _wait(procs, folder, cfg, timeout_s)
        results = [read_rank_result(folder.work, r) for r in range(cfg.world_size)]
        kernel = {**settings.describe(), "nodes": cfg.nodes}
        if net.node_settings:
            kernel["node_links"] = net.describe_nodes()  # these nodes' own rate and delay
        if net.sites:
            kernel["sites"] = [{"nodes": list(site.nodes), "up_bit_s": int(site.up.rate_bps * 8),
                                "down_bit_s": int(site.down.rate_bps * 8)}
                               for site in net.sites]
        write_run(results, folder.build,
                  extra={"shaping": "kernel", "kernel": kernel, **folder.code})
        return folder.commit()
    except RankStalled as err:
        raise RunFailed(str(err)) from None
    except KernelShapingError as err:
        raise RunFailed(str(err)) from None
    finally:
        stop(procs)
        net.delete()
        folder.discard()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)


def _start_rank(net: KernelNetwork, cfg: RunConfig, folder: RunFolder, rank: int,
                quiet: bool) -> subprocess.Popen:
    """Start `rank` in its node's namespace, in a session of its own (killed as a group)."""
    node, local = divmod(rank, cfg.gpus_per_node)
    env = {
        **os.environ,
        "RANK": str(rank), "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(cfg.gpus_per_node),
        _LAUNCHER_PID: str(os.getpid()),
        # c10d warns that a namespace address has no host name: true, and noise.
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    }
    if quiet:
        env["TQDM_DISABLE"] = "1"
    # Rank 0 draws the progress bar on the user's terminal; the others' stderr (tracebacks of
    # a failed run, mostly) goes to the working folder: the error file names the cause.
    stderr = None if rank == 0 and not quiet else open(folder.work / f"stderr-{rank}", "wb")
    try:
        return net.start(node, [sys.executable, "-m", "experiments.run.kernel", str(folder.work)],
                         env=env, stdin=subprocess.DEVNULL, stderr=stderr)
    finally:
        if stderr is not None:
            stderr.close()


def _wait(procs: list[subprocess.Popen], folder: RunFolder, cfg: RunConfig,
          timeout_s: float | None) -> None:
    """Return once all ranks exit 0; RunFailed on a failure or timeout, RankStalled on a stall."""
    watchdog = Watchdog([folder.progress(r) for r in range(len(procs))], cfg.stall_timeout)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            raise RunFailed(_failure(folder, codes))
        if all(c == 0 for c in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise RunFailed(f"run timed out after {timeout_s:g} s")
        watchdog.check()
        time.sleep(0.2)


def _failure(folder: RunFolder, codes: list[int | None]) -> str:
    """The first failed rank's error (its user's file and line, its log), or its exit status."""
    errors = sorted(folder.work.glob("error-*"), key=lambda p: p.stat().st_mtime)
    if errors:  # the rank's whole traceback: one line here, all of it in a log beside OUT
        rank = errors[0].name.rpartition("-")[2]
        return f"rank {rank}: {rank_error(errors[0].read_text(), folder.out)}"
    rank, code = next((r, c) for r, c in enumerate(codes) if c not in (None, 0))
    return f"a rank died: rank {rank} exited with status {code}"


def _rank_main(work: str) -> int:
    """Inside a namespace: join node 0's TCPStore, run this rank; on failure leave its traceback."""
    import torch.distributed as dist

    die_with_launcher(int(os.environ[_LAUNCHER_PID]))
    folder = RunFolder(work, work)
    rank = int(os.environ["RANK"])
    try:
        cfg = RunConfig.from_dict(json.loads((folder.work / _CONFIG).read_text()))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              cfg.world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=max(60.0, cfg.stall_timeout)))
        run_one_rank(rank, cfg, "gloo", folder, bool(os.environ.get("TQDM_DISABLE")), store)
    except BaseException:
        tmp = folder.work / f".error-{rank}.tmp"
        tmp.write_text(traceback.format_exc())
        os.replace(tmp, folder.work / f"error-{rank}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
