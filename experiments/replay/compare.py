"""`flexbench compare`: which method reaches the target first on one network, by how much, how sure.

    flexbench compare results/quick --inter-bw 200Mbit --inter-lat 30ms
    flexbench compare runs/flex-s0 runs/flex-s1 runs/hsdp-s0 runs/hsdp-s1 --inter-bw 1Gbit \\
        --inter-lat 20ms --nodes 16 --gpus-per-node 8 --compute-profile h100.json \\
        --loss-scaling linear-to-critical-batch:512 --target 2.7 --out cmp.json --out cmp.csv

Every recorded run (or every training unit of a sweep folder) is replayed on the one network and
cluster a `ReplayTarget` describes (`flexbench simulate`'s flags, `experiments.replay.flags`),
with the one replay (`experiments.replay.engine.replay`);
each run's loss curve on its replayed time axis gives its time to target. Runs of one method are
its seeds; methods are ranked by their median time to target with a bracket over seeds
(`experiments.scoring.intervals`: a bootstrap interval from 3 seeds, the range with 2), speed-ups
are paired by seed against hsdp-adamw, and the verdict between the first two says "tie" where
their brackets do not separate them. Every assumption a replay printed is printed once below the
table.

The target: --target; else a sweep folder's own target; else derived from the hsdp-adamw runs
given by the sweeps' default rule (their median final val_loss + 2%), and the output says which.
The compute basis, printed beside the table: by default each run replays its own recorded
compute, so machine load while one unit trained enters its time. `--same-compute method` replays
every seed of a method at that method's median recorded compute per step over its seeds;
`--same-compute all` replays every run at one compute per step (the median over all runs: the
network alone decides, the methods' own compute differences are dropped too). The recorded
compute is scaled uniformly (its intra-node collectives stay as recorded). A declared
--compute-profile or --step-compute already puts every run on one basis.

Several --nodes or --inter-bw make a map over their cells instead (`node_map`, each cell this
module's `rank`); the command's flags and printing are in `compare_cli`. What a comparison asks
beside the target (its runs, the target loss, --step-noise, --loss-from) is a `Question`.

`--loss-from RUN` (repeatable) adds loss curves, as `simulate --loss-from` does: each goes with
the compared run of its variant and seed, which then takes the curve, its own included, whose
global batch is nearest the target's. An emulated run at the target node count is such a curve:
it lifts gossip's refusal there, and for the other methods it replaces the loss rule.

A run that diverged (run.json status "diverged") is a miss: its time to target is inf, as in a
sweep's table, and the output names it. Refused (one sentence, exit 2, nothing written): bad
network or flag values, runs of different workloads, runs recorded on different cluster shapes
without --nodes and --gpus-per-node to put them on one, two runs of the same method and seed, a
folder that is neither a run nor a sweep, and a loss curve that cannot be carried to the target
shape (gossip at a node count no recording has), a --loss-from run that no compared run shares
a variant and seed with.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from experiments.config import METHODS, RunConfig, is_plugin, shared_for
from experiments.errors import ConfigError
from experiments.logs import progress
from experiments.replay.engine import replay
from experiments.replay.loss_curve import Recording, check_loss_from, choose_loss_curve
from experiments.replay.recordings import RecordedRun, read_loss_run, read_run
from experiments.replay.target import ReplayTarget
from experiments.run_record import RunRecord
from experiments.scoring import formats, intervals, ranking, speedups, step_noise, targets
from experiments.scoring.variants import variant_label

__all__ = ["Candidate", "Comparison", "Inputs", "LossCurveRefused", "NothingToRank", "Question",
           "Scored", "compare", "compute_basis", "find_candidates", "gather", "json_rows",
           "json_value", "rank", "record", "score", "table_text"]

OUT_SUFFIXES = (".json", ".csv")
AS_RECORDED = ("compute, intra-node collectives, payloads and their order as recorded (the "
               "recording machine); only the inter-node links are modeled")
ON_BASIS = ("intra-node collectives, payloads and their order as recorded, compute on the "
            "basis above; only the inter-node links are modeled")
LOSS_AS_RECORDED = "loss curve: each run's own per step, at its recorded cluster shape and batch"
COMPUTE_SPREAD = 0.20
"""Recorded computes per step further apart than this (largest / smallest - 1) are warned of
when each run replays its own: the machine's load, not the method, may then decide."""

