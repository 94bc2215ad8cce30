"""`flexbench plan` at scale: a 100B-parameter, 108-layer model, five methods, a bandwidth grid.

Run: python benchmarks/bench_plan.py [--bandwidths 50] [--nodes 16] [--fragments 36]
Prints the wall time of the whole plan (model on the meta device, programs, every replay) and
the process's peak resident memory. The model is the built-in decoder at
dim=8192, layers=108, heads=64, kv_heads=8, vocab=128256, ffn=31744 (102.7B parameters).
With --layout SPEC it times only the model's layout instead (`--model SPEC` built on the meta
device and grouped into FSDP2 units), as for a user's factory:
python benchmarks/bench_plan.py --layout benchmarks.plan_factory:llama70b
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.cli import main as flexbench  # noqa: E402

MODEL = "gpt:dim=8192,layers=108,heads=64,kv_heads=8,vocab=128256,ffn=31744,tied=false"
METHODS = ("hsdp-adamw", "flexdemo", "flexdemo-async", "diloco", "streaming-diloco")


def main() -> None:
    """Time one plan and print its wall time and peak memory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--fragments", type=int, default=36)
    parser.add_argument("--layout", metavar="SPEC",
                        help="time only the layout of --model SPEC (e.g. a module:function)")
    args = parser.parse_args()
    if args.layout:
        _layout(args.layout)
        return
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "plan.csv"
        argv = ["plan", "--model", MODEL, "--method", *METHODS, "--nodes", str(args.nodes),
                "--gpus-per-node", "8", "--gpu", "h100", "--batch", "1", "--seq", "4096",
                "--inter-bw", f"1Gbit:1Tbit:{args.bandwidths}", "--inter-lat", "10ms",
                "--set", f"num_fragments={args.fragments}",
                "--set", f"sync_every={args.fragments * 3}", "--out", str(out)]
        start = time.perf_counter()
        code = flexbench(argv)
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(f"bench_plan: exit {code}; {len(METHODS)} methods x {args.bandwidths} bandwidths on "
          f"{args.nodes} x 8, {args.fragments} fragments: {seconds:.1f} s, peak resident "
          f"memory {peak:.2f} GiB")


def _layout(spec: str) -> None:
    """Time one model's layout, from the import of the planner on."""
    start = time.perf_counter()
    from experiments.plan.models import declare_model

    model = declare_model(spec)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(f"bench_plan: layout of {spec}: {model.params:,} parameters in {len(model.units)} "
          f"FSDP2 units: {seconds:.1f} s, peak resident memory {peak:.2f} GiB")


if __name__ == "__main__":
    main()
