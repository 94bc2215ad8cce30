"""`flexbench plan`: step time, compute utilization, bytes and memory of methods on a declared
model, cluster and network, with the bandwidth each method needs for a target utilization.

    flexbench plan --model llama3-8b --method hsdp-adamw flexdemo diloco --nodes 4 \\
        --gpus-per-node 8 --gpu h100 --batch 2 --seq 4096 --inter-bw 1Gbit:400Gbit:12 \\
        --inter-lat 5ms --out plan.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.aliases import add_old_spelling
from experiments.config import (
    check_algorithm_on_sites,
    is_plugin,
    load_site_file,
    method_of,
    parse_sets,
)
from experiments.deadline import bounded, run_deadline
from experiments.errors import ConfigError, RunFailed
from experiments.io import check_output_file, write_atomic
from experiments.plan.ada import graph_schedule, plan_ada
from experiments.plan.hardware import (
    DEFAULT_MFU,
    GPUS,
    StepCompute,
    given_compute,
    gpu,
    rule_compute,
)
from experiments.plan.measured import measured_compute
from experiments.plan.models import PRESETS, DeclaredModel, declare_model, parse_gpt
from experiments.plan.plan import CU_TARGETS, MethodPlan, bandwidth_needed, plan_method
from experiments.plan.replicas import check_nodes_per_replica, replica_line, replica_topology
from experiments.plan.synth import (
    PLANNED_METHODS,
    Precision,
    has_program,
    local_shard_shapes,
    method_program,
    sync_in_backward,
    wired,
)
from experiments.plan.target import MISSING, StepsSource, steps_source
from experiments.replay.compute_profile import load_profile
from experiments.sizes import Cost, Count, Term, check_work
from experiments.values import BANDWIDTH, LATENCY, POSITIVE, POSITIVE_INT, UNIT_OPEN_LOW
from flexdemo.methods import METHODS, method_record
from netsim.costs import ALGORITHM_CHOICES
from netsim.sites import hierarchy_line
from netsim.topology import Link, Topology
from netsim.units import format_bandwidth, parse_bandwidth, parse_latency

__all__ = ["DEFAULT_TIMEOUT_S", "configure", "grid_points", "main", "parse_bandwidths",
           "split_sets"]

OUTPUTS = (".csv", ".json", ".png")
# --set keys that are the plan's own (FSDP2's mixed precision, ...), not a method's knob.
PLAN_KEYS = ("param_dtype", "reduce_dtype", "optimizer_s", "backend", "sync_in_backward")
_RANGE = re.compile(r"^([^:]+):([^:]+):([^:]+)$")
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB|TB)\s*$")
# A plan of the largest preset on a few methods and a dozen bandwidths takes seconds; ten
# minutes is a plan that lost its way (or a factory that never returns).
DEFAULT_TIMEOUT_S = 600.0

# What a plan's work costs per item (measured on 2 cores: 4,000 layers built and laid out in
# 8 s, 1,000 layers replayed at 20 bandwidths in 15 s, 8,192 GPUs a node in 16 GB and 150 s for
# 3 units and 2 methods, 10^7 nodes in 8 s and 140 MB, Ada's ladder of 10^4 replicas in 11 s):
# the bound on every count it takes (experiments.sizes).
_BUILD = Cost("to build and lay out a unit on the meta device", seconds=2e-3)
_REPLAY = Cost("to replay a unit of a method at a bandwidth", seconds=7e-4)
_RANK_PAIR_BYTES = Cost("a pair of a node's GPUs in a unit's synthesized trace (each row names "
                        "its group's GPUs)", bytes=64)
_RANK_PAIR = Cost("to synthesize a pair of a node's GPUs in a unit's trace, per method",
                  seconds=3e-7)
_NODE_BYTES = Cost("a node in the topology of a bandwidth", bytes=16)
_NODE = Cost("to replay a node of a method at a bandwidth", seconds=8e-7)
_ROW = Cost("a method's row at a bandwidth", bytes=512)
_REPLICA_PAIR = Cost("to weigh a pair of replicas in Ada's graph ladder", seconds=1e-7)
_PERIOD_STEP = Cost("to walk a step of the method's schedule", seconds=5e-7)


def configure(parser: argparse.ArgumentParser) -> None:
    """The plan's flags, named as `simulate`'s and `run`'s where they mean the same."""
    parser.add_argument("--model", required=True,
                        help="a preset (llama3-8b, ...), a built-in workload (lm-tiny), "
                             "gpt:dim=...,layers=...,heads=...,vocab=...,ffn=...,tied=... or "
                             "module:function (built on the meta device)")
    parser.add_argument("--method", nargs="+", required=True, metavar="M",
                        help=f"methods to plan: {', '.join(PLANNED_METHODS)}")
    parser.add_argument("--nodes", type=POSITIVE_INT.arg, required=True,
                        help="nodes of the cluster")
    parser.add_argument("--gpus-per-node", type=POSITIVE_INT.arg, required=True,
                        help="GPUs per node")
    parser.add_argument("--nodes-per-replica", type=POSITIVE_INT.arg, default=1, metavar="K",
                        help="nodes one replica spans (default 1): FSDP2 over K x G GPUs of K "
                             "nodes of a site, the method's exchange between replicas")
    compute = parser.add_mutually_exclusive_group(required=True)
    compute.add_argument("--gpu", help=f"GPU kind: {', '.join(GPUS)}")
    step = compute.add_argument("--step-compute", type=POSITIVE.arg, metavar="SECONDS",
                                help="compute seconds per step, as given")
    add_old_spelling(compute, "--step-time", step)
    compute.add_argument("--compute-profile", default=None, metavar="P",
                         help="a `flexbench profile-compute` file of the same model: its "
                              "forward+backward and optimizer seconds per step")
    compute.add_argument("--compute-from", default=None, metavar="RUN",
                         help="a recording or an imported trace (import-trace) of the same "
                              "model and GPUs per node: its measured forward+backward (per "
                              "FSDP2 unit where the trace names them) and optimizer seconds")
    parser.add_argument("--mfu", type=UNIT_OPEN_LOW.arg, default=None,
                        help=f"model FLOPs utilization with --gpu (default {DEFAULT_MFU})")
    parser.add_argument("--batch", type=POSITIVE_INT.arg, default=None,
                        help="sequences per GPU per step (with --gpu)")
    parser.add_argument("--seq", type=POSITIVE_INT.arg, default=None,
                        help="tokens per sequence (with --gpu)")
    parser.add_argument("--gpu-memory", default=None,
                        help="memory per GPU, e.g. 80GB (default: the --gpu table's)")
    parser.add_argument("--inter-bw", nargs="+", default=None, metavar="BW", type=_rates_arg,
                        help="inter-node bandwidth: one rate, several, or A:B:COUNT log-spaced")
    parser.add_argument("--inter-lat", default=None, type=LATENCY.arg,
                        help="inter-node latency, e.g. 5ms")
    parser.add_argument("--topology", default=None, metavar="FILE",
                        help="a site file (TOML, as simulate's) instead of --inter-bw and "
                             "--inter-lat: the nodes in sites, their links and round trips")
    parser.add_argument("--intra-bw", default="100GB/s", type=BANDWIDTH.arg,
                        help="intra-node bandwidth (default 100GB/s, NVLink-class)")
    parser.add_argument("--intra-lat", default="5us", type=LATENCY.arg,
                        help="intra-node latency (default 5us)")
    parser.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default="auto",
                        help="inter-node collective algorithms (default auto)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a method knob by its run name (diloco_h=100, topk=8, ...) or "
                             f"the plan's own ({', '.join(PLAN_KEYS)})")
    parser.add_argument("--steps-to-target", nargs="+", default=None, metavar="N",
                        help="steps to the target loss: N for every method, or METHOD=N; the "
                             "time to target is N x the step time")
    parser.add_argument("--steps-from", nargs="+", default=None, metavar="RUN",
                        help="recordings of the planned --model whose validation loss gives "
                             "each method's steps to --target")
    parser.add_argument("--target", type=POSITIVE.arg, default=None,
                        help="the validation loss --steps-from counts the steps to")
    parser.add_argument("--ada-graphs", default=None, metavar="GRAPH=STEPS,...|RUN",
                        help="for --method ada: the steps it spends on each graph of its "
                             "ladder (complete=80,exponential=20), or a run of ada whose "
                             "recorded graph per step gives them")
    parser.add_argument("--out", required=True,
                        help=f"file to write: {', '.join(OUTPUTS)} by its extension")
    parser.add_argument("--timeout", type=POSITIVE.arg, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="seconds before the plan is stopped, a model factory's own code "
                             f"included (default {DEFAULT_TIMEOUT_S:g}); a plan estimated to "
                             "take longer is refused before it starts")