log = logging.getLogger(__name__)


class LossCurveRefused(Exception):
    """A run whose loss curve cannot be carried to the target's shape: no time to target."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"no time to target for {str(path)!r}: {reason}")
        self.reason = reason


class NothingToRank(ConfigError):
    """Every method was left out (`rank`'s left_out): no ranking on this network."""


@dataclass(frozen=True)
class Candidate:
    """One recorded run to replay: where it is, its variant (method[knobs]) and seed."""

    path: Path
    variant: str
    method: str
    seed: int
    status: str = "done"
    """A sweep unit's status: anything but done (failed, never run) is a miss, not replayed."""


@dataclass(frozen=True)
class Question:
    """What a comparison asks beside the target it replays on: runs, target loss, rules."""

    runs: tuple[Path, ...]
    """Run folders (`flexbench run`) or sweep folders (every training unit)."""
    target_loss: float | None = None
    """--target: the validation loss to reach (None: a sweep's own, else the default rule)."""
    step_noise: bool = False
    """--step-noise: widen each bracket by the runs' recorded step-time variation."""
    loss_from: tuple[Path, ...] = ()
    """--loss-from: more loss curves of the compared runs' variants and seeds."""

    def __post_init__(self) -> None:
        if self.target_loss is not None and not (math.isfinite(self.target_loss)
                                                 and self.target_loss > 0):
            raise ConfigError(f"--target must be a finite loss > 0, got {self.target_loss}.")


@dataclass(frozen=True)
class Comparison:
    """A comparison's result: per-run times, the ranked table, the sentence and the assumptions."""

    network: str
    target: float
    target_rule: str
    runs: pd.DataFrame
    """One row per replayed run: variant, method, seed, time_to_target_s, reached, diverged."""
    table: pd.DataFrame
    """`speedups.speedups` of `runs`, ranked fastest first (a miss last)."""
    first: pd.Series
    """`ranking.winners` of `runs`: first, runner-up, margin, verdict."""
    sentence: str
    assumptions: list[str]
    compute_basis: str
    """Which compute the replayed times use (each run's own, a method's median, one for all)."""


def find_candidates(paths: list[Path]) -> tuple[list[Candidate], float | None]:
    """The runs in `paths` (run folders, or sweep folders' training units) and a sweep's target.

    ConfigError for a folder that is neither a run (run.json) nor a sweep (runs.parquet), or
    for two runs of the same variant and seed.
    """
    found: list[Candidate] = []
    targets: list[float] = []
    for path in paths:
        if (path / "runs.parquet").is_file():
            units, target = _sweep_units(path)
            found += units
            targets += [] if target is None else [target]
        elif (path / "run.json").is_file():
            found.append(_run_candidate(path))
        else:
            raise ConfigError(f"{str(path)!r} is neither a run folder (run.json) nor a sweep "
                              "folder (runs.parquet); give folders written by `flexbench run` "
                              "or `flexbench sweep`.")
    # The true reason first: runs of two workloads are not one method's seeds, whatever their
    # labels, and runs of one label trained otherwise are not one variant.
    _check_one_workload(found)
    _check_one_setting_per_variant(found)
    seen: dict[tuple[str, int], Path] = {}
    for c in found:
        if (c.variant, c.seed) in seen:
            raise ConfigError(f"{str(seen[c.variant, c.seed])!r} and {str(c.path)!r} are both "
                              f"{c.variant} seed {c.seed}; give each method and seed once.")
        seen[c.variant, c.seed] = c.path
    if len(set(targets)) > 1:
        raise ConfigError(f"the sweeps given score against different targets "
                          f"({', '.join(f'{t:.4f}' for t in dict.fromkeys(targets))}); give "
                          "--target.")
    return found, targets[0] if targets else None


def _stored_config(path: Path) -> dict[str, Any] | None:
    """A run folder's recorded config, or None for a failed unit or a broken record (read_run
    says so with its own sentence)."""
    try:
        return RunRecord.load(path).config
    except ConfigError:
        return None


def _check_one_workload(found: list[Candidate]) -> None:
    """ConfigError naming two runs of different workloads (before any other refusal)."""
    first: tuple[Path, str] | None = None
    for c in found:
        config = _stored_config(c.path)
        if config is None:
            continue
        workload = str(config.get("workload", RunConfig.workload))
        if first is None:
            first = (c.path, workload)
        elif workload != first[1]:
            raise ConfigError(f"{str(first[0])!r} trains workload {first[1]!r} and {str(c.path)!r} "
                              f"workload {workload!r}: compare runs of one workload.")


TRAINING_SETTINGS = ("lr", "schedule", "warmup", "warmup_steps", "batch_size", "weight_decay")
"""Run settings that change a run's loss curve beside its method's knobs: a variant's seeds
must share them, or their spread would be the settings' and not the seeds'."""
# Read by the warmup and cosine schedules only: under constant they change nothing.
_WARMUP_SETTINGS = ("warmup", "warmup_steps")


def _check_one_setting_per_variant(found: list[Candidate]) -> None:
    """ConfigError when two runs labelled as one variant trained with other TRAINING_SETTINGS."""
    first: dict[str, tuple[Path, dict[str, Any]]] = {}
    for c in found:
        config = _stored_config(c.path)
        if config is None:
            continue
        defaults = RunConfig(method=c.method)
        settings = {k: config.get(k, getattr(defaults, k)) for k in TRAINING_SETTINGS}
        settings["lr"] = settings["lr"] or defaults.record.lr  # None: the method's own lr
        if c.variant not in first:
            first[c.variant] = (c.path, settings)
            continue
        path, seen = first[c.variant]
        differ = [k for k in TRAINING_SETTINGS if settings[k] != seen[k]
                  and not (k in _WARMUP_SETTINGS and settings["schedule"] == seen["schedule"]
                           == "constant")]
        if differ:
            k = differ[0]
            raise ConfigError(f"{str(path)!r} and {str(c.path)!r} are both {c.variant} but train "
                              f"with {k} {seen[k]!r} and {settings[k]!r}: their spread would be "
                              "the setting's, not the seeds'; compare runs of one setting.")


def _sweep_units(path: Path) -> tuple[list[Candidate], float | None]:
    """A sweep's training units (failed ones too: a miss is never dropped) and its one target."""
    runs = pd.read_parquet(path / "runs.parquet")
    train = runs[runs["kind"] == "train"].drop_duplicates("unit")
    units = [Candidate(path / "units" / str(u), str(v), str(m), int(s), str(st))
             for u, v, m, s, st in zip(train["unit"], train["variant"], train["method"],
                                       train["seed"], train["status"], strict=True)]
    values = list(dict.fromkeys(runs["target_val_loss"].dropna()))
    if len(values) > 1:
        raise ConfigError(f"{str(path)!r} scores its clusters against different targets; give "
                          "--target.")
    return units, (float(values[0]) if values else None)


def _run_candidate(path: Path) -> Candidate:
    """A run folder as a candidate: its variant is its method labelled with the knobs it set
    away from the method's defaults, as a sweep labels its variants (`flexdemo[decay=0.9]`);
    its config's seed is its seed."""
    record = RunRecord.load(path)
    try:
        method, seed = str(record.config["method"]), record.seed
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{str(path / 'run.json')!r} is not a run's record (no config with a "
                          "method).") from None
    try:
        return Candidate(path, _variant(record.config, method), method, seed)
    except ConfigError as err:  # among several runs, which one
        raise ConfigError(f"{str(path / 'run.json')!r}: {err}") from None


