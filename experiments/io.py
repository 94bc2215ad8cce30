"""Files and provenance shared by runs, sweeps and checks: atomic writes, output checks, versions.

Every result file is written atomically (a temp file in the same folder, then a rename), and
every output path is checked before any work starts, so a bad `--out` costs one sentence, not a
finished run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from experiments.errors import ConfigError
from netsim.processes import pid_alive

__all__ = ["EMULATED", "RECORD_FILES", "is_emulated",
           "check_output_file", "check_output_folder", "cpu_model", "exclusive", "provenance",
           "read_json", "run_digest", "write_atomic"]

# The umask can only be read by setting it: once, at import, before any worker thread runs.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a file so that readers see the old content or the new one, never a half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp makes the file 0600; a result is read by others, as any file open() makes.
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def exclusive(lock: Path, what: str) -> Iterator[None]:
    """Hold `lock` (a file naming this process) for the block: one `what` per folder at a time.

    A lock whose process is gone (killed) is taken over; a live one is refused in one sentence.
    """
    lock = Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    mine = f"{os.getpid()}\n"
    claim = lock.with_name(f"{lock.name}.{os.getpid()}.tmp")
    claim.write_text(mine)
    try:
        while True:
            try:
                os.link(claim, lock)  # atomic, and the lock holds our pid from its first moment
                break
            except FileExistsError:
                holder = _read_or_empty(lock)
                if holder.isdigit() and int(holder) != os.getpid() and pid_alive(int(holder)):
                    raise ConfigError(f"another {what} (pid {holder}) is running in "
                                      f"{str(lock.parent)!r}; wait for it or choose another "
                                      "--out.") from None
                lock.unlink(missing_ok=True)  # left by a process that is gone
    finally:
        claim.unlink(missing_ok=True)
    try:
        yield
    finally:
        if _read_or_empty(lock) == mine.strip():
            lock.unlink(missing_ok=True)


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class _KeyTwice(ValueError):
    """A JSON object that gives one key twice (json keeps the last without a word)."""


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _KeyTwice(key)
        seen[key] = value
    return seen


def read_json(path: Path | str, what: str) -> Any:
    """A JSON file's content; ConfigError naming `what` and the file when it is missing, is not
    JSON (with the line and column) or gives a key of one object twice."""
    where = f"{what} {str(path)!r}"
    try:
        return json.loads(Path(path).read_text(), object_pairs_hook=_once_each)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist.") from None
    except _KeyTwice as err:
        raise ConfigError(f"{where} gives the key {err.args[0]!r} twice in one object; keep "
                          "one.") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not readable JSON: {err.msg} at line {err.lineno}, "
                          f"column {err.colno}.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} cannot be read: {err}.") from None


def run_digest(run_dir: Path) -> str:
    """A hash of what a replay reads from a run: its run.json and its trace."""
    digest = hashlib.sha256()
    for name in ("run.json", "trace.parquet"):
        digest.update(_file_digest(run_dir / name).encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1024)
def _file_digest_at(path: Path, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # part of the cache key only: a rewritten file is hashed again
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_digest(path: Path) -> str:
    try:
        stat = path.stat()
    except OSError:
        return "missing"
    return _file_digest_at(path, stat.st_size, stat.st_mtime_ns)


def _check_creatable(path: Path, what: str) -> None:
    """The nearest existing ancestor of `path` is a writable folder (so mkdir -p will work)."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {str(path)!r} cannot be created: {str(parent)!r} is a file, "
                          f"not a folder.")
    if not _writable(parent):
        raise ConfigError(f"{what} {str(path)!r} cannot be created: {str(parent)!r} is not "
                          f"writable.")