def grid_points(values: list[str]) -> int:
    """How many rates the --inter-bw values make (ConfigError on a malformed A:B:COUNT), counted
    before any is made."""
    points = 0
    for value in values:
        match = _RANGE.match(value)
        if match is None:
            points += 1
            continue
        count = match.group(3)
        if not count.isdigit() or int(count) < 2:
            raise ConfigError(f"--inter-bw {value!r}: COUNT {count!r} must be a whole number "
                              ">= 2 (a range of one point is empty; give the rate alone).")
        points += int(count)
    return points


def _rates_arg(text: str) -> str:
    """--inter-bw's argparse type: a rate, or A:B:COUNT whose ends are rates."""
    match = _RANGE.match(text)
    for rate in (match.group(1), match.group(2)) if match else (text,):
        BANDWIDTH.arg(rate)
    return text


def parse_bandwidths(values: list[str]) -> list[float]:
    """Bytes/s of each --inter-bw value; A:B:COUNT is COUNT rates log-spaced from A to B."""
    grid_points(values)  # every COUNT checked before any range is made
    rates: list[float] = []
    for value in values:
        match = _RANGE.match(value)
        if match is None:
            rates.append(parse_bandwidth(value))
            continue
        low, high = parse_bandwidth(match.group(1)), parse_bandwidth(match.group(2))
        if not low < high:
            raise ConfigError(f"--inter-bw {value!r} runs from {match.group(1)} down to "
                              f"{match.group(2)}; give A:B:COUNT with A below B.")
        rates.extend(float(r) for r in np.geomspace(low, high, int(match.group(3))))
    return sorted(set(rates))