def _variant(config: dict, method: str) -> str:
    """`method[knob=value,...]` for the knobs whose values differ from the method's defaults."""
    if method not in METHODS and not is_plugin(method):
        return method  # read_run refuses it with its own sentence
    # Stored configs hold resolved knob values (older ones None where a knob came later); a
    # config relabelled with another method keeps knobs that method does not read.
    stored = RunConfig.from_dict(shared_for(method, config)).check_numbers().knob_values()
    defaults = RunConfig(method=method).knob_values()
    # A None default is decided when the optimizer is built (sign, value_dtype): not comparable.
    return variant_label(method, {k: v for k, v in stored.items()
                                  if defaults.get(k) is not None and v != defaults[k]})


def _check_same_training(runs: list[tuple[Candidate, RecordedRun]],
                         target: ReplayTarget) -> None:
    """One workload, and one recorded cluster shape unless the flags set the target's."""
    workloads = {r.config.workload for _, r in runs}
    if len(workloads) > 1:
        raise ConfigError(f"the runs train different workloads ({', '.join(sorted(workloads))}); "
                          "compare runs of one workload.")
    shapes = {(r.config.nodes, r.config.gpus_per_node) for _, r in runs}
    if len(shapes) > 1 and (target.nodes is None or target.gpus_per_node is None):
        listed = ", ".join(f"{n}x{g}" for n, g in sorted(shapes))
        raise ConfigError(f"the runs were recorded on different clusters ({listed}); give "
                          "--nodes and --gpus-per-node to replay them on one.")


