"""One rank of one training run: process groups, model, optimizer, the loop, the records.

The loop is plain (nanoGPT-style): batch, loss, backward, `opt.step()`. Everything
network-specific hides in the optimizer (flexdemo) and in the process groups (netsim): the
inter-node groups are created with netsim's counting/shaping backend, so every byte that crosses
nodes is counted from the tensors actually sent, whichever method sends it.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import flexdemo
from experiments.config import RunConfig
from experiments.run.folder import RankResult
from experiments.run.schedule import lr_factor, warmup_count
from experiments.workloads import Workload, make_workload
from netsim import EVAL, TraceRecorder, shaping

__all__ = ["RankSetting", "lr_scheduler", "resolve", "run_rank", "train_rank"]

_VAL_BATCHES = 8


def resolve(cfg: RunConfig, workload: Workload) -> RunConfig:
    """Fill the run's None fields with the workload's and method's defaults (run.json's values).

    Every knob the method reads gets its value; the others stay None.
    """
    return cfg.replace(
        **cfg.knob_values(),
        steps=cfg.steps or workload.default_steps,
        batch_size=cfg.batch_size or workload.default_batch_size,
        eval_every=cfg.eval_every or workload.default_eval_every,
        lr=cfg.lr or cfg.record.lr,
    )


def _device(cfg: RunConfig) -> torch.device:
    # "nccl" or flexdemo.devices.MIXED ("cpu:gloo,cuda:nccl"): the model goes to this rank's GPU.
    if "nccl" in str(dist.get_backend()):
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _phase_sync(cfg: RunConfig, device: torch.device) -> Callable[[], None]:
    """What ends a step phase: a wait for the GPU with cfg.sync_phases (profiles), else nothing."""
    if cfg.sync_phases and device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


class _Profiler:
    """torch.profiler over the training steps up to the first evaluation (`run --profile`).

    One ProfilerStep per training step, begun where the step begins: the trace a user's own
    job writes (torchtitan's, or `torch.profiler.profile(schedule=...)` with `prof.step()`), so
    `flexbench import-trace` can be checked against this run's recording. It stops before the
    first evaluation, whose collectives an importer could not tell from training's.
    """

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        # Without --profile nothing is profiled: no step is the last one.
        self.last = min(cfg.steps, cfg.eval_every) if cfg.profile else 0
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.trace: bytes | None = None
        """The gzipped Chrome-trace JSON of the profiled steps, once written."""
        self._profile = None
        if cfg.profile:
            with warnings.catch_warnings():  # no warm-up: the first step is the recording's too
                warnings.simplefilter("ignore")
                every = schedule(wait=0, warmup=0, active=max(self.last, 1), repeat=1)
            self._profile = profile(activities=activities, record_shapes=True, schedule=every,
                                    on_trace_ready=self._keep)

    def begin(self, step: int) -> None:
        """Begin ProfilerStep#0 with the first training step."""
        if self._profile is None or step != 1:
            return
        with warnings.catch_warnings():  # no warm-up: the first step is the recording's too
            warnings.simplefilter("ignore")
            self._profile.start()

    def step_done(self, step: int) -> None:
        """Close the ProfilerStep of training step `step`; the last one writes the trace."""
        if self._profile is not None and step < self.last:
            self._profile.step()
        elif self._profile is not None and step == self.last:
            self._profile.stop()

    def _keep(self, prof) -> None:  # type: ignore[no-untyped-def]
        import gzip
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                self.trace = gzip.compress(f.read(), mtime=0)


class _NoRecorder:
    """A recorder that records nothing: the emulated path measures no time and sends no bytes."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@dataclass
class RankSetting:
    """Where a rank's groups come from and what it measures: real (shaped, timed) or emulated.

    A real rank makes its inter-node groups with netsim's backend, records a trace and reads
    netsim's clock; an emulated one (`experiments.run.emulate`, ranks as threads of one process)
    makes plain groups of the default backend, records no trace and measures no time (its
    timings are NaN). `init_lock` serializes the seeded model init where ranks share one global
    random generator.
    """

    backend: str | None = None
    recorder: Any = field(default_factory=_NoRecorder)
    clock: Callable[[], float] | None = None
    init_lock: Any = field(default_factory=contextlib.nullcontext)
    quiet: bool = False
    workload: Workload | None = None
    """One workload the ranks share (its batches are drawn from per-call generators); None:
    each rank makes its own."""

    def now(self) -> float:
        """The clock's seconds, NaN where nothing is timed."""
        return math.nan if self.clock is None else self.clock()


def _build(cfg: RunConfig, workload: Workload, device: torch.device, setting: RankSetting):
    """Model (sharded or not), optimizer, mesh and FSDP2 layout (None unsharded) of the run."""
    with setting.init_lock:  # threads as ranks share torch's global generator
        torch.manual_seed(cfg.seed)  # same init on every rank
        model = workload.model().to(device)
    backend = setting.backend
    record = cfg.record.wired(cfg.given_knobs())  # hsdp-adamw's reduce_format rewires it
    layout = None
    if record.shards:
        # Recorded so that a replay on another shard count can resize every sharded collective.
        layout = flexdemo.shard_layout(model)
        mesh = flexdemo.build_mesh(
            cfg.nodes, cfg.gpus_per_node, device_type=device.type, backend=backend
        )
        flexdemo.parallelize(model, mesh, inter_all_reduce=record.inter_all_reduce)
    else:
        # Original DeMo: no sharding, every rank is a replica, so the replicate dim spans the
        # world; netsim still sees which of its ranks share a node.
        mesh = flexdemo.build_mesh(cfg.world_size, 1, device_type=device.type,
                                   backend=backend)
    opt = flexdemo.build_optimizer(cfg.method, model, mesh, lr=cfg.lr,
                                   weight_decay=cfg.weight_decay, seed=cfg.seed,
                                   **cfg.given_knobs())
    return model, opt, mesh, layout


def round_graph(opt: torch.optim.Optimizer) -> str | None:
    """The graph of the gossip round of the step just taken (gossip, ada); None without one."""
    replicator = getattr(opt, "replicator", None)
    graph = getattr(replicator, "graph", None)
    # A step off the replicator's schedule mixed with nobody: it has no graph.
    return graph if graph is not None and replicator.replicates_on(opt.steps) else None


def lr_scheduler(opt: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule on ``opt`` (resolved ``cfg``): step s (0-based) runs at lr x lr_factor(s).

    LambdaLR scales every parameter group's lr, which is where each method's step reads it.
    """
    warm = warmup_count(cfg.steps, cfg.warmup, cfg.warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.steps, cfg.schedule, warm))


@torch.no_grad()
def _evaluate(model: torch.nn.Module, workload: Workload, batches: list,
              first_bad_step: float) -> tuple[float, float]:
    """Mean validation loss over ranks, and the first non-finite training step of any rank."""
    model.eval()
    total = sum(workload.loss(model, b).item() for b in batches) / len(batches)
    model.train()
    # Replicas may differ (DiLoCo, none): report the mean over ranks, on the unshaped world group.
    # Divergence is agreed on here too, so that every rank stops at the same step. Both cross
    # the default group on the device it has a backend for (CPU unless it is CUDA-only).
    device = flexdemo.side_channel_device()
    val = torch.tensor([total], dtype=torch.float64, device=device)
    dist.all_reduce(val)
    bad = torch.tensor([first_bad_step], dtype=torch.float64, device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MIN)
    return val.item() / dist.get_world_size(), bad.item()


def _evaluate_into(row: dict, model: torch.nn.Module, workload: Workload, batches: list,
                   first_bad_step: float, mesh) -> int | None:
    """Fill ``row``'s validation loss and replica spread; the step the run diverged at, if any.

    Collective on every rank, so all ranks agree on the divergence and stop at the same step.
    """
    row["val_loss"], bad = _evaluate(model, workload, batches, first_bad_step)
    # Its replica-group all-reduce is recorded under the eval phase the caller set.
    row["replica_variance"], row["consensus_distance"] = flexdemo.replica_spread(
        model.parameters(), flexdemo.replicate_group(mesh))
    if math.isfinite(bad):
        return int(bad)
    return None if math.isfinite(row["val_loss"]) else row["step"]


def run_rank(cfg: RunConfig, heartbeat: Callable[[int], None] | None = None,
             run_dir: str | None = None) -> RankResult:
    """Train on this rank (process group already initialized); return its records.

    `heartbeat(step)` is called whenever the rank makes progress (the launcher's stall
    watchdog); `run_dir` is the run's working folder for netsim's shared NIC files. A loss
    that stops being finite ends the run at the next evaluation, on every rank, with
    `diverged_step` set.
    """
    recorder = TraceRecorder(dist.get_rank())
    # Kernel-shaped links are slow by themselves: netsim only counts (the trace keeps every byte).
    mode = "off" if cfg.shaping == "kernel" else cfg.shaping
    shaping.install(cfg.topology(), mode=mode, recorder=recorder, run_dir=run_dir)
    setting = RankSetting(shaping.BACKEND, recorder, shaping.clock,
                          quiet=bool(os.environ.get("TQDM_DISABLE")))
    return train_rank(cfg, setting, heartbeat)


def train_rank(cfg: RunConfig, setting: RankSetting,
               heartbeat: Callable[[int], None] | None = None) -> RankResult:
    """The training loop of one rank in `setting` (its group initialized); return its records."""
    beat = heartbeat or (lambda step: None)
    rank = dist.get_rank()
    device = _device(cfg)
    workload = setting.workload or make_workload(cfg.workload)
    cfg = resolve(cfg, workload)
    recorder, clock = setting.recorder, setting.now
    model, opt, mesh, layout = _build(cfg, workload, device, setting)
    if cfg.record.shards:
        # Where each FSDP2 unit's backward ends, so a replay can overlap its reduce with the
        # next unit's backward as a GPU's communication stream does (--overlap fsdp2).
        flexdemo.watch_unit_backward(model, recorder.mark_unit_backward)
    sched = lr_scheduler(opt, cfg)
    to_dev = lambda batch: tuple(t.to(device) for t in batch)
    sync = _phase_sync(cfg, device)
    val = [to_dev(b) for b in workload.val_batches(_VAL_BATCHES, cfg.batch_size)]
    result = RankResult(rank, cfg.to_dict(), params=sum(p.numel() for p in model.parameters()),
                        layout=layout)

    quiet = rank != 0 or setting.quiet
    bar = tqdm(total=cfg.steps, desc=cfg.method, unit="step", disable=quiet, dynamic_ncols=True)
    eval_s = 0.0  # evaluation time is excluded from the training clock
    first_bad = math.inf  # first step whose training loss was not finite on this rank
    profiler = _Profiler(cfg, device)
    beat(0)
    start = clock()
    for step in range(1, cfg.steps + 1):
        profiler.begin(step)
        recorder.begin_step(step)
        t0 = clock()
        loss = workload.loss(model, to_dev(workload.batch(step, rank, cfg.batch_size, cfg.seed)))
        loss.backward()
        sync()  # a GPU's kernels run behind the host: the mark must wait for them to be device time
        recorder.mark_backward()  # FSDP2 has reduced every unit: the optimizer step starts here
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        sync()
        loss_value = loss.item()
        step_s = clock() - t0
        beat(step)
        if not math.isfinite(loss_value):
            first_bad = min(first_bad, step)
        recorder.end_step(step)
        profiler.step_done(step)
        now = clock() - start - eval_s
        # Byte and call counts come from the trace after the run, off the training clock.
        row = {"step": step, "wall_time_s": now, "loss": loss_value, "val_loss": math.nan,
               "step_s": step_s, "replica_variance": math.nan, "consensus_distance": math.nan,
               "graph": round_graph(opt)}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            recorder.set_phase(EVAL)  # evaluation traffic is its own phase, left out
            e0 = clock()
            result.diverged_step = _evaluate_into(row, model, workload, val, first_bad, mesh)
            eval_s += clock() - e0
            beat(step)
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{row['val_loss']:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}")
        result.steps.append(row)
        bar.update(1)
        if result.diverged_step is not None:
            break  # all ranks agreed in _evaluate: they stop at this same step
    bar.close()
    # An overlapping method (flexdemo-async) has its last step's exchange still in flight:
    # waited on here, so it completes before the trace is read and the group is destroyed.
    drain = getattr(opt, "drain", None)  # hsdp-adamw's torch AdamW has none
    if callable(drain):
        drain()
    result.trace = recorder.frame()
    result.profile = profiler.trace
    return result