def split_sets(items: list[str], methods: list[str]) -> tuple[dict, dict[str, dict]]:
    """(the plan's own settings, per method the knobs it reads); one sentence on a bad one."""
    own: dict = {}
    knobs: dict[str, dict] = {m: {} for m in methods}
    for key, value in parse_sets(items).items():
        if key in PLAN_KEYS:
            own[key] = value
            continue
        readers = [m for m in methods if key in method_record(m).takes]
        if not readers:
            takes = sorted({k for m in methods for k in method_record(m).takes})
            raise ConfigError(f"--set {key}: no planned method reads it; "
                              f"{', '.join(methods)} take {', '.join(takes) or 'no knobs'}, "
                              f"and the plan itself {', '.join(PLAN_KEYS)}.")
        for m in readers:
            knobs[m][key] = value
    return own, knobs


def _check(args: argparse.Namespace) -> None:
    """Refuse, in one sentence each, what the flags cannot mean (before anything runs)."""
    suffix = Path(args.out).suffix.lower()
    if suffix not in OUTPUTS:
        raise ConfigError(f"--out {args.out!r} must end in {', '.join(OUTPUTS)}.")
    check_output_file(args.out, what="--out", reads=_inputs(args))
    _check_methods(args.method)
    if args.ada_graphs is not None and "ada" not in args.method:
        raise ConfigError("--ada-graphs gives ada's graphs, but --method does not plan ada.")
    _check_network(args)
    _check_compute(args)
    check_nodes_per_replica(args.nodes_per_replica, args.nodes)
    check_work_size(args, _known_units(args.model))
    if args.nodes_per_replica > 1:
        for method in args.method:
            if not method_record(method).shards:
                raise ConfigError(f"--method {method} shards nothing (every GPU a replica), so "
                                  "a replica spans no nodes; plan it without "
                                  "--nodes-per-replica.")


def _inputs(args: argparse.Namespace) -> list[str]:
    """Every file and folder the plan reads: its output may be none of them, nor inside one."""
    given = [*(args.steps_from or ()), args.compute_profile, args.compute_from, args.topology]
    if args.ada_graphs is not None and Path(args.ada_graphs).exists():
        given.append(args.ada_graphs)  # a run's folder, not GRAPH=STEPS
    if args.model.endswith(".json"):
        given.append(args.model)  # a Hugging Face config.json
    return [path for path in given if path is not None]


def _known_units(spec: str) -> int | None:
    """FSDP2 units of a preset or gpt: model, known from its sizes before it is built (its
    parameters bounded there); None for a model known only once built."""
    if spec in PRESETS:
        return PRESETS[spec].layers + 1
    if spec.startswith("gpt:"):
        return parse_gpt(spec).layers + 1
    return None