def _target(given: float | None, sweep_target: float | None,
            runs: list[tuple[Candidate, RecordedRun]]) -> tuple[float, str]:
    """The target val_loss and a sentence saying where it came from (ConfigError if none)."""
    if given is not None:
        return float(given), "given (--target)"
    if sweep_target is not None:
        return sweep_target, "the sweep's own target (runs.parquet)"
    finals = pd.DataFrame(
        [{"method": c.method, "final_val_loss": r.meta.get("final_val_loss")}
         for c, r in runs if r.meta.get("status", "done") != "diverged"],
        columns=["method", "final_val_loss"]).astype({"final_val_loss": float})
    try:
        target = targets.default_target(finals)
    except ValueError:
        baseline = [str(c.path) for c, _ in runs if c.method == targets.BASELINE]
        if baseline:  # there, but diverged or with a run.json that holds no final val_loss
            raise ConfigError(f"no --target, and no {targets.BASELINE} run records a final "
                              f"val_loss to derive one from ({', '.join(baseline)}); give "
                              "--target.") from None
        raise ConfigError(f"no --target and no {targets.BASELINE} run to derive one from; give "
                          f"--target or a {targets.BASELINE} run.") from None
    count = int((finals["method"] == targets.BASELINE).sum())
    return target, (f"derived: {targets.BASELINE}'s median final val_loss over its {count} "
                    f"run(s) + {targets.TARGET_MARGIN:.0%} (the sweeps' default rule)")


def _grouped(notes: dict[str, list[str]]) -> list[str]:
    """The replay's notes: those every method shares once, then each method's own under it."""
    common = [n for n in next(iter(notes.values()), []) if all(n in v for v in notes.values())]
    lines = list(dict.fromkeys(common))
    for variant, own in notes.items():
        rest = [n for n in dict.fromkeys(own) if n not in common]
        if rest:
            lines += [f"{variant} (its first run; the other seeds' replays alike):",
                      *(f"  {n}" for n in rest)]
    return lines


def _recorded_compute(run: RecordedRun) -> float:
    """A run's median recorded compute per step (outside inter-node calls), seconds."""
    return float(run.steps["compute_s"].median())


def compute_basis(target: ReplayTarget,
                  runs: list[tuple[Candidate, RecordedRun]]) -> tuple[dict[str, float], str]:
    """Per variant, the compute per step its runs replay at ({}: each run's own), and the basis.

    Diverged runs are misses, never replayed: their compute does not enter a median.
    """
    replayed = [(c, r) for c, r in runs if r.meta.get("status", "done") != "diverged"]
    compute = target.compute
    if compute.same is None:
        if compute.profile is None and compute.step_s is None:
            _warn_compute_spread(replayed)
        return {}, _declared_basis(target)
    for c, r in replayed:
        if not _recorded_compute(r) > 0:  # nothing to rescale: a basis would divide by zero
            raise ConfigError(f"{str(c.path)!r} records no compute per step (median compute_s "
                              f"{_recorded_compute(r)}); --same-compute cannot rescale it.")
    scaled = f", x{compute.scale:.4g} (declared)" if compute.scale else ""
    if compute.same == "all":
        value = float(pd.Series([_recorded_compute(r) for _, r in replayed]).median())
        return ({c.variant: value for c, _ in replayed},
                f"compute basis: one compute per step for every run, {value:.4g} s (the median "
                f"over all {len(replayed)} runs' recorded medians){scaled}: the network alone "
                "decides, the methods' own compute differences dropped too; intra-node "
                "collectives as recorded")
    per: dict[str, list[float]] = {}
    for c, r in replayed:
        per.setdefault(c.variant, []).append(_recorded_compute(r))
    values = {v: float(pd.Series(x).median()) for v, x in per.items()}
    listed = ", ".join(f"{v} {x:.4g} s" for v, x in values.items())
    return values, (f"compute basis: each method's median recorded compute per step over its "
                    f"seeds ({listed}){scaled}, every seed replayed at it; intra-node "
                    "collectives as recorded")


