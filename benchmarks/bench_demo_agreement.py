"""How far FlexDeMo's DeMo moves from the reference package, step by step, in each arithmetic.

Runbook:
    pip install -e '.[dev]'     # brings the reference: detonation 0.5.2 (with einops, mltiming)
    python benchmarks/bench_demo_agreement.py [--steps 10] [--every 1]

Spawns 2 gloo ranks (2 nodes x 1 rank, one CPU thread each), each with its own data, and trains
the 2.1M-parameter MLP of ``bench_flexdemo.py`` (4 x [Linear(256, 1024), GELU,
Linear(1024, 256)]) three times from the same initialization on the same batches: with the
package's ``DeToSGD`` and ``DeMoReplicator(compression_topk=32, compression_chunk=64)``, and with
``FlexDeMo`` at the same setting (fp32 values, decay 0.999, lr 1e-3, sign) in the fast and in
the reference arithmetic (``DeMoKnobs.arithmetic``). Prints, after every ``--every``-th step,
the fraction of parameters that differ from the package's by more than 1e-5 and by anything at
all, the largest difference (a multiple of lr: each sign step moves a parameter by lr), and the
three losses. The reference arithmetic stays at 0 for any number of steps; the fast one parts
within a few, and its loss stays beside the package's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _gloo import join_gloo
from bench_flexdemo import mlp

from flexdemo import DeMoReplicator, FlexDeMo
from netsim import shaping

TOPK, CHUNK, DECAY, LR = 32, 64, 0.999, 1e-3
ARMS = ("fast", "reference")


def _package(model: torch.nn.Module, solo: dist.ProcessGroup):
    import detonation

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its chunk sizes
        return detonation.DeToSGD(
            model.parameters(), lr=LR, sharding_parallel_group=solo,
            replication_parallel_group=dist.group.WORLD,
            replicator=detonation.DeMoReplicator(compression_decay=DECAY,
                                                 compression_topk=TOPK,
                                                 compression_chunk=CHUNK))


def _worker(rank: int, world: int, store: str, steps: int, every: int) -> None:
    join_gloo(rank, world, store)
    solos = [dist.new_group([r]) for r in range(world)]  # the package: no sharding
    package = mlp()
    runs = [("package", package, _package(package, solos[rank]))]
    for arm in ARMS:
        model = mlp()
        runs.append((arm, model, FlexDeMo(model.parameters(), lr=LR, replicator=DeMoReplicator(
            topk=TOPK, chunk=CHUNK, decay=DECAY, value_format="fp32", arithmetic=arm))))
    numel = sum(p.numel() for p in package.parameters())
    if rank == 0:
        print(f"2 nodes x 1 rank, gloo, MLP {numel / 1e6:.1f}M params, topk {TOPK}, chunk "
              f"{CHUNK}, decay {DECAY}, lr {LR}, sign, fp32 values; parameters apart from the "
              "package's (rank 0)")
        print(f"{'step':>4}" + "".join(f"{arm + ' >1e-5':>17}{'any':>9}{'max':>8}" for arm in ARMS)
              + "".join(f"{'loss ' + name:>16}" for name, _, _ in runs))
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(16, 256, generator=g)
        losses = []
        for _, model, opt in runs:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if rank != 0 or (step % every and step != steps):
            continue
        row = f"{step:>4}"
        for _, model, _ in runs[1:]:
            with torch.no_grad():
                diff = torch.cat([(a - b).abs().reshape(-1) for a, b in
                                  zip(model.parameters(), package.parameters(), strict=True)])
            row += (f"{float((diff > 1e-5).sum()) / numel:>17.4%}"
                    f"{float((diff > 0).sum()) / numel:>9.4%}{float(diff.max()):>8.3f}")
        print(row + "".join(f"{loss:>16.6g}" for loss in losses), flush=True)
    dist.barrier()
    shaping.teardown()


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run the comparison on two spawned ranks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=1, help="print every N-th step (and the last)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        parser.error(f"--steps {args.steps} and --every {args.every} must both be at least 1.")
    try:
        import detonation  # noqa: F401
    except ImportError:
        parser.error("the reference package is missing: pip install -e '.[dev]' (detonation "
                     "0.5.2, einops, mltiming).")
    with tempfile.TemporaryDirectory(prefix="bench-demo-agreement-") as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), args.steps, args.every),
                 nprocs=2, join=True)


if __name__ == "__main__":
    main()
