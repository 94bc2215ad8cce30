"""Config files are read whole or refused: every key of every table is known and well typed.

Each case here was once accepted and then ignored or misread; each must now be
refused with one sentence naming the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.run.command import load_config as load_run_config
from experiments.sweep.plan import load_config as load_sweep_config
from flexdemo.knobs import MAX_DCT_CHUNK

SWEEP = """
name = "probe"
{top}
[run]
workload = "lm-tiny"
steps = 5
{run}
[grid]
methods = {methods}
inter_bw = ["1Gbit"]
inter_lat = ["1ms"]
seeds = [0]
{rest}
"""

# (case, what goes where in SWEEP, a piece of the sentence that must be said)
SWEEP_CASES = [
    ("timeout-nan", {"top": "timeout_s = nan"}, "timeout_s must be a finite number > 0"),
    ("timeout-inf", {"top": "timeout_s = inf"}, "timeout_s must be a finite number > 0"),
    ("run-setting-at-top", {"top": "steps = 5"}, "'steps' is a run setting"),
    ("knob-of-a-method-not-in-the-grid", {"rest": "[grid.knobs.diloco]\ntypo = [1]"},
     "grid.knobs.diloco.typo is not a run setting"),
    ("run-knob-no-method-reads", {"run": "topk = 4", "methods": '["hsdp-adamw"]'},
     "run.topk is read by none of grid.methods"),
    ("executor-folder-not-a-string", {"rest": "[executor]\nfolder = 3"},
     "executor.folder must be a path"),
    ("executor-bool-as-number", {"rest": "[executor]\ntimeout_min = true"},
     "executor.timeout_min must be an integer >= 0, got True"),
    ("executor-nan", {"rest": "[executor]\nmem_gb = nan"},
     "executor.mem_gb must be a finite number"),
    ("validate-bandwidth-without-unit",
     {"rest": '[[validate]]\nmethod = "flexdemo"\ninter_bw = 100\ninter_lat = "1ms"'},
     "validate[0].inter_bw must be a string with its unit"),
]


@pytest.mark.parametrize(("parts", "said"), [c[1:] for c in SWEEP_CASES],
                         ids=[c[0] for c in SWEEP_CASES])
@pytest.mark.timeout(30)
def test_a_sweep_file_with_a_bad_key_is_refused(tmp_path: Path, parts: dict[str, str],
                                                said: str) -> None:
    fields = {"top": "", "run": "", "methods": '["hsdp-adamw", "flexdemo"]', "rest": "", **parts}
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP.format(**fields))
    with pytest.raises(ConfigError) as err:
        load_sweep_config(path)
    message = str(err.value)
    assert said in message
    assert "\n" not in message.strip()


@pytest.mark.timeout(30)
def test_the_sweep_template_itself_loads(tmp_path: Path) -> None:
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP.format(top="timeout_s = 60", run="", rest="",
                                 methods='["hsdp-adamw", "flexdemo"]'))
    assert load_sweep_config(path).timeout_s == 60


@pytest.mark.parametrize("key", ["grid", "target", "validate", "executor", "timeout_s", "name"])
@pytest.mark.timeout(30)
def test_a_run_file_with_a_sweep_key_says_it_is_a_sweep_key(tmp_path: Path, key: str) -> None:
    value = {"grid": "{methods = ['flexdemo']}", "target": "{val_loss = 3.0}",
             "validate": "[{method = 'flexdemo'}]", "executor": "{kind = 'local'}",
             "timeout_s": "60", "name": "'x'"}[key]
    path = tmp_path / "run.toml"
    path.write_text(f"steps = 5\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=f"has {key}, which belong to a sweep file"):
        load_run_config(str(path), {}, [])


@pytest.mark.parametrize("chunk", [MAX_DCT_CHUNK + 1, 1_000_000])
def test_a_dct_chunk_whose_basis_would_not_fit_is_refused(chunk: int) -> None:
    with pytest.raises(ConfigError, match=f"^chunk={chunk} must be an integer from 1 to "
                                          f"{MAX_DCT_CHUNK}: a DCT chunk"):
        RunConfig(method="flexdemo", chunk=chunk).validate()


def test_the_largest_dct_chunk_is_taken_and_other_chunks_are_not_dct_chunks() -> None:
    assert RunConfig(method="flexdemo", chunk=MAX_DCT_CHUNK).validate().chunk == MAX_DCT_CHUNK
    assert RunConfig(method="striding", chunk=MAX_DCT_CHUNK * 4).validate()


def test_more_fragments_than_a_built_in_models_parameters_is_refused_before_launch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.cli import main

    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--method", "streaming-diloco", "--workload",
                 "lm-tiny", "--nodes", "2", "--gpus-per-node", "1", "--steps", "4", "--set",
                 "num_fragments=1000", "--set", "sync_every=2000"])
    err = capsys.readouterr().err
    assert code == 2
    assert "num_fragments=1000 is more than the 53 parameter tensors of lm-tiny" in err, err
    assert err.count(". ") == 0 and not out.exists()
    assert not list(tmp_path.iterdir())  # nothing written, not even an error log