def _warn_compute_spread(replayed: list[tuple[Candidate, RecordedRun]]) -> None:
    """One warning line when the runs' recorded computes differ by more than COMPUTE_SPREAD."""
    medians = {c.path.name: _recorded_compute(r) for c, r in replayed}
    medians = {k: v for k, v in medians.items() if math.isfinite(v) and v > 0}
    if len(medians) < 2:
        return
    low, high = min(medians, key=medians.get), max(medians, key=medians.get)
    spread = medians[high] / medians[low] - 1
    if spread > COMPUTE_SPREAD:
        log.warning("the runs' recorded compute per step differs by %.0f%% (%s %.4g s, %s %.4g "
                    "s) and each run replays its own, so machine load enters the ranking; "
                    "--same-compute method or all puts them on one basis", spread * 100, low,
                    medians[low], high, medians[high])


def _declared_basis(target: ReplayTarget) -> str:
    """The basis sentence without --same-compute: each run's own compute, or a declared one."""
    compute = target.compute
    if compute.profile is not None:
        return f"compute basis: the declared profile {compute.profile_file}, every run alike"
    if compute.step_s is not None:
        return f"compute basis: declared {compute.step_s:.4g} s per step, every run alike"
    scaled = f" x{compute.scale:.4g} (declared; " if compute.scale else " ("
    return ("compute basis: each run's own recorded compute" + scaled + "the machine's load "
            "while it trained included; --same-compute puts the methods on one)")


def _check_step_noise(question: Question, target: ReplayTarget,
                      runs: list[tuple[Candidate, RecordedRun]]) -> None:
    """ConfigError where --step-noise has no recorded compute per step to resample."""
    if not question.step_noise:
        return
    if target.compute.profile is not None:
        raise ConfigError("--step-noise resamples the recorded compute per step, and "
                          "--compute-profile replaces it phase by phase; give one of the two.")
    for c, r in runs:
        values = r.steps["compute_s"] if "compute_s" in r.steps else pd.Series(dtype=float)
        if r.meta.get("status", "done") != "diverged" and not (
                len(values) and np.isfinite(values).all() and (values >= 0).all()):
            raise ConfigError(f"{str(c.path)!r} has no finite compute per step in its "
                              "steps.parquet (compute_s); --step-noise cannot resample it.")


@dataclass(frozen=True)
class Inputs:
    """What every network a comparison replays on shares: the runs, target and compute basis."""

    candidates: list[Candidate]
    runs: list[tuple[Candidate, RecordedRun]]
    """The finished candidates, read once."""
    target: float
    target_rule: str
    bases: dict[str, float]
    """`compute_basis`'s per-variant compute per step ({}: each run's own)."""
    basis_text: str
    loss_from: dict[tuple[str, int], tuple[Recording, ...]]
    """--loss-from's curves by the (variant, seed) of the compared run they go with."""
    step_noise: bool = False
    """Whether each run's times to target are resampled over its recorded step times."""

    def curves_for(self, c: Candidate) -> tuple[Recording, ...]:
        """The --loss-from curves of c's variant and seed."""
        return self.loss_from.get((c.variant, c.seed), ())


def gather(question: Question, target: ReplayTarget) -> Inputs:
    """Read and check the runs `question` names, their target and compute basis (ConfigError)."""
    candidates, sweep_target = find_candidates(list(question.runs))
    runs = [(c, read_run(c.path)) for c in candidates if c.status == "done"]
    _check_same_training(runs, target)
    _check_step_noise(question, target, runs)
    loss, rule = _target(question.target_loss, sweep_target, runs)
    bases, basis_text = compute_basis(target, runs)
    return Inputs(candidates, runs, loss, rule, bases, basis_text,
                  _loss_curves(question.loss_from, candidates), question.step_noise)


