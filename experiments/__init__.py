"""experiments: workloads, the launcher, sweeps, time-to-target metrics, reports and CLI.

Submodules are imported on demand (each pulls in torch or plotting libraries):
`config`, `workloads`, `train`, `launch`, `simulate`, `validate`, `sweep`, `executors`,
`metrics`, `report`, `check_comm`, `cli`.
"""

__all__: list[str] = []
