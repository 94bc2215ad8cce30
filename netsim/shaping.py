"""Shaping real torch.distributed collectives: a "netsim" process-group backend over gloo/nccl.

Groups made with `dist.new_group(ranks, backend=shaping.BACKEND)` behave like the wrapped backend,
record every collective to the installed TraceRecorder and, for inter-node groups, finish no earlier
than the alpha-beta model allows:

- "wall": `wait()` runs the real op, then sleeps until the modeled completion time.
- "virtual": nothing sleeps; a per-process virtual clock jumps forward to the modeled completion.
- "off": count and trace only.

The modeled start of a collective is the latest arrival among its ranks (exchanged by a tiny MAX
all-reduce on the wrapped group), so a late peer delays everybody as on a real network. Bytes go
through a reservation timeline per node NIC (shared by the node's processes through a locked file)
or per accelerator, so concurrent transfers share bandwidth.
"""

from __future__ import annotations

import math
import random
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from netsim.costs import CollectiveVolume, collective_volume, default_algorithm
from netsim.nic import Timeline
from netsim.topology import Link, Topology
from netsim.trace import TraceRecorder

__all__ = ["BACKEND", "MODES", "install", "uninstall", "clock", "is_installed", "ring_nic_share"]

BACKEND = "netsim"
MODES = ("off", "wall", "virtual")


@dataclass
class _State:
    """Everything the backend needs in this process, set by install()."""

    topology: Topology
    mode: str
    recorder: TraceRecorder | None
    shape_intra: bool
    seed: int
    state_dir: Path
    t0: float = field(default_factory=time.time)
    offset: float = 0.0  # virtual clock lead over the wall clock, seconds
    lock: threading.Lock = field(default_factory=threading.Lock)
    token: str | None = None
    generation: int = 0  # how many install() calls this process made: one NIC file set each
    timelines: dict = field(default_factory=dict)

    def now(self) -> float:
        """Absolute time on this process's shaping time base (wall, or wall + virtual lead)."""
        return time.time() + self.offset

    def advance_to(self, target: float) -> None:
        """Virtual mode: move the clock forward so that now() >= target."""
        with self.lock:
            lag = target - (time.time() + self.offset)
            if lag > 0:
                self.offset += lag

    def run_token(self) -> str:
        """One id per run, agreed through the default store, naming the shared NIC files."""
        if self.token is None:
            mine = uuid.uuid4().hex
            try:
                store = dist.distributed_c10d._get_default_store()
                self.token = store.compare_set("netsim/run_token", "", mine).decode()
            except Exception:  # no default store (tests, single process): private NIC state
                self.token = mine
        return self.token

    def timeline(self, key: tuple, shared_node: int | None) -> Timeline:
        """The reservation timeline for `key`; file-backed when a node's processes share it."""
        with self.lock:
            if key not in self.timelines:
                path = None
                if shared_node is not None:
                    name = f"netsim-{self.run_token()}-{self.mode}{self.generation}"
                    path = self.state_dir / f"{name}-node{shared_node}.nic"
                self.timelines[key] = Timeline(path)
            return self.timelines[key]


_STATE: _State | None = None
_INSTALLS = 0


def install(
    topology: Topology,
    mode: str = "wall",
    recorder: TraceRecorder | None = None,
    shape_intra: bool = False,
    seed: int = 0,
    state_dir: str | None = None,
) -> None:
    """Register the BACKEND process-group backend and set how it shapes (call before new_group)."""
    global _STATE, _INSTALLS
    if not isinstance(topology, Topology):
        raise ValueError(f"topology {topology!r} must be a netsim.Topology.")
    if mode not in MODES:
        raise ValueError(f"shaping mode {mode!r} is not known; use one of {', '.join(MODES)}.")
    _STATE = _State(
        topology=topology,
        mode=mode,
        recorder=recorder,
        shape_intra=bool(shape_intra),
        seed=int(seed),
        state_dir=Path(state_dir or tempfile.gettempdir()) / "netsim",
        generation=_INSTALLS,
    )
    # A fresh NIC file per install: earlier virtual-time reservations must not block later runs.
    _INSTALLS += 1
    if recorder is not None:
        recorder.clock = clock
        recorder.topology = recorder.topology or topology
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def uninstall() -> None:
    """Forget the installed shaping state (groups already made keep working unshaped)."""
    global _STATE
    if _STATE is not None:
        for timeline in _STATE.timelines.values():
            timeline.close()
    _STATE = None