def _loss_curves(paths: tuple[Path, ...], candidates: list[Candidate],
                 ) -> dict[tuple[str, int], tuple[Recording, ...]]:
    """--loss-from's runs, each under the (variant, seed) of the compared run it goes with.

    ConfigError, one sentence, for a run no compared run shares a variant and seed with: its
    curve would be used by no one, and a typo should not pass for a rule-free answer."""
    check_loss_from(paths, [c.path for c in candidates])
    compared = {(c.variant, c.seed) for c in candidates}
    found: dict[tuple[str, int], list[Recording]] = {}
    for path in map(Path, paths):
        c = _run_candidate(path)
        if (c.variant, c.seed) not in compared:
            raise ConfigError(f"--loss-from {str(path)!r} is {c.variant} seed {c.seed}, and no "
                              "compared run is; a loss curve goes with the compared run of the "
                              "same method, knobs and seed.")
        run = read_loss_run(path)
        found.setdefault((c.variant, c.seed), []).append(
            Recording.of(run.path, run.config, run.meta, run.steps))
    return {key: tuple(recs) for key, recs in found.items()}


def compare(question: Question, target: ReplayTarget) -> Comparison:
    """Replay every run of `question` on `target` and rank the methods (ConfigError if refused)."""
    return rank(target, gather(question, target))


def rank(target: ReplayTarget, given: Inputs, *,
         left_out: dict[str, str] | None = None, bar: tqdm | None = None) -> Comparison:
    """Every run of `given` replayed on `target`, the methods ranked.

    A run whose loss curve cannot be carried to the target's shape (gossip at a node count no
    recording has) is refused with a ConfigError; with `left_out` its method is left out of
    the ranking instead, and `left_out[variant]` says why. `bar`: a progress bar counting
    replayed runs across several calls (a map's cells); else each call shows its own.
    """
    network = (f"the sites of {target.topology}" if target.topology is not None
               else f"{target.inter_bw} / {target.inter_lat or '0ms'}")
    skipped = {} if left_out is None else left_out
    frame, notes = _replayed(target, given, network, skipped if left_out is not None else None,
                             bar)
    if frame.empty:
        raise NothingToRank(f"no method can be timed on {network}: "
                            + "; ".join(f"{v}: {why}" for v, why in skipped.items()))
    if not given.step_noise:  # brackets over seeds alone
        frame = frame.drop(columns=intervals.SAMPLES_COLUMN)
    table = speedups.speedups(frame, by=("network",))
    order = intervals.ranked({v: intervals.Interval(m, m, m, 1, "single")
                              for v, m in zip(table["variant"], table["ttt_median_s"],
                                              strict=True)})
    table = table.set_index("variant").loc[order].reset_index()
    first = ranking.winners(frame).iloc[0]
    kinds = set(table["ttt_interval"]) | set(table["speedup_interval"])
    assumptions = [f"target val_loss {given.target:.4f}: {given.target_rule}",
                   *_grouped(notes), intervals.interval_note(kinds),
                   step_noise.note() if given.step_noise else ""]
    frame = frame.drop(columns=intervals.SAMPLES_COLUMN, errors="ignore")
    return Comparison(network, given.target, given.target_rule, frame, table, first,
                      _sentence(table, first), [a for a in assumptions if a], given.basis_text)


def _replayed(target: ReplayTarget, given: Inputs, network: str,
              left_out: dict[str, str] | None, bar: tqdm | None = None,
              ) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """One row per run timed on the network (with its resampled times), and each method's
    replay notes; a method whose loss curve is refused goes into `left_out` (if given)."""
    notes: dict[str, list[str]] = {}
    rows = []
    unfinished = [(c, None) for c in given.candidates if c.status != "done"]
    todo = [*given.runs, *unfinished]
    with nullcontext(bar) if bar is not None else progress(
            total=len(todo), desc="compare", unit="run") as counted:
        for c, run in todo:
            counted.update(1)
            row = _replayed_row(target, given, network, left_out, notes, c, run)
            if row is not None:
                rows.append(row)
    frame = pd.DataFrame(rows, columns=["variant", "method", "seed", "network",
                                        "time_to_target_s", "reached", "run",
                                        intervals.SAMPLES_COLUMN])
    dropped = set(left_out or ())  # a method refused on one seed is not half-ranked
    return (frame[~frame["variant"].isin(dropped)],
            {v: n for v, n in notes.items() if v not in dropped})


