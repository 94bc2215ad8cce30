"""One rule for outputs, in every command: an output never replaces an input, and a folder, a
path under a file or an unwritable place is refused in one sentence before any work.

Every command's output flag is tried with each of its inputs (a file it reads, a folder it
reads, a run's or sweep's own file) and with each impossible place; the refusal is one line,
exit 2, and the input is left byte for byte. The plan's files follow the umask as every other
command's do (experiments.io.write_atomic).
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest

from experiments import cli
from experiments import io as io_module

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "results" / "quick" / "units" / "flexdemo-s0"
pytestmark = pytest.mark.skipif(not UNIT.is_dir(), reason="needs the committed results/quick")

MODEL = "gpt:dim=64,layers=2,heads=4,vocab=128,ffn=128,tied=true"
PLAN = ["plan", "--model", MODEL, "--method", "hsdp-adamw", "--nodes", "2",
        "--gpus-per-node", "1", "--step-compute", "0.1", "--inter-bw", "1Gbit",
        "--inter-lat", "1ms"]
# A place no file can be made, even by root: /proc takes none.
NOWHERE = "/proc/flexbench-nowhere/out"


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    """A run folder, a sweep folder, and files a command reads (their content is not read:
    the refusal comes first)."""
    run = tmp_path / "RUN"
    shutil.copytree(UNIT, run)
    sweep = tmp_path / "SWEEP"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}\n")
    (sweep / "runs.parquet").write_bytes(b"not read")
    files = {name: tmp_path / name for name in ("cal.json", "profile.json", "sites.toml",
                                                 "config.json", "cfg.toml", "baseline.json")}
    for path in files.values():
        path.write_text("mine\n")
    return {"run": run, "sweep": sweep, **files}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


# (argv with {run}, {sweep}, {cal.json}, ... for the inputs) per command and output flag.
CLOBBERS = [
    # the case: the plan's --out is the run it counts steps on
    PLAN + ["--steps-from", "{run}", "--target", "10", "--out", "{run}/run.json"],
    PLAN + ["--steps-from", "{run}", "--target", "10", "--out", "{run}/plan.csv"],
    PLAN + ["--out", "{run}/run.json"],  # a run's own file, though the plan does not read it
    PLAN + ["--out", "{sweep}/sweep.json"],
    [*PLAN[:2], "{config.json}", *PLAN[3:], "--out", "{config.json}"],  # a Hugging Face config
    [*PLAN[:-6], "--compute-profile", "{profile.json}", "--inter-bw", "1Gbit", "--inter-lat",
     "1ms", "--out", "{profile.json}"],
    [*PLAN[:4], "ada", *PLAN[5:], "--ada-graphs", "{run}", "--out", "{run}/ada.json"],
    ["simulate", "{run}", "--inter-bw", "1Gbit", "--out", "{run}/trace.parquet"],
    ["simulate", "{run}", "--inter-bw", "1Gbit", "--out", "{run}/sim.csv"],
    ["simulate", "{run}", "--inter-bw", "1Gbit", "--calibration", "{cal.json}", "--out",
     "{cal.json}"],
    ["simulate", "{run}", "--inter-bw", "1Gbit", "--compute-profile", "{profile.json}", "--out",
     "{profile.json}"],
    ["simulate", "{run}", "--topology", "{sites.toml}", "--out", "{sites.toml}"],
    ["simulate", "{run}", "--inter-bw", "1Gbit", "--out", "{sweep}/runs.parquet"],
    ["compare", "{run}", "--inter-bw", "1Gbit", "--out", "{run}/cmp.json"],
    ["compare", "{sweep}", "--inter-bw", "1Gbit", "--out", "{sweep}/sweep.json"],
    ["compare", "{run}", "--inter-bw", "1Gbit", "--calibration", "{cal.json}", "--out",
     "{cal.json}"],
    ["compare", "{run}", "--inter-bw", "1Gbit", "--loss-from", "{sweep}", "--out",
     "{sweep}/map.csv"],
    ["calibrate", "--out", "{run}/run.json"],
    ["profile-compute", "--workload", "lm-tiny", "--method", "flexdemo", "--out",
     "{run}/steps.parquet"],
    ["validate-sim", "--calibration", "{cal.json}", "--out", "{cal.json}"],
    ["validate-sim", "--keep", "{run}"],
    ["check-comm", "--update", "--baseline", "{run}/run.json"],
    ["sweep", str(ROOT / "experiments" / "configs" / "quick.toml"), "--out", "{run}"],
    ["run", "--config", "{cfg.toml}", "--out", "{run}"],
    ["run", "--emulate", "--out", "{run}"],
]


def _argv(template: list[str], inputs: dict[str, Path]) -> list[str]:
    out = []
    for word in template:
        for name, path in inputs.items():
            word = word.replace(f"{{{name}}}", str(path))
        out.append(word)
    return out


def _refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("template", CLOBBERS, ids=[f"{t[0]}:{t[-1]}" for t in CLOBBERS])
def test_an_output_never_replaces_an_input(template, inputs, tmp_path, capsys):
    before = _snapshot(tmp_path)
    err = _refused(_argv(template, inputs), capsys)
    assert "write it elsewhere" in err or "choose another" in err, err
    assert _snapshot(tmp_path) == before  # nothing replaced, nothing added


# (command argv before the output flag, the flag) of every command's output file or folder.
OUTPUT_FILES = [
    (PLAN, "--out", ".csv"),
    (["simulate", str(UNIT), "--inter-bw", "1Gbit"], "--out", ".csv"),
    (["compare", str(UNIT), "--inter-bw", "1Gbit"], "--out", ".json"),
    (["calibrate"], "--out", ".json"),
    (["profile-compute", "--workload", "lm-tiny", "--method", "flexdemo"], "--out", ".json"),
    (["validate-sim"], "--out", ".csv"),
    (["check-comm", "--update"], "--baseline", ".json"),
]
OUTPUT_FOLDERS = [
    (["run"], "--out"),
    (["run", "--emulate"], "--out"),
    (["sweep", str(ROOT / "experiments" / "configs" / "quick.toml")], "--out"),
    (["validate-sim"], "--keep"),
]


@pytest.mark.parametrize(("argv", "flag", "suffix"), OUTPUT_FILES,
                         ids=[f"{a[0]}{f}" for a, f, _ in OUTPUT_FILES])
@pytest.mark.parametrize("place", ["a folder", "under a file", "unwritable"])
def test_an_output_file_in_an_impossible_place_is_one_sentence(argv, flag, suffix, place,
                                                               tmp_path, capsys):
    (tmp_path / f"folder{suffix}").mkdir()
    (tmp_path / "file").write_text("mine\n")
    out = {"a folder": tmp_path / f"folder{suffix}",
           "under a file": tmp_path / "file" / f"x{suffix}",
           "unwritable": Path(NOWHERE + suffix)}[place]
    err = _refused([*argv, flag, str(out)], capsys)
    words = {"a folder": "is a folder", "under a file": "is a file, not a folder",
             "unwritable": "is not writable"}[place]
    assert f"{flag} {str(out)!r}" in err and words in err, err
    assert (tmp_path / "file").read_text() == "mine\n"
    assert list((tmp_path / f"folder{suffix}").iterdir()) == []


@pytest.mark.parametrize(("argv", "flag"), OUTPUT_FOLDERS,
                         ids=[f"{' '.join(a[:2])}{f}" for a, f in OUTPUT_FOLDERS])
@pytest.mark.parametrize("place", ["a file", "under a file", "unwritable"])
def test_an_output_folder_in_an_impossible_place_is_one_sentence(argv, flag, place, tmp_path,
                                                                 capsys):
    (tmp_path / "file").write_text("mine\n")
    out = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "out",
           "unwritable": Path(NOWHERE)}[place]
    err = _refused([*argv, flag, str(out)], capsys)
    words = {"a file": "is a file; choose a folder", "under a file": "is a file, not a folder",
             "unwritable": "is not writable"}[place]
    assert words in err and str(out) in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
    assert (tmp_path / "file").read_text() == "mine\n"


def test_report_refuses_a_figures_path_it_cannot_write_before_drawing(tmp_path, capsys):
    sweep = tmp_path / "quick"
    shutil.copytree(ROOT / "results" / "quick", sweep, ignore=shutil.ignore_patterns("figures"))
    (sweep / "figures").write_text("mine\n")
    before = _snapshot(sweep)
    err = _refused(["report", str(sweep)], capsys)
    assert "figures" in err and "is a file; choose a folder" in err, err
    assert _snapshot(sweep) == before


@pytest.mark.parametrize("suffix", [".csv", ".json", ".png"])
def test_the_plans_file_follows_the_umask(suffix, tmp_path, capsys, monkeypatch):
    # experiments.io reads the umask once, at import; this process's is taken as 022.
    monkeypatch.setattr(io_module, "_UMASK", 0o022)
    assert cli.main([*PLAN, "--out", str(tmp_path / f"p{suffix}")]) == 0
    capsys.readouterr()
    assert stat.S_IMODE((tmp_path / f"p{suffix}").stat().st_mode) == 0o644  # not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == [f"p{suffix}"]  # no temporary file left