def is_installed() -> bool:
    """Whether install() has been called in this process."""
    return _STATE is not None


def clock() -> float:
    """Seconds since install(): the wall clock, or in "virtual" mode the virtual clock."""
    if _STATE is None:
        raise ValueError("shaping.clock() needs shaping.install(...) to have been called first.")
    return _STATE.now() - _STATE.t0


def ring_nic_share(ranks: list[int], topology: Topology) -> float:
    """Fraction of a rank's ring traffic that crosses its node's NIC, averaged over the group.

    A ring over sorted ranks crosses node boundaries on c of its p edges, so a node's ranks
    together push only c/p of their bytes through the NIC (1.0 for one rank per node).
    """
    ordered = sorted(ranks)
    p = len(ordered)
    if p < 2:
        return 0.0
    crossing = sum(
        topology.node_of(a) != topology.node_of(b)
        for a, b in zip(ordered, ordered[1:] + ordered[:1], strict=True)
    )
    return crossing / p


def _nbytes(tensors) -> int:
    """Payload bytes of a tensor or a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _first_tensor(tensors) -> torch.Tensor | None:
    if isinstance(tensors, torch.Tensor):
        return tensors
    for t in tensors:
        found = _first_tensor(t)
        if found is not None:
            return found
    return None


class _ShapedWork(dist.Work):
    """Work whose wait() finishes the real op, then holds until the modeled completion time."""

    def __init__(self, group, works, volume, row, issued, arrival=None, sync=None, result=None):
        super().__init__()
        self._group = group
        self._works = works
        self._volume = volume
        self._row = row
        self._issued = issued
        self._arrival = arrival
        self._sync = sync
        self._result = result
        self._done = False
        self._span: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def _modeled(self) -> tuple[float, float]:
        """(begin, finish) of the modeled transfer; booked on the NIC once, when first asked."""
        if self._span is None:
            begin = self._issued
            if self._sync is not None:
                self._sync.wait()
                begin = float(self._arrival.max().item())
            self._span = (begin, self._group._model_finish(begin, self._volume))
        return self._span

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:  # noqa: B008 - mirrors torch
        with self._lock:
            if self._done:
                return True
            state = self._group._state
            waited = state.now()
            for work in self._works:
                work.wait()
            modeled = math.nan
            if self._group._shaped:
                begin, finish = self._modeled()
                modeled = finish - begin
                if state.mode == "wall":
                    # Sleep in slices: one long sleep can overshoot by a scheduler tick.
                    while (left := finish - time.time()) > 0:
                        time.sleep(min(left, 0.05))
                else:
                    state.advance_to(finish)
            if self._row is not None and state.recorder is not None:
                state.recorder.complete(
                    self._row, waited - state.t0, state.now() - state.t0, modeled
                )
            self._done = True
            return True

    def is_completed(self) -> bool:
        # Pollers that never call wait() must still see the op finish, at the modeled time.
        if self._done:
            return True
        if not all(w.is_completed() for w in self._works):
            return False
        if not self._group._shaped:
            return True
        if self._sync is not None and not self._sync.is_completed():
            return False
        with self._lock:
            _, finish = self._modeled()
        return self._group._state.mode != "wall" or time.time() >= finish

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self):
        self.wait()
        return self._result if self._result is not None else self._works[-1].result()

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()

        def finish() -> None:
            try:
                future.set_result(self.result())
            except Exception as err:  # hand the failure to whoever waits on the future
                future.set_exception(err)

        # wait() may sleep for the modeled time, so never run it on the backend's own threads.
        threading.Thread(target=finish, daemon=True).start()
        return future


class ShapedProcessGroup(dist.ProcessGroup):
    """A process group that delegates to real gloo/nccl backends, recording and shaping each op."""

    def __init__(self, state: _State, inners: dict, group_rank: int, group_size: int, ranks):
        super().__init__(group_rank, group_size)
        self._state = state
        self._inners = inners
        for device, (backend_type, inner) in inners.items():
            self._register_backend(torch.device(device), backend_type, inner)
        self._ranks = list(ranks)
        topo = state.topology
        if max(self._ranks) >= topo.world_size:
            raise ValueError(
                f"group ranks {self._ranks} do not fit the installed topology of "
                f"{topo.world_size} ranks; install the topology the run really has."
            )
        self._global_rank = self._ranks[group_rank]
        self._inter = topo.crosses_nodes(self._ranks)
        self._link: Link = topo.link_for(self._ranks)
        self._shaped = state.mode != "off" and (self._inter or state.shape_intra)
        self._nic_share = ring_nic_share(self._ranks, topo) if self._inter else 1.0
        self._rng = random.Random(f"{state.seed}:{self._global_rank}:{self._ranks}")

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The registered backend name, "netsim"."""
        return BACKEND

    # -- modeling ------------------------------------------------------------------------------
    def _timeline(self) -> Timeline:
        topo, state = self._state.topology, self._state
        if not self._inter:
            return state.timeline(("intra", self._global_rank), None)
        if topo.nic == "per-accelerator":
            return state.timeline(("nic", self._global_rank), None)
        node = topo.node_of(self._global_rank)
        return state.timeline(("nic", node), node)

    def _model_finish(self, begin: float, volume: CollectiveVolume) -> float:
        """Modeled completion time of a collective that starts at `begin`."""
        link = self._link
        latency = volume.latency_steps * link.latency
        if link.jitter > 0 and volume.latency_steps:
            latency += sum(
                self._rng.uniform(-link.jitter, link.jitter) for _ in range(volume.latency_steps)
            )
            latency = max(0.0, latency)
        share = self._nic_share
        through = self._timeline().reserve(
            begin,
            volume.bytes_sent * share,
            volume.bytes_received * share,
            link.effective_bandwidth,
        )
        return through + latency

    # -- plumbing ------------------------------------------------------------------------------
    def _inner_for(self, tensors) -> tuple[str, object]:
        first = _first_tensor(tensors) if tensors is not None else None
        device = first.device.type if first is not None else next(iter(self._inners))
        if device not in self._inners:
            raise ValueError(f"netsim groups handle cpu and cuda tensors, not {device!r} tensors.")
        return device, self._inners[device][1]

    def _run(self, op, nbytes, launch, tensors, is_root=False, backend_name=None, exchange=True):
        state = self._state
        device, inner = self._inner_for(tensors)
        algorithm = default_algorithm(op, backend_name or ("gloo" if device == "cpu" else "nccl"))
        volume = collective_volume(op, self.size(), nbytes, algorithm, is_root=is_root)
        issued = state.now()
        row = None
        if state.recorder is not None:
            row = state.recorder.record_collective(
                op,
                self._ranks,
                self._inter,
                algorithm,
                nbytes,
                volume.bytes_sent,
                volume.bytes_received,
                issued - state.t0,
            )
        arrival = sync = None
        if self._shaped and exchange and self.size() > 1:
            # Everybody's arrival time, so the modeled transfer starts when the last rank shows up.
            arrival = torch.tensor([issued], dtype=torch.float64, device=device)
            sync = inner.allreduce([arrival], _max_options())
        works = launch(inner)
        works = works if isinstance(works, list) else [works]
        return _ShapedWork(self, works, volume, row, issued, arrival, sync)

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        """allreduce: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "all_reduce",
            _nbytes(tensors),
            lambda g: g.allreduce(tensors, _o(opts, AllreduceOptions)),
            tensors,
        )

    def allreduce_coalesced(self, tensors, opts=None):
        """allreduce_coalesced: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "all_reduce",
            _nbytes(tensors),
            lambda g: g.allreduce_coalesced(tensors, *_a(opts)),
            tensors,
        )

    def allgather(self, output_lists, inputs, opts=None):
        """allgather: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "all_gather",
            _nbytes(inputs),
            lambda g: g.allgather(output_lists, inputs, *_a(opts)),
            inputs,
        )

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """allgather_coalesced: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "all_gather",
            _nbytes(inputs),
            lambda g: g.allgather_coalesced(output_lists, inputs, *_a(opts)),
            inputs,
        )

    def _allgather_base(self, output, inp, opts=None):
        """allgather_base: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "all_gather", _nbytes(inp), lambda g: g._allgather_base(output, inp, *_a(opts)), inp
        )

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """allgather_into_tensor_coalesced: run on the wrapped backend, recorded and shaped."""
        launch = lambda g: [
            g._allgather_base(o, i, *_a(opts)) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._run("all_gather", _nbytes(inputs), launch, inputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        """reduce_scatter: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "reduce_scatter",
            _nbytes(input_lists),
            lambda g: g.reduce_scatter(outputs, input_lists, *_a(opts)),
            input_lists,
        )

    def _reduce_scatter_base(self, output, inp, opts=None):
        """reduce_scatter_base: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "reduce_scatter",
            _nbytes(inp),
            lambda g: g._reduce_scatter_base(output, inp, *_a(opts)),
            inp,
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_tensor_coalesced: run on the wrapped backend, recorded and shaped."""
        launch = lambda g: [
            g._reduce_scatter_base(o, i, *_a(opts)) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._run("reduce_scatter", _nbytes(inputs), launch, inputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output, inp, output_splits, input_splits, opts=None):
        """alltoall_base: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "all_to_all",
            _nbytes(inp),
            lambda g: g.alltoall_base(output, inp, output_splits, input_splits, *_a(opts)),
            inp,
        )

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        """alltoall: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "all_to_all", _nbytes(inputs), lambda g: g.alltoall(outputs, inputs, *_a(opts)), inputs
        )

    def broadcast(self, tensors, opts=None):
        """broadcast: run on the wrapped backend, recorded and shaped."""
        root = getattr(opts, "rootRank", 0)
        return self._run(
            "broadcast",
            _nbytes(tensors),
            lambda g: g.broadcast(tensors, *_a(opts)),
            tensors,
            is_root=self.rank() == root,
        )

    def reduce(self, tensors, opts=None):
        """reduce: run on the wrapped backend, recorded and shaped."""
        root = getattr(opts, "rootRank", 0)
        return self._run(
            "reduce",
            _nbytes(tensors),
            lambda g: g.reduce(tensors, *_a(opts)),
            tensors,
            is_root=self.rank() == root,
        )

    def gather(self, output_lists, inputs, opts=None):
        """gather: run on the wrapped backend, recorded and shaped."""
        root = getattr(opts, "rootRank", 0)
        return self._run(
            "gather",
            _nbytes(inputs),
            lambda g: g.gather(output_lists, inputs, *_a(opts)),
            inputs,
            is_root=self.rank() == root,
        )

    def scatter(self, outputs, input_lists, opts=None):
        """scatter: run on the wrapped backend, recorded and shaped."""
        root = getattr(opts, "rootRank", 0)
        return self._run(
            "scatter",
            _nbytes(outputs),
            lambda g: g.scatter(outputs, input_lists, *_a(opts)),
            outputs,
            is_root=self.rank() == root,
        )

    def send(self, tensors, dst, tag=0):
        """send: run on the wrapped backend, recorded and shaped."""
        # Point-to-point: only two ranks take part, so no arrival exchange over the whole group.
        return self._run(
            "send", _nbytes(tensors), lambda g: g.send(tensors, dst, tag), tensors, exchange=False
        )

    def recv(self, tensors, src, tag=0):
        """recv: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "recv", _nbytes(tensors), lambda g: g.recv(tensors, src, tag), tensors, exchange=False
        )

    def recv_anysource(self, tensors, tag=0):
        """recv_anysource: run on the wrapped backend, recorded and shaped."""
        return self._run(
            "recv",
            _nbytes(tensors),
            lambda g: g.recv_anysource(tensors, tag),
            tensors,
            exchange=False,
        )

    def barrier(self, opts=None):
        """barrier: run on the wrapped backend, recorded and shaped."""
        return self._run("barrier", 0, lambda g: g.barrier(*_a(opts)), None)


def _a(opts) -> tuple:
    """Pass options through only when the caller gave them (the backends have defaults)."""
    return () if opts is None else (opts,)


def _o(opts, cls):
    return cls() if opts is None else opts


def _max_options() -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    return opts


def _create(dist_opts, _backend_opts):
    """Backend creator handed to torch: builds the real backends and the shaping wrapper."""
    state = _STATE
    if state is None:
        raise ValueError(
            "the netsim backend needs shaping.install(topology, mode) before new_group."
        )
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    ranks = list(dist_opts.global_ranks_in_group) or list(range(size))
    inners: dict = {}
    gloo = torch._C._distributed_c10d.ProcessGroupGloo(
        dist.PrefixStore("gloo/", store), rank, size, dist_opts.timeout
    )
    inners["cpu"] = (dist.ProcessGroup.BackendType.GLOO, gloo)
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl_opts = torch._C._distributed_c10d.ProcessGroupNCCL.Options()
        nccl_opts._timeout = dist_opts.timeout
        nccl = torch._C._distributed_c10d.ProcessGroupNCCL(
            dist.PrefixStore("nccl/", store), rank, size, nccl_opts
        )
        inners["cuda"] = (dist.ProcessGroup.BackendType.NCCL, nccl)
    return ShapedProcessGroup(state, inners, rank, size, ranks)
