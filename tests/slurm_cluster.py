"""A one-node Slurm cluster on this machine for tests: munged, slurmctld and slurmd in a folder.

Everything the daemons write (config, key, state, spool, logs, sockets) lives in one temporary
folder, and the ports are free ones picked at start, so the cluster touches nothing of the host's
own Slurm or munge and two test sessions do not meet. The settings suit a container without
systemd or cgroup delegation: processes are tracked through /proc (proctrack/linuxproc), tasks
are not bound (task/none), there is no accounting daemon, and the node declares more CPUs than
the machine has (config_overrides) so that a sweep's units can run side by side.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["BINARIES", "SlurmCluster", "missing_binaries"]

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
NODE = "flexnode"
CPUS = 4  # declared, not counted: two units of two spawned ranks each fit side by side

SLURM_CONF = """\
ClusterName=flexbench
SlurmctldHost={host}(127.0.0.1)
MailProg=/bin/true
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def missing_binaries() -> list[str]:
    """The Slurm and munge programs this cluster needs that are not on PATH (or in sbin)."""
    return [b for b in BINARIES if _which(b) is None]


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + slurmd on one node, configured and kept in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """The variables a Slurm client (sbatch, squeue, submitit) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> None:
        """Write the config, start the three daemons and wait until the node takes jobs."""
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            (self.root / sub).chmod(0o700)  # munged refuses a socket folder others can write
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        user = os.environ.get("USER") or _user()
        self.conf.write_text(SLURM_CONF.format(
            node=NODE, host=socket.gethostname().split(".")[0], root=self.root, user=user,
            cpus=CPUS, ctld_port=_free_port(), slurmd_port=_free_port()))
        m = self.root / "munge"
        self._spawn(_which("munged"), "-F", "-f", f"--socket={m}/munge.socket",
                    f"--key-file={key}", f"--pid-file={m}/munged.pid",
                    f"--log-file={self.root}/log/munged.log", f"--seed-file={m}/munged.seed")
        self._wait(lambda: (m / "munge.socket").exists(), timeout_s, "munged to open its socket")
        self._spawn(_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf))
        self._wait(lambda: self._ok("sinfo", "-h"), timeout_s, "slurmctld to answer")
        self._spawn(_which("slurmd"), "-D", "-N", NODE, "-f", str(self.conf))
        self._wait(self._node_idle, timeout_s, f"node {NODE} to be idle")

    def stop(self) -> None:
        """Cancel every job, stop the daemons (slurmd first) and remove the folder."""
        if self._daemons and all(p.poll() is None for p in self._daemons):
            self._ok("scancel", "--full", "--user", os.environ.get("USER") or _user())
            self._wait(lambda: not self.run("squeue", "-h").stdout.strip(), 15, None)
        for proc in reversed(self._daemons):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster; its output as text."""
        return subprocess.run([_which(args[0]) or args[0], *args[1:]], capture_output=True,
                              text=True, timeout=30, env={**os.environ, **self.env})

    def logs(self) -> str:
        """The tail of every daemon's log, for a failing test's message."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    def _spawn(self, *argv: str | None) -> None:
        if None in argv:
            raise RuntimeError(f"{argv[0]} is not installed")
        log = open(self.root / "log" / f"{Path(str(argv[0])).name}.out", "wb")  # noqa: SIM115
        self._daemons.append(subprocess.Popen(
            [str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **self.env}, start_new_session=True))
        log.close()

    def _ok(self, *args: str) -> bool:
        try:
            return self.run(*args).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip()
        return out.startswith("idle")

    def _wait(self, ready, timeout_s: float, what: str | None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self._daemons if p.poll() is not None]
            if dead and what is not None:
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        if what is not None:
            raise RuntimeError(f"timed out waiting for {what}\n{self.logs()}")


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
