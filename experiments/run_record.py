"""A run folder as every reader sees it: `RunRecord.load(path)`, the one place run.json is read.

A run folder (`flexbench run`, a sweep's unit) holds run.json (config, status, summary figures,
provenance), steps.parquet (per step: losses, times, bytes) and, for a real run,
trace.parquet (every collective); docs/interfaces.md lists their columns. Replays, comparisons,
sweeps, the planner and the profiler read them through this record, so a missing or broken file
is refused with one sentence naming it, the same way everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments.errors import ConfigError
from experiments.io import is_emulated, read_json

if TYPE_CHECKING:
    import pandas as pd

    from experiments.config import RunConfig

__all__ = ["RunRecord"]


@dataclass(frozen=True)
class RunRecord:
    """A run folder's run.json, read once and checked; its tables read on demand."""

    path: Path
    meta: dict[str, Any]
    """run.json as written."""

    @classmethod
    def load(cls, path: Path | str, what: str = "run record") -> RunRecord:
        """The run in folder `path` (ConfigError, one sentence, for a missing or broken
        run.json, or one without a config table); `what` names the file in the sentence."""
        path = Path(path)
        file = path / "run.json"
        if not path.is_dir():
            raise ConfigError(f"{str(path)!r} is not a folder; give a run folder written by "
                              "`flexbench run` or a sweep.")
        if not file.is_file():
            raise ConfigError(f"{str(path)!r} is not a finished run: run.json is missing.")
        meta = read_json(file, what)  # a JSON error or a key given twice, named
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise ConfigError(f"{what} {str(file)!r} has no config table; is it a run's "
                              "record?")
        return cls(path, meta)

    @property
    def config(self) -> dict[str, Any]:
        """The run's settings as stored (every default filled in when it ran)."""
        return self.meta["config"]

    @property
    def method(self) -> str | None:
        """The method the run trained."""
        method = self.config.get("method")
        return None if method is None else str(method)

    @property
    def seed(self) -> int:
        """The run's seed (0 where an older run.json stored none)."""
        return int(self.config.get("seed", 0))

    @property
    def workload(self) -> str | None:
        """The workload the run trained."""
        workload = self.config.get("workload")
        return None if workload is None else str(workload)

    @property
    def status(self) -> str:
        """done, or diverged (a finished run whose loss stopped being finite)."""
        return str(self.meta.get("status", "done"))

    @property
    def diverged(self) -> bool:
        """Whether the run's loss stopped being finite."""
        return self.status == "diverged"

    @property
    def emulated(self) -> bool:
        """An emulated run (`flexbench run --emulate`): a loss curve, no times, no trace."""
        return is_emulated(self.meta)

    @property
    def imported(self) -> dict[str, Any] | None:
        """What an imported trace's run.json says of its source (`flexbench import-trace`):
        files, device, what was inferred; None for a run of this toolkit."""
        info = self.meta.get("imported")
        return info if isinstance(info, dict) else None

    @property
    def shards(self) -> bool:
        """Whether the run's payloads are FSDP2 shards: its method's rule, or what an imported
        trace holds (a DDP job's are not, whatever method it is replayed as)."""
        info = self.imported
        if info is not None and "shards" in info:
            return bool(info["shards"])
        return self.run_config().record.shards

    @property
    def final_val_loss(self) -> float | None:
        """run.json's final validation loss; None where it recorded none (or not a number)."""
        value = self.meta.get("final_val_loss")
        try:
            value = float(value)
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None

    def run_config(self) -> RunConfig:
        """The stored config as a RunConfig, its numbers checked (a bad one named with this
        run.json): settings an older version had, and knobs the method does not read (older
        runs listed every knob for every method), left out."""
        from experiments.config import RunConfig, is_plugin, method_of

        names = {f.name for f in dataclasses.fields(RunConfig)}
        try:
            if is_plugin(self.method):  # a plug-in's own knobs are stored flat beside the rest
                names |= set(method_of(self.method).takes)
            return RunConfig.from_stored({k: v for k, v in self.config.items()
                                          if k in names}).check_numbers()
        except ConfigError as err:  # among several runs, which one
            raise ConfigError(f"{str(self.path / 'run.json')!r}: {err}") from None

    @staticmethod
    def missing_file(folder: Path | str) -> str | None:
        """The first file a finished run folder lacks (an emulated run has no trace), or None."""
        folder = Path(folder)
        if not (folder / "run.json").is_file():
            return "run.json"
        emulated = RunRecord.load(folder).emulated
        return next((name for name in ("steps.parquet", "trace.parquet")
                     if not (folder / name).is_file()
                     and not (emulated and name == "trace.parquet")), None)

    def steps(self, columns: list[str] | None = None) -> pd.DataFrame:
        """steps.parquet (ConfigError, one sentence, when it is missing or unreadable)."""
        return self._table("steps.parquet", columns)

    def trace(self) -> pd.DataFrame:
        """trace.parquet (ConfigError, one sentence, when it is missing or unreadable)."""
        if self.emulated:
            raise ConfigError(f"{str(self.path)!r} is an emulated run, which measured no step "
                              "times and has no trace to replay; use it as a loss curve "
                              "(--loss-from) beside a real run's trace.")
        return self._table("trace.parquet")

    def has(self, name: str) -> bool:
        """Whether the folder holds file `name`."""
        return (self.path / name).is_file()

    def _table(self, name: str, columns: list[str] | None = None) -> pd.DataFrame:
        import pandas as pd

        file = self.path / name
        if not file.is_file():
            raise ConfigError(f"{str(self.path)!r} is not a finished run: {name} is missing.")
        try:
            return pd.read_parquet(file, columns=columns)
        except (OSError, ValueError) as err:  # pyarrow's errors derive from these two
            raise ConfigError(f"cannot read {str(file)!r}: {err}") from None
