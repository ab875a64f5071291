"""How a sandbox is bounded as a whole: the memory, processes and CPU of everything in it together, the
memory of the pool's sandboxes together, and the system calls its programs may make.

**Memory of one sandbox.** ``sandbox_memory_mb`` bounds every process in a sandbox and its private ``/tmp``
(a tmpfs: host memory) together. The pool holds it one of two ways, chosen at start and logged once:

- **cgroup v2**, where the host delegates a writable group with the memory and pids controllers (``cgroup``
  names its directory; else this process's own group is used if it already enables both for its children).
  Each sandbox gets a group of its own: ``memory.max`` is the budget (the kernel charges tmpfs pages and
  kernel buffers to it; over it, its OOM killer kills inside the group), ``memory.swap.max`` 0, ``pids.max``
  ``nproc``, ``cpu.max`` ``cpus``. A single process may use up to ``memory_mb``.
- **rlimits** otherwise (cgroup v1, or v2 without those controllers delegated). At most ``nproc`` processes
  and threads run in a sandbox (``RLIMIT_NPROC`` counts them in its user namespace, the runner included), so
  each process of the program gets an address space of
  ``(sandbox_memory_mb - tmpfs_mb - SHM_MB - OVERHEAD_MB) / (nproc - 1)`` (and at most ``memory_mb``):
  whatever it forks, the sum stays under the budget (``SHM_MB``: the sandbox's ``/dev/shm``). ``OVERHEAD_MB``
  covers the runner and bwrap, which are outside the rlimits. A config that leaves a process less than
  ``MIN_PROCESS_MB`` is refused, naming the keys. Kernel buffers (pipes, sockets) are outside this bound.

**Memory of the pool.** ``pool_memory_mb`` (0: half the machine's memory) bounds the sandboxes together:
``workers x sandbox_memory_mb`` must fit in it, else the pool refuses to start, naming the keys; with
``workers`` 0 the pool starts as many as fit, at most one per CPU. The pool never shrinks a sandbox's limits
to fit more: a program gets the same verdict whatever the pool's size.

**CPU.** ``cpus`` CPUs per sandbox: ``cpu.max`` in a cgroup, else the sandbox's processes are pinned to the
warm slot's CPUs (``sched_setaffinity``), which the seccomp filter keeps them from changing.

**System calls.** A seccomp filter built with libseccomp (through ``pyseccomp``), exported as BPF and handed
to bwrap's ``--seccomp``: bwrap installs it last, after its own set-up, so it applies to the runner and the
program only. The calls in ``KILLED`` (and ``clone`` with a namespace flag) kill the process with ``SIGSYS``:
no ordinary test program makes them, a killed process cannot go on after the attempt, and the runner reports
the signal as ``denied_syscall`` (the program then scores 0). ``clone3`` fails with ``ENOSYS`` (its flags sit
in memory a filter cannot read; glibc falls back to ``clone``), ``sched_setaffinity`` with ``EPERM``.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from asyncrl.sandbox.isolation import SHM_MB, SandboxUnavailable

OVERHEAD_MB = 32  # the runner (~11 MiB resident) and bwrap (~2 MiB), which no rlimit of the program's bounds
MIN_PROCESS_MB = 64  # a forked runner already maps ~15 MiB; a test needs room beyond that

# ptrace and its kin read or stop other processes (the runner, PID 1); the rest reach kernel surfaces that a
# test never needs (io_uring, BPF, keyrings, mounts, namespaces, modules)
KILLED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise", "kcmp",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "bpf", "perf_event_open",
    "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "unshare", "setns", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog",
)  # fmt: skip
# NEWNS..NEWNET
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
SIGSYS = 31


@functools.cache
def seccomp_program() -> bytes:
    """The filter as a BPF program, the bytes bwrap's ``--seccomp FD`` reads."""
    try:
        import pyseccomp as sc  # lazy: loads libseccomp through ctypes
    except (ImportError, RuntimeError) as e:  # RuntimeError: the package is there, libseccomp.so.2 is not
        raise SandboxUnavailable(
            f"no seccomp filter ({e}): install asyncrl's dependencies (pyseccomp) and libseccomp2"
        ) from None
    f = sc.SyscallFilter(sc.ALLOW)
    for name in KILLED:
        f.add_rule(sc.KILL_PROCESS, name)
    for flag in NAMESPACE_FLAGS:
        f.add_rule(sc.KILL_PROCESS, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(sc.ERRNO(errno.EPERM), "sched_setaffinity")
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def seccomp_fd() -> int:
    """A pipe's read end holding the filter, for one bwrap to read (it reads to the end)."""
    program = seccomp_program()
    r, w = os.pipe()
    assert len(program) < 65536  # fits the pipe's buffer: the write never waits for bwrap
    os.write(w, program)
    os.close(w)
    return r


@dataclass(frozen=True)
class Plan:
    """The bounds a pool applies: per-sandbox budget, the address space each process gets, how it is held."""

    workers: int
    sandbox_mb: int
    pool_mb: int
    process_mb: int
    cgroup: Path | None  # the delegated group the pool's groups go under; None: rlimits
    why: str  # why that way, for the log


def machine_memory_mb() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20


def plan(limits, workers: int, cgroup: str = "", parts: int = 1) -> Plan:
    """Check the memory keys against each other and pick how to hold them (see the module doc). ``parts``:
    this pool is one of that many alike (one per env worker process), which share the CPUs, ``workers`` and
    ``pool_memory_mb`` equally, so that together they hold the budget one pool would."""
    lim = limits
    pool_mb = (lim.pool_memory_mb or machine_memory_mb() // 2) // parts
    cpus = max(1, len(os.sched_getaffinity(0)) // parts)
    if workers:
        workers = max(1, workers // parts)
    else:
        workers = max(1, min(cpus, pool_mb // lim.sandbox_memory_mb))
    if workers * lim.sandbox_memory_mb > pool_mb:
        shared = f", shared by {parts} env worker processes" if parts > 1 else ""
        raise ValueError(
            f"workers={workers} x sandbox_memory_mb={lim.sandbox_memory_mb} is over "
            f"pool_memory_mb={pool_mb} ({'set' if lim.pool_memory_mb else '0: half the machine'}{shared}): "
            "lower workers or sandbox_memory_mb, or raise pool_memory_mb"
        )
    group, why = delegated_cgroup(cgroup)
    if problem := kernel_problem(os.uname().release, group is not None):
        raise SandboxUnavailable(problem)
    if group is not None:
        return Plan(workers, lim.sandbox_memory_mb, pool_mb, lim.memory_mb, group, why)
    share = (lim.sandbox_memory_mb - lim.tmpfs_mb - SHM_MB - OVERHEAD_MB) // (lim.nproc - 1)
    if share < MIN_PROCESS_MB:
        raise ValueError(
            f"sandbox_memory_mb={lim.sandbox_memory_mb} leaves {share} MiB per process ((sandbox_memory_mb "
            f"- tmpfs_mb={lim.tmpfs_mb} - {SHM_MB + OVERHEAD_MB}) / (nproc={lim.nproc} - 1)), under "
            f"{MIN_PROCESS_MB}: raise sandbox_memory_mb or lower nproc or tmpfs_mb"
        )
    return Plan(workers, lim.sandbox_memory_mb, pool_mb, min(lim.memory_mb, share), None, why)


# pidfd_open (the runner waits on its tests with it); per-user-namespace RLIMIT_NPROC accounting ("ucounts"),
# which the rlimit bounds rely on: before it, every sandbox's processes count against its user's machine-wide
# limit
PIDFD_KERNEL = (5, 3)
USERNS_NPROC_KERNEL = (5, 14)


def kernel_problem(release: str, cgroup: bool) -> str | None:
    """Why this kernel (``os.uname().release``, e.g. ``4.18.0-513.el8.x86_64``) cannot hold a sandbox's
    bounds, or None. Without a cgroup the process limit needs per-user-namespace accounting; with one,
    ``pids.max`` holds it."""
    try:
        version = tuple(int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return None  # an unusual version string: the sandbox's own start-up will say what is missing
    need = USERNS_NPROC_KERNEL if not cgroup else PIDFD_KERNEL
    if version >= need:
        return None
    have = ".".join(map(str, version))
    if cgroup:
        return f"Linux {have} is older than {need[0]}.{need[1]}: the sandbox's runner needs pidfd_open"
    return (
        f"Linux {have} counts every sandbox's processes against its user's own process limit "
        f"(per-user-namespace accounting came in Linux {need[0]}.{need[1]}), so the rlimit bounds would not "
        "hold: give the pool a delegated cgroup v2 group with the memory and pids controllers "
        "(env.<name>.args.cgroup), or run on a newer kernel"
    )


def delegated_cgroup(explicit: str = "") -> tuple[Path | None, str]:
    """The cgroup v2 directory the pool may make its groups under, or None and why not."""
    if explicit:
        path = Path(explicit)
        missing = {"memory", "pids"} - _words(path / "cgroup.controllers")
        if not os.access(path, os.W_OK) or missing:
            raise SandboxUnavailable(
                f"cgroup={explicit!r}: not writable, or without the {missing} controllers"
            )
        return path, f"cgroup v2 at {path} (cgroup)"
    mounts = [ln.split() for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
    roots = [m[4] for m in mounts if m[m.index("-") + 1] == "cgroup2"]
    own = [ln[3:] for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::")]
    if not roots or not own:
        return None, "no cgroup v2 hierarchy here"
    path = Path(roots[0]) / own[0].lstrip("/")
    enabled = _words(path / "cgroup.subtree_control")
    if not os.access(path, os.W_OK) or not {"memory", "pids"} <= enabled:
        offered = " ".join(sorted(_words(path / "cgroup.controllers"))) or "none"
        return None, (
            f"this process's cgroup v2 group {path} does not give its children the memory and pids "
            f"controllers (writable: {os.access(path, os.W_OK)}; controllers: {offered}; enabled: "
            f"{' '.join(enabled) or 'none'})"
        )
    return path, f"cgroup v2 at {path} (this process's group)"


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


class Enclosure:
    """Puts each started sandbox inside its bounds: a cgroup of its own, or its slot's CPUs. Called once the
    runner is ready and before it has a job, when bwrap and the runner are the sandbox's only processes: all
    that the program starts inherits the group, or the CPUs."""

    def __init__(self, plan: Plan, cpus: int):
        self.plan, self.cpus = plan, cpus
        self.host_cpus = sorted(os.sched_getaffinity(0))
        self.root: Path | None = None
        self._count = 0
        if plan.cgroup is not None:
            wanted = ["memory", "pids"] + (
                ["cpu"] if "cpu" in _words(plan.cgroup / "cgroup.controllers") else []
            )
            self._controllers = " ".join(f"+{c}" for c in wanted)
            try:
                if not set(wanted) <= _words(plan.cgroup / "cgroup.subtree_control"):
                    (plan.cgroup / "cgroup.subtree_control").write_text(self._controllers)
                self.root = plan.cgroup / f"asyncrl-sandboxes-{os.getpid()}-{id(self):x}"
                self.root.mkdir()
                (self.root / "memory.max").write_text(str(plan.pool_mb << 20))
                (self.root / "cgroup.subtree_control").write_text(self._controllers)
            except OSError as e:
                raise SandboxUnavailable(
                    f"cgroup v2 at {plan.cgroup}: cannot set up the sandboxes' groups: {e}"
                ) from None

    def enclose(self, slot: int, pids: list[int], nproc: int) -> Path | None:
        """Bound the sandbox whose processes are ``pids``; its group (None: pinned instead) for
        :meth:`release`."""
        if self.root is None:
            n = len(self.host_cpus)
            mine = {self.host_cpus[(slot * self.cpus + i) % n] for i in range(self.cpus)}
            for pid in pids:
                os.sched_setaffinity(pid, mine)
            return None
        self._count += 1
        group = self.root / f"sandbox-{slot}-{self._count}"
        group.mkdir()
        settings = {"memory.max": self.plan.sandbox_mb << 20, "memory.swap.max": 0, "pids.max": nproc}
        if "+cpu" in self._controllers:
            settings["cpu.max"] = f"{self.cpus * 100000} 100000"  # type: ignore[assignment]
        for name, value in settings.items():
            if (group / name).exists():  # memory.swap.max: absent on a kernel without swap accounting
                (group / name).write_text(str(value))
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        return group

    def release(self, group: Path | None) -> None:
        """Remove a sandbox's group once it is killed (its PID namespace, hence the group, is empty by
        then)."""
        if group is None:
            return
        try:
            group.rmdir()
        except OSError:  # a process still leaving: cgroup.kill ends it, and the group goes with the pool's
            try:
                (group / "cgroup.kill").write_text("1")
            # a kernel without cgroup.kill (before 5.14): the pool's close removes what it can
            except OSError:
                pass

    def close(self) -> None:
        if self.root is None:
            return
        for group in sorted(self.root.glob("sandbox-*"), reverse=True):
            try:
                group.rmdir()
            except OSError:
                pass
        try:
            self.root.rmdir()
        except OSError:
            pass
