"""Two ways to emulate N replicas in one process, side by side: threads over a process group, or
replicas stacked along a leading dimension (`torch.func` + `vmap`).

    python benchmarks/bench_emulate_designs.py [--nodes 16 64] [--graphs exponential] \\
        [--workload vision-tiny] [--steps 11]

(a) `threads` is the emulator `flexbench run --emulate` runs: every replica a thread with its
own model and optimizer, the real replicators over PyTorch's multi-threaded process group
(`experiments.run.emulate`). (b) `stacked` trains the same N replicas as one model whose every
parameter has a leading replica dimension: per-replica gradients by `vmap(grad(loss))` over the
N ranks' batches, AdamW on the stacked tensors (elementwise, so N independent AdamWs), and the
gossip round as the mixing matrix times the stacked parameters (`flexdemo.graphs.mixing_matrix`).
It is written here for the measurement only: it shares no exchange code with the replicators.

Each (design, graph, N) runs twice, 1 step and `--steps` steps, each in a fresh process of this
script; the difference over `--steps` - 1 is its seconds a step (start-up, imports and the
replicas' build cancel), and the longer run's peak memory (ru_maxrss) is reported. Same
workload, per-rank batch, seed and data in both; the stacked run's last training loss (the mean
over replicas) is printed beside the threaded one's as a check that both train the same
replicas. Run it on an otherwise idle machine; the figures depend on it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.config import RunConfig
from experiments.run.emulate import emulate
from experiments.workloads import make_workload


def _threads(workload: str, nodes: int, graph: str, steps: int) -> float:
    """Train `steps` steps with the threaded emulator; the mean training loss of the last step."""
    cfg = RunConfig(method="gossip", graph=graph, nodes=nodes, gpus_per_node=1,
                    workload=workload, steps=steps, eval_every=steps, seed=3)
    with tempfile.TemporaryDirectory(prefix="bench-designs-") as tmp:
        out = emulate(cfg, Path(tmp) / "run", timeout_s=3600, quiet=True)
        frame = pd.read_parquet(out / "steps.parquet")
    return float(frame["loss"].iloc[-1])


def _stacked(workload_name: str, nodes: int, graph: str, steps: int) -> float:
    """Train the same replicas stacked along dimension 0; the last step's mean training loss."""
    from torch.func import functional_call, grad_and_value, stack_module_state, vmap

    from flexdemo.graphs import mixing_matrix
    from flexdemo.methods import method_record

    workload = make_workload(workload_name)
    cfg = RunConfig(method="gossip", graph=graph, nodes=nodes, gpus_per_node=1,
                    workload=workload_name, steps=steps, seed=3).validate()
    batch_size = cfg.batch_size or workload.default_batch_size
    torch.manual_seed(cfg.seed)  # every replica starts from the same initialization
    model = workload.model()
    params, buffers = stack_module_state([model] * nodes)
    stacked = [torch.nn.Parameter(t) for t in params.values()]
    names = list(params)
    # gossip's base step: AdamW at the method's lr, constant, no weight decay (the run's defaults)
    opt = torch.optim.AdamW(stacked, lr=method_record("gossip").lr, weight_decay=0.0)
    mix = mixing_matrix(graph, nodes).float()

    def loss_of(flat: tuple[torch.Tensor, ...], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        state = dict(zip(names, flat, strict=True)) | buffers
        return workload.loss(lambda x: functional_call(model, state, (x,)), batch)

    per_replica = vmap(grad_and_value(loss_of), in_dims=(0, 0))
    loss = torch.zeros(nodes)
    for step in range(1, steps + 1):  # a run's steps count from 1, its batches with them
        batches = [workload.batch(step, rank, batch_size, cfg.seed) for rank in range(nodes)]
        batch = tuple(torch.stack(parts) for parts in zip(*batches, strict=True))
        grads, loss = per_replica(tuple(p.detach() for p in stacked), batch)
        for p, g in zip(stacked, grads, strict=True):
            p.grad = g
        opt.step()
        with torch.no_grad():  # the gossip round: row i of W applied to the replicas
            for p in stacked:
                p.copy_((mix @ p.reshape(nodes, -1)).view_as(p))
    return float(loss.mean())


DESIGNS = {"threads": _threads, "stacked": _stacked}


def _one(design: str, workload: str, nodes: int, graph: str, steps: int) -> dict:
    """One run of one design in this process: its seconds, last loss and peak memory."""
    t0 = time.perf_counter()
    loss = DESIGNS[design](workload, nodes, graph, steps)
    return {"seconds": time.perf_counter() - t0, "loss": loss,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _measure(design: str, workload: str, nodes: int, graph: str, steps: int) -> dict:
    """Seconds a step of a design (a run of `steps` less one of 1 step, each a fresh process:
    start-up, imports and the replicas' build cancel), its last loss and peak memory."""
    runs = []
    for n in (1, steps):
        done = subprocess.run([sys.executable, __file__, "--one", design, workload, str(nodes),
                               graph, "--steps", str(n)], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{design} on {graph} at {nodes} nodes failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"s_per_step": (runs[1]["seconds"] - runs[0]["seconds"]) / (steps - 1),
            "loss": runs[1]["loss"], "peak_gib": runs[1]["peak_gib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--graphs", nargs="+", default=["exponential"])
    parser.add_argument("--workload", default="vision-tiny")
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--one", nargs=4, metavar=("DESIGN", "WORKLOAD", "NODES", "GRAPH"),
                        help=argparse.SUPPRESS)  # a child process: one measurement, as JSON
    args = parser.parse_args()
    if args.one:
        design, workload, nodes, graph = args.one
        print(json.dumps(_one(design, workload, int(nodes), graph, args.steps)))
        return
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (a 1-step run is subtracted), got {args.steps}")
    print(f"{args.workload}, gossip, {args.steps} steps less 1 step, each run a fresh process")
    print(f"{'graph':<12} {'N':>4} {'threads s/step':>15} {'stacked s/step':>15} {'ratio':>6} "
          f"{'threads GiB':>12} {'stacked GiB':>12} {'loss threads':>13} {'loss stacked':>13}")
    for graph in args.graphs:
        for nodes in args.nodes:
            row = {design: _measure(design, args.workload, nodes, graph, args.steps)
                   for design in DESIGNS}
            a, b = row["threads"], row["stacked"]
            print(f"{graph:<12} {nodes:>4} {a['s_per_step']:>15.3f} {b['s_per_step']:>15.3f} "
                  f"{a['s_per_step'] / b['s_per_step']:>6.1f} {a['peak_gib']:>12.2f} "
                  f"{b['peak_gib']:>12.2f} {a['loss']:>13.5f} {b['loss']:>13.5f}")


if __name__ == "__main__":
    main()
