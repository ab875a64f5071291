"""A real SLURM cluster on this one machine: one ``slurmctld`` and a ``slurmd`` per node, all under one
directory.

Debian's SLURM 22.05 is built without ``--enable-multiple-slurmd``, which refuses two nodes with the same
NodeHostname (``_push_to_hashtbls`` in src/common/read_config.c). What works without it: each node its own
NodeName and NodeHostname (names no resolver knows), its own loopback NodeAddr (127.0.0.11, .12, ...) and its
own Port, and one ``slurmd -N <name>`` per node, which then takes that node's port from slurm.conf
(src/slurmd/slurmd/slurmd.c). Everything the daemons write (state, spool, logs, pid files, the job-completion
record) stays under the cluster's directory; no systemd, no munge: Debian's build ships the ``auth/none`` and
``cred/none`` plugins (test clusters only: any local user could act as any other). ``proctrack/linuxproc``
and ``task/none`` need no cgroups, which a container may not delegate; linuxproc follows a job's processes by
parent, so a process that starts a session of its own (asyncrl's launcher does) stays in the job.

Teardown cancels the jobs, stops the daemons it started, then kills by PID whatever still carries this
cluster's ``SLURM_CONF`` in its environment (slurmstepd and job tasks inherit it; nothing else on the machine
does).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.utils.process import free_port

BINARIES = ("slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "sacct", "squeue", "scancel")
INSTALL = "apt-get install -y slurmctld slurmd slurm-client (Debian 12: SLURM 22.05)"
FINAL_STATES = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
)

CONF = """\
ClusterName=asyncrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# `sacct --completion` reads a finished job's state and exit code from this file
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# the nodes' CPUs as written here, whatever this machine has: several "nodes" share its cores
SlurmdParameters=config_overrides
# a cancelled job's processes get SIGKILL 5 s after SIGTERM (default 30 s)
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
    """Why no cluster can start here (binaries absent, not root), or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): {INSTALL}"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their user and must start as root"
    return None


@dataclass
class Cluster:
    """A started cluster: its node names and addresses, and the environment its commands need."""

    root: Path
    nodes: list[str]
    addrs: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, timeout: float = 30) -> str:
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr}"
        return proc.stdout

    def sbatch(self, script: Path, env: dict[str, str] | None = None) -> int:
        """Submit ``script`` with this environment (plus ``env``), which its job inherits; returns the job
        id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip().split(";")[0])

    def wait(self, job: int, timeout_s: float) -> dict[str, str]:
        """The job's record (JobID, State, ExitCode, NodeList) once it has ended; AssertionError after
        ``timeout_s`` (the job is cancelled first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            row = self.record(job)
            if row and row["State"].split()[0] in FINAL_STATES:
                return row
            time.sleep(1)
        subprocess.run(["scancel", str(job)], env=self.env, timeout=30)
        raise AssertionError(f"job {job} still running after {timeout_s}s: {self.record(job)}")

    def record(self, job: int) -> dict[str, str] | None:
        """The job's row in the job-completion record (written when it ends), or None."""
        fields = "JobID,State,ExitCode,NodeList"
        out = self.run("sacct", "--completion", "--parsable2", "--noheader", "-j", str(job), "-o", fields)
        rows = [
            dict(zip(fields.split(","), line.split("|"), strict=True)) for line in out.splitlines() if line
        ]
        return rows[-1] if rows else None

    def steps_on(self, node: str, job: int) -> set[int]:
        """The job's steps that ``node``'s slurmd launched tasks of (its log's ``launch task StepId=J.S``
        lines)."""
        text = (self.root / "log" / f"slurmd-{node}.log").read_text(errors="replace")
        return {int(s) for s in re.findall(rf"launch task StepId={job}\.(\d+) ", text)}

    def logs(self) -> str:
        """The daemons' logs, last lines of each: for a failure's message."""
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}" for p in self.log_files()
        )

    def log_files(self) -> list[Path]:
        return sorted((self.root / "log").glob("*.log"))


def write_conf(root: Path, nodes: int, cpus: int) -> tuple[Path, list[str], dict[str, str]]:
    """slurm.conf under ``root`` for ``nodes`` nodes of ``cpus`` CPUs, its directories made; returns the
    file, the node names and their addresses."""
    names = [f"node{i}" for i in range(1, nodes + 1)]
    addrs = {name: f"127.0.0.{10 + i}" for i, name in enumerate(names, start=1)}
    lines = [
        f"NodeName={n} NodeHostname={n} NodeAddr={addrs[n]} Port={free_port()} CPUs={cpus} State=UNKNOWN"
        for n in names
    ]
    for sub in ("state", "log", *(f"spool/{n}" for n in names)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    host = socket.gethostname().split(".")[0]  # slurmctld starts only where SlurmctldHost names this host
    conf.write_text(CONF.format(host=host, ctld_port=free_port(), root=root, nodes="\n".join(lines)))
    return conf, names, addrs


def wait_idle(cluster: Cluster, timeout_s: float = 60) -> None:
    """Until every node has registered and is idle; AssertionError with the daemons' logs if not."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        dead = [" ".join(map(str, d.args)) for d in cluster.daemons if d.poll() is not None]
        assert not dead, f"exited: {dead}\n{cluster.logs()}"
        out = cluster.run("sinfo", "--noheader", "--Node", "-o", "%N %t")
        states = dict(line.split() for line in out.splitlines() if line.strip())
        if len(states) == len(cluster.nodes) and all(s == "idle" for s in states.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"nodes not idle after {timeout_s}s: {states}\n{cluster.logs()}")


def strays(conf: Path) -> list[int]:
    """PIDs of processes whose environment names this cluster's slurm.conf (job steps, their tasks)."""
    marker = f"SLURM_CONF={conf}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def teardown(cluster: Cluster, conf: Path) -> None:
    """Cancel every job, stop the daemons (SIGTERM, then SIGKILL), kill what the jobs left."""
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run(
            ["scancel", "--full", "--user=root"], env=cluster.env, timeout=15, capture_output=True
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["squeue", "--noheader"], env=cluster.env, timeout=15, capture_output=True, text=True
            )
            if out.returncode != 0 or not out.stdout.strip():
                break
            time.sleep(0.5)
    for d in cluster.daemons:
        if d.poll() is None:
            d.terminate()
    for d in cluster.daemons:
        try:
            d.wait(timeout=15)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
    for pid in strays(conf):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def slurm_cluster(root: Path, nodes: int = 3, cpus: int = 2) -> Iterator[Cluster]:
    """A running cluster of ``nodes`` nodes under ``root`` until the block ends, torn down however it
    ends."""
    conf, names, addrs = write_conf(root, nodes, cpus)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = Cluster(root, names, addrs, env)
    try:
        # in the foreground (-D), so that they are this process's children, stopped by PID
        commands = [["slurmctld", "-D", "-i", "-f", str(conf)]]
        commands += [["slurmd", "-D", "-f", str(conf), "-N", n] for n in names]
        for argv in commands:
            log = root / "log" / f"{argv[0]}-{argv[-1] if argv[0] == 'slurmd' else 'main'}.console.log"
            with log.open("wb") as f:
                cluster.daemons.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT))
        wait_idle(cluster)
        yield cluster
    finally:
        teardown(cluster, conf)
