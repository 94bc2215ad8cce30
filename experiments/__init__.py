"""experiments: workloads, runs, replays, sweeps, reports and the `flexbench` command.

Rooms by job (each imported on demand; only ``run/`` and the training side pull in torch):

- ``cli.py``: the `flexbench` command table; ``config.py``: `RunConfig`, its flags and checks;
  ``workloads.py``: the models and data; ``errors.py``, ``io.py``, ``logs.py``: shared pieces.
- ``run/``: one run (launch, kernel launch, the rank body, the training loop, the run folder,
  the watchdog).
- ``replay/``: the cost model against runs (simulate, validate-sim, calibrate).
- ``sweep/``: methods x knobs x seeds x networks (the file, the plan, the runner, the executors,
  the scoring).
- ``report/``: time to target, figures, summaries, the graph study.
- ``check_comm.py``: the CI check on bytes per step.
"""

__all__: list[str] = []
