"""A single-node SLURM cluster in a temporary folder, for the tests: munged, slurmctld and slurmd from Debian's
``munge`` and ``slurm-wlm`` packages (``.ci/run`` installs them where it can), configured with accounting
storage off, as on many small clusters. ``start(folder)`` returns a running ``Cluster`` or raises
``Unavailable`` with one line saying why; ``Cluster.stop()`` stops what it started (by the pids it wrote)."""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "sinfo")
NODE = "fewclip-node"


class Unavailable(RuntimeError):
    """SLURM cannot start here (one line: why)."""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _binary(name: str) -> str:
    for folder in (os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"]):
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise Unavailable(f"{name} is not installed (apt-get install slurm-wlm munge)")


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str]
    pid_files: list[Path] = field(default_factory=list)

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def stop(self) -> None:
        self.run("scancel", "--user", getpass.getuser(), check=False)
        for pid_file in reversed(self.pid_files):
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            for _ in range(50):  # up to 5 s for it to go
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)


def start(folder: Path, timeout_s: float = 30.0) -> Cluster:
    """Configure and start a one-node cluster under ``folder`` (nothing outside it is written)."""
    bins = {name: _binary(name) for name in DAEMONS + CLIENTS}
    if os.geteuid() != 0:  # slurmd starts each job as its user; tried here as root only
        raise Unavailable("slurmd needs root to start jobs, and this test runs as another user")
    folder = Path(folder).resolve()
    for sub in ("munge", "state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / "munge").chmod(0o700)
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = folder / "munge" / "munge.sock"
    user = getpass.getuser()
    host = socket.gethostname().split(".")[0]
    ctld_port, d_port = _free_ports(2)
    mem_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    conf = folder / "slurm.conf"
    conf.write_text(f"""\
ClusterName=fewclip-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={folder / 'state'}
SlurmdSpoolDir={folder / 'spool'}
SlurmctldPidFile={folder / 'slurmctld.pid'}
SlurmdPidFile={folder / 'slurmd.pid'}
SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}
SlurmdLogFile={folder / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=2
MinJobAge=30
SchedulerParameters=sched_interval=1
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={max(1, mem_mib - 512)} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = Cluster(folder, env)
    starts = [
        ([bins["munged"], "--force", f"--socket={sock}", f"--key-file={key}",
          f"--log-file={folder / 'log' / 'munged.log'}", f"--pid-file={folder / 'munge' / 'munged.pid'}",
          f"--seed-file={folder / 'munge' / 'munged.seed'}"],
         folder / "munge" / "munged.pid"),
        ([bins["slurmctld"], "-i"], folder / "slurmctld.pid"),
        ([bins["slurmd"], "-N", NODE], folder / "slurmd.pid"),
    ]
    try:
        for cmd, pid_file in starts:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
            cluster.pid_files.append(pid_file)
            if p.returncode != 0:
                raise Unavailable(f"{Path(cmd[0]).name} did not start: {(p.stderr or p.stdout).strip()[:200]}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
            if p.returncode == 0 and p.stdout.strip() in ("idle", "mixed", "allocated"):
                return cluster
            time.sleep(0.5)
        log = (folder / "log" / "slurmd.log")
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        raise Unavailable(f"the node did not come up in {timeout_s:.0f} s ({p.stdout.strip() or p.stderr.strip()}; "
                          f"{' '.join(tail)[:200]})")
    except BaseException:
        cluster.stop()
        raise


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