def check_work_size(args: argparse.Namespace, units: int | None, *, built: bool = False,
                    periods: dict[str, int] | None = None) -> None:
    """Refuse a plan whose work passes this machine's memory or --timeout (experiments.sizes):
    its layers, methods, bandwidths, nodes, GPUs per node and each method's period in steps
    (where known: `periods`), each times what it costs."""
    layers = Count("--model", units or 1, "FSDP2 units",
                   said=f"--model {args.model!r} with {units or 1:,} FSDP2 units")
    methods = Count("--method", len(args.method), "methods")
    points = Count("--inter-bw", grid_points(args.inter_bw) if args.inter_bw else 1,
                   "bandwidths")
    points = dataclasses.replace(points, said=f"--inter-bw's grid of {points.value:,} points")
    nodes = Count("--nodes", args.nodes, "nodes")
    per_node = Count("--gpus-per-node", args.gpus_per_node, "GPUs per node")
    terms = [Term(_REPLAY, (methods, points, layers)), Term(_RANK_PAIR_BYTES,
                                                             (layers, per_node, per_node)),
             Term(_RANK_PAIR, (methods, layers, per_node, per_node)),
             Term(_NODE_BYTES, (points, nodes)), Term(_NODE, (methods, points, nodes)),
             Term(_ROW, (methods, points))]
    if not built:
        terms.append(Term(_BUILD, (layers,)))
    if "ada" in args.method:
        replicas = Count("--nodes", max(1, args.nodes // args.nodes_per_replica), "replicas")
        terms.append(Term(_REPLICA_PAIR, (replicas, replicas)))
    for method, period in (periods or {}).items():
        terms.append(Term(_PERIOD_STEP, (Count("--set", period, f"steps of {method}'s period",
                                               said=f"{method}'s period of {period:,} steps "
                                               "(its --set knobs)"),)))
    check_work("the plan", terms, budget_s=args.timeout, budget=f"--timeout {args.timeout:g} s")


def _check_methods(methods: list[str]) -> None:
    """Known methods, each planned, none twice."""
    for method in methods:
        if is_plugin(method):
            _check_plugin(method)
            continue
        if method not in METHODS:
            raise ConfigError(f"--method {method!r} is unknown; use one of {', '.join(METHODS)}, "
                              "or your own as module.path:factory.")
        record = method_record(method)
        if not has_program(record):
            raise ConfigError(f"--method {method!r} has no program for the planner: its "
                              f"replicator {record.replicator!r} writes none "
                              f"(Replicator.program); plan one of {', '.join(PLANNED_METHODS)}.")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--method lists a method twice ({' '.join(methods)}).")


def _check_plugin(method: str) -> None:
    """A plug-in is planned from the program its replicator writes (``Replicator.program``)."""
    record = method_of(method)
    if not has_program(record):
        cls = record.replicator_type
        raise ConfigError(f"--method {method}: its replicator {cls.__name__} "
                          f"({inspect.getsourcefile(cls)}) writes no program for the planner "
                          "(Replicator.program); the planner plans the built-in methods and "
                          "plug-ins whose replicator has one.")


def _check_network(args: argparse.Namespace) -> None:
    """A bandwidth grid and latency, or a site file: one of the two."""
    if args.topology is None and (args.inter_bw is None or args.inter_lat is None):
        raise ConfigError("give the inter-node network: --inter-bw and --inter-lat, or a site "
                          "file as --topology.")
    if args.topology is not None and (args.inter_bw is not None or args.inter_lat is not None):
        raise ConfigError(f"--topology {args.topology} sets the links between nodes; leave out "
                          "--inter-bw and --inter-lat.")
    check_algorithm_on_sites(args.algorithm, args.topology)
    if args.inter_bw is not None and len(set(args.inter_bw)) < len(args.inter_bw):
        raise ConfigError(f"--inter-bw lists a value twice ({' '.join(args.inter_bw)}); give "
                          "each once.")


def _check_compute(args: argparse.Namespace) -> None:
    """The rule's flags only with --gpu, and all of them there."""
    given = next((flag for flag, value in (("--step-compute", args.step_compute),
                                            ("--compute-profile", args.compute_profile),
                                            ("--compute-from", args.compute_from))
                  if value is not None), None)
    if given is not None:
        for flag, value in (("--mfu", args.mfu), ("--batch", args.batch), ("--seq", args.seq)):
            if value is not None:
                raise ConfigError(f"{flag} sizes the compute with --gpu; {given} gives it "
                                  "already, so leave it out.")
    elif args.batch is None or args.seq is None:
        raise ConfigError("--gpu needs --batch and --seq (sequences per GPU and tokens per "
                          "sequence) for the 6 x N x tokens rule.")


def _gpu_memory(args: argparse.Namespace) -> tuple[float | None, str]:
    """Bytes of memory per GPU and where the figure comes from (None: not known)."""
    if args.gpu_memory is not None:
        match = _MEMORY.match(args.gpu_memory)
        if match is None or not 0 < float(match.group(1)) < math.inf:
            raise ConfigError(f"--gpu-memory {args.gpu_memory!r} is not a size above zero; "
                              "give GB, GiB or TB, such as 80GB.")
        scale = {"GB": 1e9, "GiB": 2**30, "TB": 1e12}[match.group(2)]
        return float(match.group(1)) * scale, f"{args.gpu_memory} as given"
    if args.gpu is not None:
        device = gpu(args.gpu)
        return float(device.memory_bytes), f"{device.memory_bytes / 1e9:g} GB ({device.source})"
    return None, "not known (give --gpu-memory)"


def main(args: argparse.Namespace) -> int:
    """Plan every method on every bandwidth, print the figures and assumptions, write --out.

    The plan runs under --timeout (a model factory's code included): past it, one sentence,
    exit 1 and nothing written, as `flexbench run`'s timeout."""
    _check(args)
    try:
        with run_deadline(args.timeout, command="plan", stopped=""):
            return bounded("the plan", lambda: _plan(args))
    except RunFailed as err:
        print(f"flexbench plan: failed: {err}", file=sys.stderr)
        return 1


def _plan(args: argparse.Namespace) -> int:
    """The plan itself, its flags checked."""
    topologies, labels, network = _network(args)
    # A site file's sites first: the replicas' check below counts on whole ones.
    check_nodes_per_replica(args.nodes_per_replica, args.nodes, topologies[0].sites)
    own, knobs = split_sets(args.set, args.method)
    precision = Precision(own.get("param_dtype", "bf16"), own.get("reduce_dtype", "fp32"))
    optimizer_s = _seconds(own["optimizer_s"]) if "optimizer_s" in own else None
    backend = own.get("backend", "nccl")
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"backend={backend!r} is unknown; use nccl or gloo.")
    in_backward = _sync_in_backward(own.get("sync_in_backward"), args.method)
    settings = {m: _knobs_on(m, knobs[m], args) for m in args.method}
    check_work_size(args, _known_units(args.model))
    memory_cap, memory_source = _gpu_memory(args)
    source = steps_source(args.steps_to_target, args.steps_from, args.target, args.model,
                          args.method)
    graphs = (graph_schedule(args.ada_graphs, args.nodes // args.nodes_per_replica,
                             args.model) if "ada" in args.method else None)
    model = declare_model(args.model)
    # The model's size, known now if only a factory or a config could tell it, and each
    # method's period as its program says (a schedule of 10^12 steps is a count like any other).
    check_work_size(args, len(model.units), built=True, periods=_periods(args, settings, model))
    compute = _compute(args, [model.unit_params(u) for u in range(len(model.units))], optimizer_s)
    k = args.nodes_per_replica
    replicas = [replica_topology(t, k) for t in topologies]

    def plan_of(method: str, knobs: object) -> MethodPlan:
        record = method_record(method)
        return plan_method(record, knobs, model, replicas, labels, compute, precision,
                           args.algorithm, backend=backend, nodes_per_replica=k,
                           sync_in_backward=in_backward and sync_in_backward(record))

    plans = [plan_ada(settings[m], graphs, lambda on_graph: plan_of("ada", on_graph))
             if m == "ada" else plan_of(m, settings[m]) for m in args.method]
    frame = pd.concat([p.frame() for p in plans], ignore_index=True)
    frame["memory_over"] = (frame["memory_per_gpu_bytes"] > memory_cap
                            if memory_cap is not None else False)
    if source is not None:  # a time only where a source states the steps
        frame["steps_to_target"] = frame["method"].map(source.steps)
        frame["time_to_target_s"] = frame["steps_to_target"] * frame["step_time_s"]
    needed = _needed_table(plans, frame) if args.topology is None else pd.DataFrame()
    assumptions = _assumptions(args, model, compute, precision, network, memory_source,
                               plans, settings, source, in_backward)
    _print(args, frame, needed, plans, assumptions, memory_cap)
    _write(Path(args.out), frame, needed, assumptions)
    print(f"wrote {args.out}")
    return 0


def _periods(args: argparse.Namespace, settings: dict[str, object],
             model: DeclaredModel) -> dict[str, int]:
    """Each method's period in steps, as its program says (Ada's is its graphs')."""
    shapes = local_shard_shapes(model, args.gpus_per_node, 0)
    replicas = max(1, args.nodes // args.nodes_per_replica)
    return {m: method_program(method_record(m), settings[m], shapes, replicas).period
            for m in args.method if m != "ada"}


def _compute(args: argparse.Namespace, unit_params: list[int],
             optimizer_s: float | None) -> StepCompute:
    """A step's compute: by the rule from --gpu, from --compute-profile, or --step-compute's;
    `optimizer_s` (--set optimizer_s; None: not given, 0 s) beside the first and the last."""
    if args.compute_profile is not None:
        return _profiled(args, unit_params, optimizer_s)
    if args.compute_from is not None:
        if optimizer_s is not None:
            raise ConfigError("--set optimizer_s and --compute-from both give the optimizer "
                              "step's seconds; give one.")
        return measured_compute(args.compute_from, unit_params, args.gpus_per_node, args.model)
    if args.gpu is not None:
        return rule_compute(unit_params, gpu(args.gpu),
                            DEFAULT_MFU if args.mfu is None else args.mfu, args.batch, args.seq,
                            optimizer_s or 0.0)
    return given_compute(unit_params, args.step_compute, optimizer_s or 0.0)


def _knobs_on(method: str, given: dict, args: argparse.Namespace) -> object:
    """The method's knobs, refused where they cannot run between the plan's replicas: the
    check `run` makes at its nodes (`Method.settings_on`)."""
    replicas = args.nodes // args.nodes_per_replica
    try:
        return method_record(method).settings_on(given, replicas)[0]
    except ValueError as err:
        shape = (f" ({args.nodes} nodes / --nodes-per-replica {args.nodes_per_replica})"
                 if args.nodes_per_replica > 1 else "")
        raise ConfigError(f"--method {method} on {replicas} replica(s){shape}: {err}") from None


def _sync_in_backward(value: object, methods: list[str]) -> bool:
    """The sync_in_backward setting (None: not given, false): true or false, and given only
    where a method reads it."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"sync_in_backward={value!r} must be true or false.")
    if not any(sync_in_backward(method_record(m)) for m in methods):
        able = [m for m in METHODS if sync_in_backward(method_record(m))]
        raise ConfigError(f"sync_in_backward={str(value).lower()} says when the outer sync of "
                          f"{', '.join(able)} starts, and --method plans none of them; "
                          "plan one of them or leave it out.")
    return value


def _sync_lines(plans: list[MethodPlan], in_backward: bool) -> list[str]:
    """When DiLoCo's and Streaming DiLoCo's outer sync starts, if one is planned."""
    syncing = [p.method for p in plans if sync_in_backward(method_record(p.method))]
    if not syncing:
        return []
    if in_backward:
        return [f"sync_in_backward: {', '.join(syncing)} start their outer sync unit by unit, "
                "each unit's piece (its share of the sync's bytes, by its elements) when its "
                "backward's gradient reduction is issued, as an optimizer step in the backward "
                "would allow; flexdemo's replicators post it after the optimizer step, so `run` "
                "does not train this schedule"]
    return [f"outer sync of {', '.join(syncing)}: posted after the optimizer step, as the "
            "replicator does (sync_in_backward=true starts it unit by unit in the backward)"]


def _profiled(args: argparse.Namespace, unit_params: list[int], optimizer_s: float | None):
    """Compute per step from a profile-compute file, refused for another model or shape."""
    profile = load_profile(args.compute_profile)
    if profile.workload != args.model:
        raise ConfigError(f"--compute-profile {args.compute_profile} was measured on workload "
                          f"{profile.workload!r}, not on --model {args.model!r}; profile the "
                          "model you plan.")
    if profile.gpus_per_node != args.gpus_per_node:
        raise ConfigError(f"--compute-profile {args.compute_profile} was measured at "
                          f"{profile.gpus_per_node} GPUs per node, not --gpus-per-node "
                          f"{args.gpus_per_node}; profile at the planned shape.")
    if optimizer_s is not None:
        raise ConfigError("--set optimizer_s and --compute-profile both give the optimizer "
                          "step's seconds; give one.")
    fb, opt = profile.phase_seconds
    compute = given_compute(unit_params, fb, opt)
    rule = compute.rule.replace(f"{fb:g} s per step as given (--step-compute)",
                                f"{fb:g} s forward+backward per step measured for "
                                f"{profile.method} ({profile.describe()})")
    return dataclasses.replace(compute, rule=rule)


def _seconds(given: object) -> float:
    try:
        value = float(given) if not isinstance(given, bool) else -1.0
    except (TypeError, ValueError):
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"optimizer_s={given!r} must be seconds >= 0.")
    return value


def _needed_table(plans: list[MethodPlan], frame: pd.DataFrame) -> pd.DataFrame:
    """Per method and CU target: the bandwidth needed, and whether a grid point or interpolated."""
    rows = []
    for p in plans:
        mine = frame[frame["method"] == p.method]
        for target in CU_TARGETS:
            bps, how = bandwidth_needed(mine, target)
            rows.append({"method": p.method, "target_cu": target, "inter_bw_bps": bps,
                         "inter_bw": None if bps is None else format_bandwidth(bps),
                         "how": how})
    return pd.DataFrame(rows)


def _network(args: argparse.Namespace) -> tuple[list[Topology], list[str], str]:
    """The target topologies (one per bandwidth, or the site file's), their labels, in words."""
    if args.topology is not None:
        sites = load_site_file(args.topology)
        if sites.nodes != args.nodes:
            raise ConfigError(f"--topology {args.topology} holds {sites.nodes} nodes but --nodes "
                              f"is {args.nodes}; give --nodes {sites.nodes}.")
        intra = Link(parse_bandwidth(args.intra_bw), parse_latency(args.intra_lat))
        topology = Topology.on_sites(sites, args.gpus_per_node, intra)
        return [topology], [f"sites:{Path(args.topology).name}"], (
            f"inter-node: the sites of {args.topology} ({hierarchy_line(sites)})")
    rates = parse_bandwidths(args.inter_bw)
    latency = parse_latency(args.inter_lat)
    topologies = [Topology.from_strings(args.nodes, args.gpus_per_node, r, latency,
                                        args.intra_bw, args.intra_lat) for r in rates]
    return topologies, [format_bandwidth(r) for r in rates], (
        f"inter-node: {len(rates)} bandwidth(s), {latency * 1e3:g} ms a message (declared)")


def _assumptions(args: argparse.Namespace, model, compute, precision: Precision, network: str,
                 memory_source: str, plans: list[MethodPlan], settings: dict,
                 source: StepsSource | None = None, in_backward: bool = False) -> list[str]:
    """Every assumption behind the figures, one line each."""
    lines = [model.describe() + "; FSDP2 units as flexdemo.parallelize wraps it",
             f"cluster: {args.nodes} nodes x {args.gpus_per_node} GPUs; the program is "
             f"synthesized for {min(args.nodes // args.nodes_per_replica, 2)} replica(s) and "
             "replayed with replicate groups spanning every replica",
             replica_line(args.nodes_per_replica, args.nodes, args.gpus_per_node,
                          args.topology is not None),
             compute.rule,
             precision.describe(),
             f"intra-node: {args.intra_bw}, {args.intra_lat} a message (declared); {network}; "
             f"algorithm {args.algorithm}",
             "FSDP2 prefetch: each unit's all-gather overlaps the previous unit's compute "
             "(forward and backward), one all-gather at a time; "
             + ("the communication is declared, not measured"
                if args.compute_profile or args.compute_from else
                "nothing is measured, everything is declared"),
             f"memory per GPU: master params, grads (fp32 shards), optimizer and replicator "
             f"state, FSDP2's gathered working set; activations not counted; GPU memory "
             f"{memory_source}"]
    lines += [MISSING] if source is None else [source.line(p.method) for p in plans]
    lines += _sync_lines(plans, in_backward)
    for p in plans:
        knob = settings[p.method]
        knob_text = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(knob).items())
        period = (f"; utilization over a period of {p.period} steps, "
                  f"{p.exchanges_per_period} with the exchange" if p.period > 1 else "")
        if method_record(p.method).replicator is None:  # hsdp-adamw: FSDP2's, or the reduce's
            how = ("FSDP2 all-reduce across nodes" if wired(method_record(p.method), knob)
                   .replicator is None else "the reduce replicator's after the backward, in "
                   "place of FSDP2's all-reduce across nodes")
            knob_text = f"{knob_text} ({how})".lstrip()
        lines.append(f"{p.method}: {knob_text or 'no knobs; nothing crosses nodes'}{period}")
    seen: set[str] = set()
    for p in plans:  # each method's replay notes; the ones every method shares, once
        for note in p.notes:
            line = f"{p.method}: {note}" if note.startswith("inter-node algorithm") else note
            if line not in seen:
                seen.add(line)
                lines.append(line)
    return lines


def _print(args: argparse.Namespace, frame: pd.DataFrame, needed: pd.DataFrame,
           plans: list[MethodPlan], assumptions: list[str], cap: float | None) -> None:
    """The figures, then the bandwidth-needed table, then the assumptions."""
    out = sys.stdout
    print(f"plan: {args.model} on {args.nodes} x {args.gpus_per_node}, "
          f"{plans[0].compute_s:.4g} s compute per step", file=out)
    show = frame.assign(
        step_time_s=frame["step_time_s"].map(lambda v: f"{v:.4g}"),
        compute_utilization=frame["compute_utilization"].map(lambda v: f"{v:.1%}"),
        exposed_comm_s=frame["exposed_comm_s"].map(lambda v: f"{v:.4g}"),
        bytes_per_node_step=frame["bytes_per_node_step"].map(lambda v: f"{v / 1e9:.4g} GB"),
        memory_per_gpu=[f"{v / 1e9:.4g} GB" + (" OVER" if over else "")
                        for v, over in zip(frame["memory_per_gpu_bytes"], frame["memory_over"],
                                           strict=True)],
    )[["method", "inter_bw", "step_time_s", "compute_utilization", "exposed_comm_s",
       "bytes_per_node_step", "memory_per_gpu"]]
    if "time_to_target_s" in frame.columns:
        show["time_to_target"] = frame["time_to_target_s"].map(
            lambda v: "-" if v != v else f"{v:.4g} s")
    print(show.to_string(index=False), file=out)
    print("\nmemory per GPU by part:", file=out)
    for p in plans:
        m = p.memory
        over = f" (above the GPU's {cap / 1e9:.4g} GB)" if cap is not None and m.total > cap else ""
        print(f"  {p.method}: params {m.params / 1e9:.4g} GB, grads {m.grads / 1e9:.4g} GB, "
              f"optimizer {m.optimizer / 1e9:.4g} GB, replicator {m.replicator / 1e9:.4g} GB, "
              f"FSDP2 working set {m.working / 1e9:.4g} GB = {m.total / 1e9:.4g} GB{over}",
              file=out)
    if needed.empty:
        print("\nbandwidth needed: not asked (one network, the site file's, no bandwidth grid)",
              file=out)
    else:
        _print_needed(needed, plans)
    print("\nassumptions:", file=out)
    for line in assumptions:
        print(f"  {line}", file=out)


def _print_needed(needed: pd.DataFrame, plans: list[MethodPlan]) -> None:
    """The table of the bandwidth each method needs per target utilization, and how found."""
    out = sys.stdout
    print("\nbandwidth needed for a compute utilization of:", file=out)
    table = needed.assign(target_cu=needed["target_cu"].map(lambda v: f"{v:.0%}"),
                          inter_bw=needed["inter_bw"].fillna("-"))
    wide = table.pivot(index="method", columns="target_cu", values="inter_bw")
    how = table.pivot(index="method", columns="target_cu", values="how")
    cells = wide.astype(str) + " (" + how.astype(str) + ")"
    cells = cells.where(wide != "-", how)
    print(cells.loc[[p.method for p in plans]].to_string(), file=out)


def _write(path: Path, frame: pd.DataFrame, needed: pd.DataFrame, assumptions: list[str]) -> None:
    """The CSV rows, the JSON (rows, bandwidth needed, assumptions) or the figure; atomically."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        data: bytes | str = frame.to_csv(index=False)
    elif suffix == ".json":
        doc = {"rows": frame.to_dict(orient="records"),
               "bandwidth_needed": needed.to_dict(orient="records"),
               "assumptions": assumptions}
        data = json.dumps(doc, indent=2, default=float) + "\n"
    else:
        buf = io.BytesIO()
        _figure(frame, buf)
        data = buf.getvalue()
    write_atomic(path, data)


def _figure(frame: pd.DataFrame, path: io.BytesIO) -> None:
    """Compute utilization against inter-node bandwidth, log x, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, rows in frame.groupby("method", sort=False):
        rows = rows.sort_values("inter_bw_bps")
        ax.plot(rows["inter_bw_bps"] * 8 / 1e9, rows["compute_utilization"], marker="o",
                markersize=3, label=method)
    ax.set_xscale("log")
    ax.set_xlabel("inter-node bandwidth (Gbit/s)")
    ax.set_ylabel("compute utilization")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