def _writable(folder: Path) -> bool:
    """Whether a file can be made in `folder`: tried, as permissions alone do not say (root
    passes them, a read-only mount or /proc does not take files)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".flexbench-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def check_output_folder(out: Path | str, *, what: str = "output folder",
                        must_be_empty: bool = True, reads: Iterable[Path | str] = ()) -> Path:
    """Refuse an output folder that is a file, holds files, cannot be created, or holds or is
    what the command reads (`check_output_file` says which); return it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{what} {str(out)!r} is a file; choose a folder.")
    _check_not_read(out, what, reads, folder=True)
    if (out / "run.json").is_file():  # a run's files are never written over by another's
        raise ConfigError(f"{what} {str(out)!r} is the folder of a run (it holds run.json); "
                          "choose another.")
    if must_be_empty and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{what} {str(out)!r} already holds files; choose a new one.")
    if out.is_dir():
        if not _writable(out):
            raise ConfigError(f"{what} {str(out)!r} is not writable.")
    else:
        _check_creatable(out, what)
    return out


RUN_FILES = ("run.json", "steps.parquet", "trace.parquet")

EMULATED = "emulated"
"""run.json's `executor` of an emulated run (`flexbench run --emulate`); a real run has none."""


def is_emulated(meta: dict[str, Any]) -> bool:
    """Whether run.json `meta` is an emulated run's: a loss curve with no times and no trace."""
    return meta.get("executor") == EMULATED


# What `flexbench run` and `flexbench sweep` write into their folders, beside the file that
# marks the folder as theirs (run.json, sweep.json): another command's output never replaces one.
RECORD_FILES = {"run.json": RUN_FILES,
                "sweep.json": ("sweep.json", "runs.parquet", "steps.parquet",
                               "speedups.parquet")}


def check_output_file(path: Path | str, *, what: str = "output file",
                      reads: Iterable[Path | str] = ()) -> Path:
    """Refuse an output file that is a folder, sits under a file, cannot be written, or would
    replace an input; return it.

    Outputs never clobber inputs: a file the command `reads`, a path inside a folder it reads,
    or a run's or sweep's own file (run.json, steps.parquet, ... beside its run.json or
    sweep.json) is refused too.
    """
    path = Path(path)
    _check_not_read(path, what, reads)
    for marker, names in RECORD_FILES.items():
        if path.name in names and (path.parent / marker).is_file():
            kind = "run" if marker == "run.json" else "sweep"
            raise ConfigError(f"{what} {str(path)!r} is a file of the {kind} in "
                              f"{str(path.parent)!r}; write it elsewhere.")
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a folder; give a file name.")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{what} {str(path)!r} is not writable.")
    _check_creatable(path, what)
    return path


def _check_not_read(path: Path, what: str, reads: Iterable[Path | str], *,
                    folder: bool = False) -> None:
    """Refuse `path` where it is an input, lies inside an input folder, or (a `folder` the
    command writes into) holds an input."""
    target = path.resolve()
    for given in map(Path, reads):
        source = given.resolve()
        same = target == source or (target.exists() and source.exists()
                                    and os.path.samefile(target, source))
        if same:
            raise ConfigError(f"{what} {str(path)!r} is {str(given)!r}, which this command "
                              "reads; write it elsewhere.")
        if source.is_dir() and target.is_relative_to(source):
            raise ConfigError(f"{what} {str(path)!r} is inside {str(given)!r}, which this "
                              "command reads; write it elsewhere.")
        if folder and source.is_relative_to(target):
            raise ConfigError(f"{what} {str(path)!r} holds {str(given)!r}, which this command "
                              "reads; write it elsewhere.")


def provenance() -> dict[str, Any]:
    """Versions, git commit (and whether the tree was dirty) and host, for every run and sweep."""
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for name in ("torch", "pandas", "simpy", "submitit", "flexbench"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    # results/ is where sweeps write: its own files changing says nothing about the code.
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                  ":(top,exclude)results")
    return {
        "versions": versions,
        "git_commit": _git("rev-parse", "HEAD") or None,
        "git_dirty": None if status is None else bool(status),
        # The CPU model too: a VM of one name can land on another CPU between days, and
        # recorded compute per step moves with it while the losses do not.
        "host": {"name": socket.gethostname(), "platform": platform.platform(),
                 "cpus": os.cpu_count(), "cpu": cpu_model()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo, else what `platform` says); None if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _git(*args: str) -> str | None:
    """Output of a git command run beside this package; None outside a checkout."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