def _replayed_row(target: ReplayTarget, given: Inputs, network: str,
                  left_out: dict[str, str] | None, notes: dict[str, list[str]], c: Candidate,
                  run: RecordedRun | None) -> dict[str, Any] | None:
    """`_replayed`'s row of one candidate (None: its method left out), its notes added."""
    if left_out is not None and c.variant in left_out:
        return None
    first_of_variant = c.variant not in notes
    mine = notes.setdefault(c.variant, [])
    try:
        scored = score(target, given, c, run)
    except LossCurveRefused as refused:
        if left_out is None:
            raise ConfigError(str(refused)) from None
        left_out[c.variant] = refused.reason
        return None
    # The replay's rules are the same for every seed of a method: its first run's shown.
    mine += [*(scored.notes if first_of_variant else ()), *scored.misses]
    return {"variant": c.variant, "method": c.method, "seed": c.seed, "network": network,
            "time_to_target_s": scored.time_to_target_s,
            "reached": math.isfinite(scored.time_to_target_s), "run": str(c.path),
            intervals.SAMPLES_COLUMN: scored.samples}


@dataclass(frozen=True)
class Scored:
    """One candidate on one network: its time to target, step-time resamples and time axis."""

    time_to_target_s: float
    samples: np.ndarray
    """Its times to target over resampled compute (--step-noise), else its own time in each."""
    axis: pd.DataFrame | None
    """The replayed time axis (step, step_time_s, time_s); None for a miss never replayed."""
    notes: tuple[str, ...] = ()
    """What its replay stood on: the compute basis, graphs, loss curve and the model's note."""
    misses: tuple[str, ...] = ()
    """Why it is a miss without a replay (failed in the sweep, diverged), if it is."""


def score(target: ReplayTarget, given: Inputs, c: Candidate, run: RecordedRun | None, *,
          noise: bool | None = None) -> Scored:
    """One candidate replayed on `target` (a failed or diverged one: a miss, inf), with its
    --loss-from curves; `noise` (default: `given.step_noise`) resamples its compute per step."""
    miss = np.full(step_noise.RESAMPLES, math.inf)
    if run is None:  # a sweep unit that failed or never ran: a miss, as in the sweep's table
        return Scored(math.inf, miss, None,
                      misses=(f"{c.path.name}: {c.status} in the sweep: counted as a miss (inf)",))
    if run.meta.get("status") == "diverged":  # as a sweep scores it: never reached
        return Scored(math.inf, miss, None,
                      misses=(f"{c.path.name} diverged (run.json status): counted as a miss "
                              "(inf)",))
    noise = given.step_noise if noise is None else noise
    return _time_to_target(target, run, given.target, given.bases.get(c.variant),
                           given.curves_for(c), noise)


def _time_to_target(target: ReplayTarget, run: RecordedRun, loss: float,
                    compute_s: float | None, loss_from: tuple[Recording, ...],
                    noise: bool) -> Scored:
    """One run replayed on `target`: its time to target (inf for a miss), with `noise` its
    times to target over resampled compute (`step_noise`), and the replayed time axis (step,
    step_time_s, time_s). `loss_from`: more curves of the run's variant and seed
    (--loss-from), the one nearest the target's global batch is used."""
    curve = choose_loss_curve(
        [Recording.of(run.path, run.config, run.meta, run.steps), *loss_from],
        nodes=target.nodes or run.config.nodes,
        gpus_per_node=target.gpus_per_node or run.config.gpus_per_node, rule=target.loss_rule)
    if curve.refusal is not None:
        raise LossCurveRefused(run.path, curve.refusal)
    replayed = replay(run, target, steps=curve.steps_needed(), compute_s=compute_s)
    notes = [*(replayed.basis or [AS_RECORDED if compute_s is None else ON_BASIS]),
             *replayed.graphs, curve.summary() if curve.stated else LOSS_AS_RECORDED]
    notes += [f"model: {replayed.note}"] if replayed.note else []
    points = curve.on_time_axis(replayed.frame)
    ttt = targets.time_to_target(points["time_s"], points["val_loss"], loss)
    if not noise:
        return Scored(ttt, np.full(step_noise.RESAMPLES, ttt), replayed.frame,
                      tuple(notes))
    recorded = run.steps.sort_values("step")["compute_s"].to_numpy(dtype=float)
    scale = target.compute.scale_of(run.steps)
    if compute_s is not None:
        scale *= compute_s / _recorded_compute(run)
    samples = step_noise.time_to_target_samples(replayed.frame, points, loss, recorded,
                                                       scale, name=run.path.name)
    return Scored(ttt, samples, replayed.frame, tuple(notes))


