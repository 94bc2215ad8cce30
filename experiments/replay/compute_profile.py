"""`flexbench profile-compute`: what a step computes on this machine's device, for the replay.

    flexbench profile-compute --workload lm-small --method flexdemo --out results/gpu/p.json
    flexbench simulate runs/flex --inter-bw 10Gbit --compute-profile results/gpu/p.json --out s.csv

A real run of the method (`flexbench run`, unshaped, `--nodes` x `--gpus-per-node` ranks on the
device its backend picks: a GPU per rank with nccl, else CPU gloo) records its trace; the
profile is the compute of each step phase there, outside every collective, as the replay counts
it (`netsim.model.compute_phases`): forward+backward (to the "backward" mark: the model, its
loss and FSDP2's hooks) and the optimizer step (the base optimizer, and the method's DCT/top-k
encode and decode when the run has another node to exchange with), the median over the steps
after `--skip-steps`. On a GPU the run waits for the device at each phase's end (`sync_phases`),
so the host's timestamps are the device's compute, not the kernel launches. `flexbench
simulate --compute-profile FILE` replays a recording of the same workload, method and batch
with each phase scaled to those seconds.

At 1 node a method's replicator exchanges with nobody and skips its encode and decode, so a
profile measured there leaves them out; the replay says so beside its result. A lent GPU
machine has one GPU, where that is the only shape nccl runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

from experiments.aliases import add_old_spelling
from experiments.config import RunConfig
from experiments.errors import ConfigError, RunFailed, Stopped
from experiments.io import check_output_file, cpu_model, read_json, write_atomic
from experiments.run_record import RunRecord
from experiments.values import COUNT, POSITIVE, POSITIVE_INT
from flexdemo.devices import backend_for, visible_cuda_devices
from flexdemo.methods import METHODS, method_record
from netsim.model import compute_phases

__all__ = ["ComputeProfile", "load_profile", "measure_profile", "configure", "main", "FORMAT"]

FORMAT = "flexbench-compute-profile/1"
_DEFAULT_STEPS, _DEFAULT_WARMUP = 30, 5


@dataclass(frozen=True)
class ComputeProfile:
    """Compute seconds per step of one method on one workload and device, by phase."""

    workload: str
    method: str
    batch_size: int
    """Per-rank batch of the profiled run: a replay of another batch is refused."""
    nodes: int
    gpus_per_node: int
    device: str
    """"cuda" or "cpu": the device the ranks computed on."""
    device_name: str
    """The GPU's name (torch.cuda.get_device_name) or the CPU's model."""
    backend: str
    torch_version: str
    measured_at: str
    steps: int
    """Steps the medians are over (the run's steps after the warm-up)."""
    forward_backward_s: float
    optimizer_s: float

    @property
    def phase_seconds(self) -> tuple[float, float]:
        """(forward_backward_s, optimizer_s), in netsim.model's PHASES order."""
        return self.forward_backward_s, self.optimizer_s

    @property
    def gpu_class(self) -> bool:
        """Whether it was measured on an accelerator (then the replay models intra-node links)."""
        return self.device != "cpu"

    def describe(self) -> str:
        """One line: where it was measured and what it holds."""
        return (f"profiled on {self.device_name} ({self.device}, {self.backend}, torch "
                f"{self.torch_version}) as {self.nodes}x{self.gpus_per_node} ranks at batch "
                f"{self.batch_size}: forward+backward {self.forward_backward_s * 1e3:.4g} ms, "
                f"optimizer {self.optimizer_s * 1e3:.4g} ms per step (median of {self.steps})")

    def check_fits(self, config: RunConfig, path: str) -> None:
        """ConfigError (one sentence) unless it is of this run's workload, method and batch."""
        for name in ("workload", "method", "batch_size"):
            mine, theirs = getattr(self, name), getattr(config, name)
            if theirs is not None and mine != theirs:
                raise ConfigError(f"compute profile {path!r} is of {name} {mine!r}, and the "
                                  f"recording's is {theirs!r}; profile that one with `flexbench "
                                  f"profile-compute --workload {config.workload} --method "
                                  f"{config.method}`.")

    def caveats(self, target_nodes: int) -> list[str]:
        """What the profile cannot hold for a target of that shape, one line each."""
        lines = []
        record = method_record(self.method)
        if self.nodes == 1 and target_nodes > 1 and record.replicator is not None:
            lines.append(f"profiled at 1 node, where {self.method} exchanges with nobody: its "
                         "encode and decode are not in the optimizer phase, which is low by them")
        return lines


def load_profile(path: Path | str) -> ComputeProfile:
    """A profile written by `flexbench profile-compute`; ConfigError (one sentence) if it is not."""
    name = str(path)
    data = read_json(path, "compute profile")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{name!r} is not a compute profile (its format is not {FORMAT!r}); "
                          "write one with `flexbench profile-compute`.")
    wanted = [f.name for f in fields(ComputeProfile)]
    missing = sorted(set(wanted) - set(data))
    if missing:
        raise ConfigError(f"compute profile {name!r} is damaged: it lacks {', '.join(missing)}.")
    for key in ("forward_backward_s", "optimizer_s"):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ConfigError(f"compute profile {name!r} is damaged: {key} is {value!r}, not "
                              "a finite number of seconds >= 0.")
    if data["method"] not in METHODS:
        raise ConfigError(f"compute profile {name!r} is damaged: method {data['method']!r} is "
                          f"not one of {', '.join(METHODS)}.")
    return ComputeProfile(**{key: data[key] for key in wanted})


