"""One rank of one training run: process groups, model, optimizer, the loop, the records.

The loop is plain (nanoGPT-style): batch, loss, backward, `opt.step()`. Everything
network-specific hides in the optimizer (flexdemo) and in the process groups (netsim): the
inter-node groups are created with netsim's counting/shaping backend, so every byte that crosses
nodes is counted from the tensors actually sent, whichever method sends it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import flexdemo
from experiments.config import RunConfig
from experiments.workloads import Workload, make_workload
from netsim import EVAL, Link, Topology, TraceRecorder, shaping

__all__ = ["RankResult", "run_rank", "resolve", "lr_factor"]

_VAL_BATCHES = 8


@dataclass
class RankResult:
    """What one rank hands back to rank 0 at the end of a run."""

    rank: int
    config: dict[str, Any]  # the run's config with every default filled in
    steps: list[dict[str, Any]] = field(default_factory=list)
    trace: Any = None  # pandas DataFrame from netsim's recorder
    params: int = 0


def resolve(cfg: RunConfig, workload: Workload) -> RunConfig:
    """Fill the run's None fields with the workload's and method's defaults."""
    return cfg.replace(
        steps=cfg.steps or workload.default_steps,
        batch_size=cfg.batch_size or workload.default_batch_size,
        eval_every=cfg.eval_every or workload.default_eval_every,
        lr=cfg.lr or flexdemo.DEFAULT_LR[cfg.method],
    )


def _device(cfg: RunConfig) -> torch.device:
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _topology(cfg: RunConfig) -> Topology:
    net = cfg.network()
    # Unshaped runs still record traffic; the placeholder link only labels it.
    inter_bw = net["inter_bw_bps"] or net["intra_bw_bps"]
    return Topology(
        nodes=cfg.nodes,
        accelerators_per_node=cfg.gpus_per_node,
        intra=Link(net["intra_bw_bps"], net["intra_lat_s"]),
        inter=Link(inter_bw, net["inter_lat_s"]),
    )


def _build(cfg: RunConfig, workload: Workload, device: torch.device):
    """Model (sharded or not) and optimizer for the run's method."""
    torch.manual_seed(cfg.seed)  # same init on every rank
    model = workload.model().to(device)
    knobs = dict(
        topk=cfg.topk, chunk=cfg.chunk, decay=cfg.decay, weight_decay=cfg.weight_decay,
        sign=cfg.sign, value_dtype=torch.bfloat16 if cfg.value_dtype == "bf16" else torch.float32,
        H=cfg.diloco_h, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
        replicate_every=cfg.replicate_every, seed=cfg.seed,
    )
    if flexdemo.method_uses_sharding(cfg.method):
        mesh = flexdemo.build_mesh(
            cfg.nodes, cfg.gpus_per_node, device_type=device.type, backend=shaping.BACKEND
        )
        flexdemo.parallelize(
            model, mesh, inter_all_reduce=flexdemo.method_uses_inter_all_reduce(cfg.method)
        )
    else:
        # Original DeMo: no sharding, every rank is a replica, so the replicate dim spans the
        # world; netsim still sees which of its ranks share a node.
        mesh = flexdemo.build_mesh(cfg.world_size, 1, device_type=device.type,
                                   backend=shaping.BACKEND)
    opt = flexdemo.build_optimizer(cfg.method, model, mesh, lr=cfg.lr, **knobs)
    return model, opt


def lr_factor(step: int, total: int, schedule: str, warmup: float) -> float:
    """Multiplier of the base lr at a 0-based step: linear warmup, then flat or cosine to 10%."""
    if schedule == "constant":
        return 1.0
    warm = max(1, round(warmup * total))
    if step < warm:
        return (step + 1) / warm
    if schedule == "warmup":
        return 1.0
    progress = (step - warm) / max(1, total - warm)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def _evaluate(model: torch.nn.Module, workload: Workload, batches: list) -> float:
    model.eval()
    total = sum(workload.loss(model, b).item() for b in batches) / len(batches)
    model.train()
    # Replicas may differ (DiLoCo, none): report the mean over ranks, on the unshaped world group.
    t = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def run_rank(cfg: RunConfig) -> RankResult:
    """Train on this rank (process group already initialized); return its records."""
    rank = dist.get_rank()
    device = _device(cfg)
    workload = make_workload(cfg.workload)
    cfg = resolve(cfg, workload)
    recorder = TraceRecorder(rank)
    shaping.install(_topology(cfg), mode=cfg.shaping, recorder=recorder)
    model, opt = _build(cfg, workload, device)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.steps, cfg.schedule, cfg.warmup)
    )
    to_dev = lambda batch: tuple(t.to(device) for t in batch)
    val = [to_dev(b) for b in workload.val_batches(_VAL_BATCHES, cfg.batch_size)]
    result = RankResult(rank, cfg.to_dict(), params=sum(p.numel() for p in model.parameters()))

    quiet = rank != 0 or bool(os.environ.get("TQDM_DISABLE"))
    bar = tqdm(total=cfg.steps, desc=cfg.method, unit="step", disable=quiet, dynamic_ncols=True)
    eval_s = 0.0  # evaluation time is excluded from the training clock
    start = shaping.clock()
    for step in range(1, cfg.steps + 1):
        recorder.begin_step(step)
        t0 = shaping.clock()
        loss = workload.loss(model, to_dev(workload.batch(step, rank, cfg.batch_size, cfg.seed)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss_value = loss.item()
        step_s = shaping.clock() - t0
        recorder.end_step(step)
        now = shaping.clock() - start - eval_s
        # Byte and call counts come from the trace after the run, off the training clock.
        row = {"step": step, "wall_time_s": now, "loss": loss_value, "val_loss": math.nan,
               "step_s": step_s}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            recorder.set_phase(EVAL)  # evaluation traffic is its own phase, left out
            e0 = shaping.clock()
            row["val_loss"] = _evaluate(model, workload, val)
            eval_s += shaping.clock() - e0
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{row['val_loss']:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{loss_value:.3f}")
        result.steps.append(row)
        bar.update(1)
    bar.close()
    result.trace = recorder.frame()
    return result