def _sentence(table: pd.DataFrame, first: pd.Series) -> str:
    """'flexdemo first, 3.10× [2.60–3.70] ahead of hsdp-adamw; diloco within its interval'."""
    rows = table.set_index("variant")
    lead = str(first["first"])
    if math.isinf(rows.loc[lead, "ttt_median_s"]):
        return "no method reaches the target on this network (median over seeds)."
    text = f"{lead} first"
    base = rows[rows["method"] == targets.BASELINE]
    if rows.loc[lead, "method"] != targets.BASELINE and len(base):
        speed = _speed_interval(rows.loc[lead])
        text += f", {formats.format_speedup_interval(speed)} ahead of {base.index[0]}"
        if speed.includes(1.0):
            text += " (no clear winner: the bracket includes 1)"
    lead_ttt = _ttt_interval(rows.loc[lead])
    close = [v for v in rows.index if v != lead and _ttt_interval(rows.loc[v]).overlaps(lead_ttt)]
    if first["verdict"] == "tie" and first["runner_up"] not in close:
        close.insert(0, first["runner_up"])
    what = "range" if lead_ttt.kind == "range" else "interval"
    if close:
        text += f"; {', '.join(close)} within its {what}"
    elif first["runner_up"] is not None:
        text += (f"; {first['runner_up']} next, taking {ranking.margin_text(first)} as long "
                 f"({first['verdict']}{': ranges, not intervals' if what == 'range' else ''})")
    return text + "."


def _ttt_interval(row: pd.Series) -> intervals.Interval:
    """A table row's time to target as an Interval."""
    return intervals.Interval(row["ttt_median_s"], row["ttt_low_s"], row["ttt_high_s"],
                              int(row["seeds"]), row["ttt_interval"])


def _speed_interval(row: pd.Series) -> intervals.Interval:
    """A table row's speed-up over the baseline as an Interval."""
    return intervals.Interval(row["speedup_median"], row["speedup_low"], row["speedup_high"],
                              int(row["seeds"]), row["speedup_interval"])


def table_text(result: Comparison) -> str:
    """The ranked table as aligned text: time to target and speed-up, each with its bracket."""
    speed_head = f"speed-up vs {targets.BASELINE}"
    width = max([32, *(len(v) + 2 for v in result.table["variant"])])  # long knob lists fit
    lines = [f"{'rank':<5}{'method':<{width}}{'time to target':<26}{speed_head:<30}seeds reached"]
    for i, (_, row) in enumerate(result.table.iterrows(), start=1):
        time_text = formats.format_time_interval(_ttt_interval(row))
        speed_text = formats.format_speedup_interval(_speed_interval(row))
        lines.append(f"{i:<5}{row['variant']:<{width}}{time_text:<26}{speed_text:<30}"
                     f"{row['reached']}/{row['seeds']}")
    return "\n".join(lines)


def json_value(value: object) -> object:
    """A table cell as JSON holds it: inf as "inf", NaN as null, numpy scalars as Python's."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else "inf"
    return value.item() if hasattr(value, "item") else value


def json_rows(frame: pd.DataFrame) -> list[dict]:
    """A frame's rows as JSON objects (`json_value` per cell)."""
    return [{k: json_value(v) for k, v in r.items()} for r in frame.to_dict("records")]


def record(result: Comparison) -> dict:
    """The comparison as JSON: network, target and its rule, the table, sentence, assumptions."""
    return {"network": result.network, "target_val_loss": result.target,
            "target_rule": result.target_rule, "compute_basis": result.compute_basis,
            "sentence": result.sentence,
            "ranking": json_rows(result.table), "runs": json_rows(result.runs),
            "first": {k: json_value(v) for k, v in result.first.to_dict().items()},
            "assumptions": result.assumptions}