def measure_profile(workload: str, method: str, *, nodes: int = 2, gpus_per_node: int = 1,
                    steps: int = _DEFAULT_STEPS, warmup: int = _DEFAULT_WARMUP,
                    backend: str = "auto", batch_size: int | None = None,
                    work_dir: Path | None = None,
                    timeout_s: float | None = None) -> ComputeProfile:
    """Run the method unshaped on this machine's device and return its per-phase compute
    (RunFailed if the run fails or passes `timeout_s`, the workload's own code included)."""
    import torch

    from experiments.run.launch import launch

    cfg = RunConfig(method=method, workload=workload, nodes=nodes, gpus_per_node=gpus_per_node,
                    steps=steps, eval_every=steps + 1, backend=backend, batch_size=batch_size,
                    sync_phases=True)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        run_dir = launch(cfg, Path(tmp) / "profile", timeout_s=timeout_s)
        record = RunRecord.load(run_dir)
        trace, resolved = record.trace(), record.config
    kept = trace[trace["step"] > warmup]
    fb, opt = compute_phases(kept)
    # The launcher's own choice (it refused nccl without a GPU before the run started).
    backend_used = backend_for(backend, visible_cuda_devices(), nodes * gpus_per_node)
    device = "cuda" if "nccl" in backend_used else "cpu"
    device_name = (torch.cuda.get_device_name(0) if device == "cuda"
                   else cpu_model() or "unknown CPU")
    return ComputeProfile(
        workload=workload, method=method, batch_size=int(resolved["batch_size"]), nodes=nodes,
        gpus_per_node=gpus_per_node, device=device, device_name=device_name,
        backend=backend_used, torch_version=torch.__version__,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        steps=int(kept["step"].nunique()), forward_backward_s=fb, optimizer_s=opt,
    )  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench profile-compute`."""
    parser.add_argument("--workload", required=True, help="workload to profile, e.g. lm-small")
    parser.add_argument("--method", required=True, choices=METHODS, help="method to profile")
    parser.add_argument("--nodes", type=POSITIVE_INT.arg, default=2,
                        help="nodes of the profiled run (default 2: the method's encode and "
                        "decode run; 1 on a machine with one GPU)")
    parser.add_argument("--gpus-per-node", type=POSITIVE_INT.arg, default=1,
                        help="ranks per node (default 1)")
    parser.add_argument("--steps", type=POSITIVE_INT.arg, default=_DEFAULT_STEPS,
                        help=f"steps to run (default {_DEFAULT_STEPS})")
    skip = parser.add_argument("--skip-steps", type=COUNT.arg, default=_DEFAULT_WARMUP,
                               help="first steps left out of the medians (default "
                               f"{_DEFAULT_WARMUP})")
    add_old_spelling(parser, "--warmup", skip)
    parser.add_argument("--batch-size", type=POSITIVE_INT.arg, default=None,
                        help="per-rank batch (default: the workload's)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="as `flexbench run --backend`: auto takes nccl with a GPU per rank")
    parser.add_argument("--out", required=True, help="JSON file for the profile")
    parser.add_argument("--timeout", type=POSITIVE.arg, default=None, metavar="S",
                        help="seconds before the profiled run is stopped, the workload's own "
                        "code included (default: none), as `flexbench run --timeout`")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench profile-compute`."""
    out = check_output_file(args.out, what="--out")
    for name in ("nodes", "gpus_per_node", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                              f"{getattr(args, name)}.")
    if not 0 <= args.skip_steps < args.steps:
        raise ConfigError(f"--skip-steps must be >= 0 and below --steps {args.steps}, got "
                          f"{args.skip_steps}.")
    try:
        profile = measure_profile(args.workload, args.method, nodes=args.nodes,
                                  gpus_per_node=args.gpus_per_node, steps=args.steps,
                                  warmup=args.skip_steps, backend=args.backend,
                                  batch_size=args.batch_size, work_dir=out.parent,
                                  timeout_s=args.timeout)
    except Stopped:
        raise  # SIGTERM: said by the command line, exit 143
    except RunFailed as err:
        print(f"flexbench profile-compute: failed: {err}", file=sys.stderr)
        return 1
    write_atomic(out, json.dumps({"format": FORMAT, **asdict(profile)}, indent=2) + "\n")
    print(f"{args.method} on {args.workload}: {profile.describe()} -> {out}")
    return 0
